"""The CLI in a pseudo-terminal, as a person at a keyboard uses it: IPython's prompt,
tab completion, and the exit status."""
from __future__ import annotations

import io
import re
import subprocess
import sys
import time

import pytest

from conftest import clean_env

pexpect = pytest.importorskip("pexpect")

# What a user sees: "(mldebug)" and a space. IPython >= 9.18 draws that trailing space as
# a cursor move, so the prompt is matched without it.
PROMPT = r"\(mldebug\)"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")


def spawn(args, cwd, **env):
    child = pexpect.spawn(sys.executable, ["-m", "mldebug", *args], cwd=str(cwd),
                          env=clean_env(**env), encoding="utf-8", timeout=180,
                          dimensions=(40, 160))
    child.logfile_read = io.StringIO()   # the whole screen, for `everything`
    return child


def screen_before(child) -> str:
    """What the terminal showed before the last match, without escape sequences."""
    return ANSI.sub("", child.before)


def everything(child) -> str:
    """All the terminal showed so far, without escape sequences."""
    return ANSI.sub("", child.logfile_read.getvalue())


# A 10,000-step loop: long enough under mldebug for a Ctrl-C to land in it; it prints
# a digest of the final weights, the same bytes whether or not it was paused.
TRAIN = """
    import hashlib
    import torch
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(10000):
        optimizer.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        if step == 50:
            print("training", flush=True)
    data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
    print("weights", hashlib.sha256(data).hexdigest(), flush=True)
"""


@pytest.mark.parametrize("prompt", ["ipython", "plain"])
def test_ctrl_c_pauses_at_the_users_line_and_c_resumes_bitwise(write_program, tmp_path, prompt):
    path = write_program(TRAIN, name="train.py")
    plain = subprocess.run([sys.executable, str(path)], capture_output=True, text=True,
                           env=clean_env(), timeout=600, check=True)
    expected = re.search(r"weights (\w+)", plain.stdout).group(1)
    child = spawn((["--plain"] if prompt == "plain" else []) + ["train.py"], tmp_path)
    child.expect("training")
    child.sendintr()
    child.expect(r"mldebug: interrupted \(Ctrl-C\) at train\.py:(\d+) in <module>")
    line = int(child.match.group(1))
    # a line of the loop body, never inside torch or half way through optimizer.step()
    assert 9 <= line <= 15, line
    child.expect(PROMPT)
    child.sendline("inspect loss")
    child.expect(r"tensor\[\] f32")
    child.expect(PROMPT)
    child.sendline("history")
    child.expect(r"history of the model: steps \d+\.\.\d+")
    child.expect(r"‖\d\.(weight|bias)‖")   # a column per parameter, rows of norms
    child.expect(PROMPT)
    child.sendline("graph")
    child.expect(r"Sequential")             # the last forward pass, module by module
    child.expect(r"Linear")
    child.expect(PROMPT)
    child.sendline("c")
    # the rest of the 10,000 steps: ~80 s on a loaded 2-core machine, so wait on the
    # line itself, not on a time the machine may not meet
    child.expect(r"weights (\w+)", timeout=600)
    assert child.match.group(1) == expected
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@pytest.mark.parametrize("prompt", ["ipython", "plain"])
def test_a_second_ctrl_c_ends_the_program(write_program, tmp_path, prompt):
    write_program(TRAIN, name="train.py")
    child = spawn((["--plain"] if prompt == "plain" else []) + ["train.py"], tmp_path)
    child.expect("training")
    child.sendintr()
    time.sleep(0.25)          # a person's double press, not one coalesced signal
    child.sendintr()
    child.expect("mldebug: ended by Ctrl-C")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    shown = everything(child)
    assert "KeyboardInterrupt" in shown and "train.py" in shown
    assert "weights" not in shown          # it ended: the loop did not run to its end
    assert "post-mortem" not in shown      # ended, not a prompt to quit


@pytest.mark.parametrize("prompt", ["ipython", "plain"])
def test_ctrl_c_at_the_pause_prompt_ends_the_program(write_program, tmp_path, prompt):
    write_program(TRAIN, name="train.py")
    child = spawn((["--plain"] if prompt == "plain" else []) + ["train.py"], tmp_path)
    child.expect("training")
    child.sendintr()
    child.expect(r"interrupted \(Ctrl-C\)")
    child.expect(PROMPT)
    time.sleep(1.5)           # well past a double press: this is Ctrl-C at the prompt
    child.sendintr()
    child.expect("mldebug: ended by Ctrl-C")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130


def test_enter_submits_an_unbalanced_line_on_the_ipython_prompt(write_program, tmp_path):
    write_program("""
        import torch
        x = torch.ones(3)
        breakpoint()
        print("finished")
    """)
    child = spawn(["prog.py"], tmp_path)
    child.expect(PROMPT)
    child.sendline("inspect (")
    child.expect(r"inspect \(: SyntaxError")
    child.expect(PROMPT)
    child.sendline("c")
    child.expect("finished")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


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


def test_ipdb_context_setting_is_honoured(write_program, tmp_path):
    write_program("""
        a = 1
        b = 2
        breakpoint()
        c = 3
        d = 4
    """)
    child = spawn(["prog.py"], tmp_path, IPDB_CONTEXT_SIZE="1")
    child.expect(PROMPT)
    listing = screen_before(child)
    assert "----> 5" in listing
    assert "b = 2" not in listing and "d = 4" not in listing   # one line of context
    child.sendline("c")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_under_batch_ctrl_c_ends_the_program(write_program, tmp_path):
    write_program(TRAIN, name="train.py")
    child = spawn(["--batch", "train.py"], tmp_path)
    child.expect("training")
    child.sendintr()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 130
    shown = everything(child)
    assert "KeyboardInterrupt" in shown and "weights" not in shown
    assert "interrupted (Ctrl-C)" not in shown       # no pause: a CI run never waits
