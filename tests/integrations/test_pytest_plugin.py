"""`pytest --mldebug` and `pytest --mldebug-report`, run as a user runs pytest on their own
tests (a subprocess, the plugin found through its `pytest11` entry point when mldebug is
installed, as scripts/setup.sh installs it)."""
from __future__ import annotations

import importlib.metadata
import subprocess
import sys

from conftest import clean_env, marker_line, read_report

USER_TESTS = """
    import torch


    def test_a_healthy_step():
        w = torch.ones(3, requires_grad=True)
        (w * 2).sum().backward()
        assert w.grad.tolist() == [2.0, 2.0, 2.0]


    def test_a_log_of_a_negative():
        x = torch.tensor([1.0, -1.0])
        y = torch.log(x)  # here
        assert y.shape == (2,)


    def test_after_the_stop():
        assert torch.ones(2).sum().item() == 2.0
"""


def _pytest(path, *options, stdin=""):
    installed = any(e.name == "mldebug" and e.value == "mldebug.integrations.pytest_plugin"
                    for e in importlib.metadata.entry_points(group="pytest11"))
    load = [] if installed else ["-p", "mldebug.integrations.pytest_plugin"]
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *load, *options, str(path)], input=stdin, capture_output=True,
                          text=True, cwd=path.parent, env=clean_env(), timeout=300)


def test_the_entry_point_is_declared():
    from conftest import REPO
    text = (REPO / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\n' in text
    assert 'mldebug = "mldebug.integrations.pytest_plugin"' in text


def test_a_report_fails_the_test_at_its_first_nan_and_the_others_run(write_program, tmp_path):
    tests = write_program(USER_TESTS, "test_user_model.py")
    report = tmp_path / "stops.jsonl"
    result = _pytest(tests, "--mldebug-report", report)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "1 failed, 2 passed" in result.stdout
    # the reason is the stop's line (the summary line is cut to the terminal's width)
    assert "FAILED test_user_model.py::test_a_log_of_a_negative - Failed: mldebug: 1 NaN" \
        in result.stdout
    assert (f"mldebug: 1 NaN from aten.log.default (torch.log) at test_user_model.py:"
            f"{marker_line(tests)} [forward]; this op made it from finite inputs") in result.stdout
    (stop,) = read_report(report)
    assert (stop["reason"], stop["op"], stop["function"]) == (
        "nan", "aten.log.default", "test_a_log_of_a_negative")
    assert (stop["file"], stop["line"]) == (str(tests), marker_line(tests))


def test_on_a_device_a_stop_still_fails_its_own_test(write_program, tmp_path):
    # a GPU's watch judges its window at the next read: the test's end is one
    tests = write_program(USER_TESTS, "test_user_model.py")
    (tests.parent / "conftest.py").write_text(
        "from mldebug.watch import core\n"
        "core.simulate_device(True)      # the device (GPU) path, taken by CPU tensors\n")
    report = tmp_path / "stops.jsonl"
    result = _pytest(tests, "--mldebug-report", report)
    assert "1 failed, 2 passed" in result.stdout, result.stdout + result.stderr
    assert "FAILED test_user_model.py::test_a_log_of_a_negative - Failed: mldebug: 1 NaN" \
        in result.stdout
    (stop,) = read_report(report)
    assert (stop["reason"], stop["op"], stop["line"]) == (
        "nan", "aten.log.default", marker_line(tests))


def test_the_prompt_opens_through_pytests_capture(write_program):
    tests = write_program(USER_TESTS, "test_user_model.py")
    result = _pytest(tests, "--mldebug", stdin="why\np x\nc\n")
    out = result.stdout
    assert f"> {tests}({marker_line(tests)})test_a_log_of_a_negative()" in out
    assert "root cause: this op made the non-finite value from finite inputs" in out
    assert "tensor([ 1., -1.])" in out                     # `p x` in the test's frame
    assert "reading from stdin while output is captured" not in out + result.stderr
    assert "3 passed" in out                               # `c`: the test goes on


def test_on_a_device_a_stop_found_at_the_tests_end_opens_over_its_names(write_program):
    # a GPU's watch judges the test's NaN (outside model calls, no read after it) only
    # once the test function has returned: the prompt opens at its last line, where
    # `p x` reads the test's own names, not in mldebug's frame
    tests = write_program(USER_TESTS, "test_user_model.py")
    (tests.parent / "conftest.py").write_text(
        "from mldebug.watch import core\n"
        "core.simulate_device(True)      # the device (GPU) path, taken by CPU tensors\n")
    result = _pytest(tests, "--mldebug", stdin="p x\nwhy\nc\n")
    out = result.stdout
    last = marker_line(tests) + 1                          # `assert y.shape == (2,)`
    assert f"> {tests}({last})<end of test>()" in out, out + result.stderr
    assert "(found at the test's end: paused at its last line" in out
    assert "tensor([ 1., -1.])" in out                     # `p x`: the test's x
    assert "root cause: this op made the non-finite value from finite inputs" in out
    assert "NameError" not in out
    assert "3 passed" in out                               # `c`: the tests go on


def test_under_the_cli_on_a_device_each_tests_end_is_a_read(write_program):
    """`python -m mldebug -m pytest` on a GPU: the test's NaN is found as the test ends,
    over its names, not after the whole run in mldebug's frame."""
    tests = write_program(USER_TESTS, "test_user_model.py")
    result = subprocess.run([sys.executable, "-m", "mldebug", "-m", "pytest", "-q", "-p",
                             "no:cacheprovider", str(tests)], input="p x\nc\n",
                            capture_output=True, text=True, cwd=tests.parent,
                            env={**clean_env(), "MLDEBUG_SIMULATE_DEVICE": "1"}, timeout=300)
    out = result.stdout
    assert f"> {tests}({marker_line(tests) + 1})<end of test>()" in out, out + result.stderr
    assert "tensor([ 1., -1.])" in out and "NameError" not in out
    assert out.index("<end of test>") < out.index("3 passed")   # found as that test ended


def test_without_its_options_the_plugin_does_nothing(write_program):
    tests = write_program(USER_TESTS, "test_user_model.py")
    result = _pytest(tests)
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout


def test_under_the_cli_the_prompt_works_without_dash_s(write_program):
    """`python -m mldebug -m pytest`: the CLI's prompt, with pytest's capture let go."""
    tests = write_program(USER_TESTS, "test_user_model.py")
    result = subprocess.run([sys.executable, "-m", "mldebug", "-m", "pytest", "-q", "-p",
                             "no:cacheprovider", str(tests)], input="p x\nc\n",
                            capture_output=True, text=True, cwd=tests.parent,
                            env=clean_env(), timeout=300)
    out = result.stdout
    assert f"> {tests}({marker_line(tests)})test_a_log_of_a_negative()" in out
    assert "tensor([ 1., -1.])" in out
    assert "reading from stdin while output is captured" not in out + result.stderr
    assert "3 passed" in out, out + result.stderr
