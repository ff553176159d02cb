"""The CLI in a pseudo-terminal, as a person at a keyboard uses it: IPython's prompt,
tab completion, and the exit status."""
from __future__ import annotations

import re
import sys

import pytest

from conftest import clean_env

pexpect = pytest.importorskip("pexpect")

PROMPT = r"\(mldebug\) "
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def spawn(args, cwd):
    return pexpect.spawn(sys.executable, ["-m", "mldebug", *args], cwd=str(cwd),
                         env=clean_env(), encoding="utf-8", timeout=60,
                         dimensions=(40, 160))


def test_terminal_session_inspect_complete_and_continue(write_program, tmp_path):
    write_program("""
        import torch
        weights_of_layer = torch.linspace(-1, 1, 12).reshape(3, 4)
        breakpoint()
        print("finished", float(weights_of_layer.abs().max()))
    """)
    child = spawn(["prog.py"], tmp_path)
    child.expect(PROMPT)
    # IPython's debugger on a terminal: coloured source listing
    assert "\x1b[" in child.before
    child.sendline("inspect weights_of_layer")
    # prompt_toolkit redraws the prompt while typing: wait for the summary itself
    child.expect(r"tensor\[3, 4\] f32")
    child.expect(PROMPT)
    child.sendline("c")
    child.expect("finished 1.0")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_plain_prompt_completes_expressions_after_inspect(write_program, tmp_path):
    write_program("""
        import torch
        weights_of_layer = torch.ones(3)
        breakpoint()
    """)
    child = spawn(["--plain", "prog.py"], tmp_path)
    child.expect(PROMPT)
    child.send("inspect weights_of_l\t")
    child.expect("layer")  # readline completed the name
    child.send("\r")
    child.expect(PROMPT)
    assert "tensor[3] f32" in ANSI.sub("", child.before)
    child.sendline("c")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_terminal_post_mortem_then_quit_keeps_exit_status_1(write_program, tmp_path):
    write_program("""
        def divide(a, b):
            return a / b
        divide(1, 0)
    """)
    child = spawn(["prog.py"], tmp_path)
    child.expect("ZeroDivisionError")
    child.expect(PROMPT)
    child.sendline("p a, b")
    child.expect(r"\(1, 0\)")
    child.expect(PROMPT)
    child.sendline("q")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 1
