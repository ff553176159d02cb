"""`%load_ext mldebug` in the IPython terminal: a stop in a cell opens mldebug's prompt
on the terminal, `c` runs the cell on; an uncaught exception opens its post-mortem."""
from __future__ import annotations

import sys

import pytest

from conftest import clean_env

pexpect = pytest.importorskip("pexpect")
pytest.importorskip("IPython")


def ipython(on: str, **env):
    """The IPython terminal in a pty, `%mldebug ON` typed as its third cell; the child
    and the list its output is written to."""
    child = pexpect.spawn(sys.executable, ["-m", "IPython", "--no-banner", "--colors=NoColor",
                                           "--simple-prompt", "--HistoryManager.enabled=False"],
                          env=clean_env(TERM="dumb", **env), encoding="utf-8", timeout=120,
                          dimensions=(40, 200))
    transcript = []
    child.logfile_read = type("Log", (), {"write": lambda self, s: transcript.append(s),
                                          "flush": lambda self: None})()
    for n, line in enumerate(["import torch, mldebug", "%load_ext mldebug", on], 1):
        child.expect_exact(f"In [{n}]: ")
        child.sendline(line)
    return child, transcript


def test_a_stop_and_a_post_mortem_in_the_ipython_terminal():
    child, transcript = ipython("%mldebug on")
    try:
        child.expect_exact("In [4]: ")
        child.sendline("x = torch.zeros(3); y = x / x; print('after', int(y.isnan().sum()))")
        child.expect_exact("(mldebug) ")
        child.sendline("inspect x")
        child.expect_exact("(mldebug) ")
        child.sendline("c")
        child.expect_exact("In [5]: ")
        child.sendline("print(mldebug.last_stop().op)")
        child.expect_exact("In [6]: ")
        child.sendline("def f(v):\n    return 1 / v\n")
        child.expect_exact("In [7]: ")
        child.sendline("f(0)")
        child.expect_exact("(mldebug) ")
        child.sendline("p v + 41")
        child.expect_exact("(mldebug) ")
        child.sendline("q")
        child.expect_exact("In [8]: ")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    out = "".join(transcript).replace("\r\n", "\n")
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
    child, transcript = ipython("%mldebug on --break-on nan", MLDEBUG_SIMULATE_DEVICE="1")
    try:
        child.expect_exact("In [4]: ")
        child.sendline("x = torch.zeros(3); y = torch.log(x) * 0; print('after')")
        child.expect_exact("(mldebug) ")
        child.sendline("p x + 1")
        child.expect_exact("(mldebug) ")
        child.sendline("c")
        child.expect_exact("In [5]: ")
        child.sendline("exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    out = "".join(transcript).replace("\r\n", "\n")
    assert "mldebug: 3 NaN from aten.mul.Tensor (torch.mul) at <ipython-input-4-" in out
    assert "> <ipython-input-4-" in out and ">(1)<module>()" in out
    assert "tensor([1., 1., 1.])" in out
    assert out.index("after") < out.index("mldebug: 3 NaN")
