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
the options are all it adds to every pytest run — except under `python -m mldebug -m
pytest`, where mldebug's CLI already runs the watch and its prompt: then the plugin only
suspends pytest's capture while that prompt runs, so it works without `-s`.
"""
from __future__ import annotations

import sys

from ._pytest_capture import capture_suspended


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
        _free_the_cli_prompt(config)
        return
    # (here, not at the top: a pytest run that does not ask for mldebug loads no torch)
    from ._pytest_session import MLDebugPytest
    from ._pytest_test_end import ReadAtTestEnd

    config.pluginmanager.register(MLDebugPytest(config, report), "mldebug-session")
    # on a GPU the watch judges what it holds at its next read: each test's end is one
    config.pluginmanager.register(ReadAtTestEnd(), "mldebug-test-end")


def _free_the_cli_prompt(config) -> None:
    """Under `python -m mldebug -m pytest` the CLI's prompt pauses a test: wrap it so that
    pytest's capture lets go of the terminal meanwhile (it would die reading stdin)."""
    # only if mldebug is loaded already (the CLI): a plain pytest run imports nothing
    session_module = sys.modules.get("mldebug.core.session")
    session = session_module.current_if_any() if session_module is not None else None
    if session is None or session.pauser is None:
        return
    from ._pytest_test_end import ReadAtTestEnd
    # (the CLI's watch on a GPU: each test's end is a read, over the test's names)
    config.pluginmanager.register(ReadAtTestEnd(), "mldebug-test-end")
    if session.batch:
        return
    pauser = session.pauser

    def pause_with_capture_suspended(stop, frame):
        with capture_suspended(config):
            pauser(stop, frame)

    session.pauser = pause_with_capture_suspended
    config.add_cleanup(lambda: setattr(session, "pauser", pauser))
