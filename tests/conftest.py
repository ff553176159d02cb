"""Shared helpers: run the real CLI in a subprocess, as a user would."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent       # tests/ mirrors mldebug/; shared programs stay here
REPO = TESTS.parent
PROGRAMS = TESTS / "programs"
# Debian's chromium, driven by Playwright (never a downloaded browser)
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]


@contextlib.contextmanager
def headless_chromium():
    """A headless /usr/bin/chromium launched by Playwright; skips the test without it."""
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} missing: apt-get install chromium (scripts/setup_vscode_e2e.sh does)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture(autouse=True)
def _no_capture_left_open():
    """A test that leaves a CUDA graph capture counted as open (core.cuda_graphs.MAYBE:
    a pretended `capture_begin` with no `capture_end`) fails here, and the count is put
    back: else every later test's hooks ask whether a capture runs, and the call counts
    of tests/watch/test_op_budget.py grow by ~10 a module call."""
    yield
    graphs = sys.modules.get("mldebug.core.cuda_graphs")
    if graphs is not None and graphs.MAYBE[0]:
        left, graphs.MAYBE[0] = graphs.MAYBE[0], 0
        pytest.fail(f"the test left {left} CUDA graph capture(s) counted as open "
                    "(core.cuda_graphs.MAYBE): end them, or monkeypatch MAYBE")


def clean_env(**extra) -> dict:
    env = dict(os.environ)
    for key in ("PYTHONBREAKPOINT", "MLDEBUG_PLAIN", "PYTHONSTARTUP"):
        env.pop(key, None)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


def run_cli(args, stdin: str = "", cwd=None, env=None, timeout: float = 120):
    """`python -m mldebug ARGS` with STDIN fed as typed commands."""
    return subprocess.run([sys.executable, "-m", "mldebug", *args], input=stdin,
                          capture_output=True, text=True, cwd=cwd,
                          env=env or clean_env(), timeout=timeout)


def read_report(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def marker_line(path, marker: str = "# here") -> int:
    """Line number (1-based) of the line carrying MARKER."""
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if marker in line:
            return number
    raise AssertionError(f"no {marker!r} in {path}")


@pytest.fixture
def write_program(tmp_path):
    """Write a dedented program to tmp_path/NAME and return its path."""
    def write(source: str, name: str = "prog.py") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        return path
    return write


# The watch and the recorder have a host path and a device path (reads batched per
# device, CUDA RNG states, events): tests that take `device` run on the CPU, on the CPU
# with the watch's and the recorder's device paths (what CI, which has no GPU, can run
# of them) and on CUDA, skipped without a GPU (they were run on a lent H100).
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@contextlib.contextmanager
def cpu_as_device():
    """The watch's and the recorder's device (GPU) paths, taken by CPU tensors."""
    from mldebug.record import stats
    from mldebug.watch import core
    before = _DEVICE_PATH[0]
    core.simulate_device(True)
    stats.simulate_device(True)
    try:
        yield "cpu"
    finally:
        core.simulate_device(before)
        stats.simulate_device(before)


# `pytest --device-path tests/watch`: every test on the device path (what a GPU runs),
# the CLI's subprocesses too (MLDEBUG_SIMULATE_DEVICE=1, which they inherit). Tests that
# assert the host path's timing (a stop raised inside the op, a pause at its line) fail
# there by design; a different stop, or none, is what this is for: the host path's
# verdicts are the reference
_DEVICE_PATH = [False]


def pytest_addoption(parser):
    parser.addoption("--device-path", action="store_true", default=False,
                     help="run the tests on the watch's and the recorder's device paths "
                          "(CPU tensors taking the GPU path), the CLI's subprocesses too")


def pytest_configure(config):
    if config.getoption("--device-path"):
        from mldebug.record import stats
        from mldebug.watch import core
        _DEVICE_PATH[0] = True
        core.simulate_device(True)
        stats.simulate_device(True)
        os.environ["MLDEBUG_SIMULATE_DEVICE"] = "1"      # (the CLI's tests: a subprocess)


@pytest.fixture(params=["cpu", "cpu-as-device", pytest.param("cuda", marks=needs_cuda)])
def device(request):
    if request.param != "cpu-as-device":
        yield request.param
        return
    with cpu_as_device() as dev:
        yield dev


# A training run whose head's weight blows up until exp overflows: the history tests
# (tests/record/test_history.py) and their CUDA twin (tests/test_cuda_paths.py)
BLOWUP = """
    import torch
    import torch.nn as nn

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 1)

        def forward(self, x):
            return self.lin(x).exp()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Head())
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(32, 4)
    for step in range(40):
        opt.zero_grad()
        loss = model(x).mean()   # here: exp overflows once the head's weight is large
        loss.backward()
        with torch.no_grad():
            model[2].lin.weight.mul_(3.0)   # planted: the head's weight blows up
        opt.step()
    print("finished")
"""
