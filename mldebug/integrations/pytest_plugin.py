"""The pytest plugin (entry point `pytest11`, loaded by pytest once mldebug is installed):

    pytest --mldebug                           # stop at the first NaN/Inf or assertion of
                                               # a test, at mldebug's prompt (as --pdb does)
    pytest --mldebug-report stops.jsonl        # CI: the test fails at its first stop with
                                               # the stop's one line as the reason

The watch, the graph capture and the assertions run for the whole test session. At a
stop, pytest's capture is suspended while the prompt runs (what `--pdb` does), so the
prompt reads the terminal instead of dying on captured stdin. With a report, nothing
prompts: the stop is written to the file and the test fails, the others run on.

Without either option the plugin does nothing, and mldebug and torch are not imported:
the options are all it adds to every pytest run.
"""
from __future__ import annotations


def pytest_addoption(parser):
    group = parser.getgroup("mldebug", "mldebug: stop on the first NaN/Inf of a test")
    group.addoption("--mldebug", action="store_true", default=False,
                    help="watch the tests for NaN/Inf and assertion violations; pause at "
                         "mldebug's prompt at the first one (pytest's capture suspended)")
    group.addoption("--mldebug-report", metavar="PATH", default=None,
                    help="never prompt: append every stop to PATH as one JSON line and fail "
                         "the test at its first stop, with the stop's message")


def pytest_configure(config):
    report = config.getoption("mldebug_report")
    if not (config.getoption("mldebug") or report):
        return
    # (here, not at the top: a pytest run that does not ask for mldebug loads no torch)
    from ._pytest_session import MLDebugPytest

    config.pluginmanager.register(MLDebugPytest(config, report), "mldebug-session")
