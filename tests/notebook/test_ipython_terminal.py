"""`%load_ext mldebug` in the IPython terminal: a stop in a cell opens mldebug's prompt
on the terminal, `c` runs the cell on; an uncaught exception opens its post-mortem."""
from __future__ import annotations

import sys

import pytest

from conftest import clean_env

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("IPython")


def ipython(on: str, steps: list, **env) -> str:
    """The IPython terminal in a pty: `%mldebug ON` typed as its third cell, then each
    (prompt awaited, line typed) of STEPS, then `exit`; what it printed."""
    child = pexpect.spawn(sys.executable, ["-m", "IPython", "--no-banner", "--colors=NoColor",
                                           "--simple-prompt", "--HistoryManager.enabled=False"],
                          env=clean_env(TERM="dumb", **env), encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    transcript = []
    child.logfile_read = type("Log", (), {"write": lambda self, s: transcript.append(s),
                                          "flush": lambda self: None})()
    cells = [("In [1]: ", "import torch, mldebug"), ("In [2]: ", "%load_ext mldebug"),
             ("In [3]: ", on)]
    try:
        for prompt, line in cells + steps:
            child.expect_exact(prompt)
            child.sendline(line)
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    return "".join(transcript).replace("\r\n", "\n")


def test_a_stop_and_a_post_mortem_in_the_ipython_terminal():
    out = ipython("%mldebug on", [
        ("In [4]: ", "x = torch.zeros(3); y = x / x; print('after', int(y.isnan().sum()))"),
        ("(mldebug) ", "inspect x"),
        ("(mldebug) ", "c"),
        ("In [5]: ", "print(mldebug.last_stop().op)"),
        ("In [6]: ", "def f(v):\n    return 1 / v\n"),
        ("In [7]: ", "f(0)"),
        ("(mldebug) ", "p v + 41"),
        ("(mldebug) ", "q"),
        ("In [8]: ", "exit")])
    assert "mldebug: 3 NaN from aten.div.Tensor (torch.div) at <ipython-input-4-" in out
    assert "x: tensor[3] f32" in out
    assert "after 3" in out
    assert "\naten.div.Tensor\n" in out
    assert "mldebug: uncaught ZeroDivisionError: division by zero" in out
    assert "\n41\n" in out


def test_on_a_device_a_stop_read_at_the_cells_end_opens_the_prompt_in_the_cell():
    """On a GPU (the device path, simulated) an op outside model calls waits for the next
    read; a cell that runs no step after it ends with that read (cell_end.py), so the
    prompt opens in the cell's frame, where its names are, and `c` ends the cell."""
    out = ipython("%mldebug on --break-on nan", [
        ("In [4]: ", "x = torch.zeros(3); y = torch.log(x) * 0; print('after')"),
        ("(mldebug) ", "p x + 1"),
        ("(mldebug) ", "c"),
        ("In [5]: ", "exit")], MLDEBUG_SIMULATE_DEVICE="1")
    assert "mldebug: 3 NaN from aten.mul.Tensor (torch.mul) at <ipython-input-4-" in out
    assert "> <ipython-input-4-" in out and ">(1)<module>()" in out
    assert "tensor([1., 1., 1.])" in out
    assert out.index("after") < out.index("mldebug: 3 NaN")


@pytest.mark.parametrize("path", ["host", "device"])
def test_mldebugs_summary_of_a_nan_in_a_cell_is_no_stop(path):
    """`%mldebug on`, then `mldebug.summary(x)` of a tensor holding a NaN from the data:
    mldebug's own look (its aminmax of the tensor) is no stop; the cell's own use of the
    NaN still is."""
    env = {"MLDEBUG_SIMULATE_DEVICE": "1"} if path == "device" else {}
    out = ipython("%mldebug on", [
        ("In [4]: ", "import numpy as np; t = torch.from_numpy("
                     "np.array([[1.0, np.nan], [2.0, 3.0]], dtype=np.float32))"),
        ("In [5]: ", "print('seen', mldebug.summary(t)); print('described', "
                     "mldebug.describe(t).count('NaN') > 0)"),
        ("In [6]: ", "y = t * 2; print('used')"),
        ("(mldebug) ", "c"),
        ("In [7]: ", "exit")], **env)
    assert "seen tensor[2, 2] f32" in out and "NaN!1" in out and "described True" in out
    assert out.index("described True") < out.index("mldebug: 1 NaN from aten.mul.Tensor")
    assert out.count("(mldebug) ") == 1
