"""A stop in a cell of a front end with an input box (JupyterLab, VS Code): mldebug's
prompt reads its commands through the kernel's input requests. A kernel client plays
the front end: it executes cells with allow_stdin and answers each `input_request`."""
from __future__ import annotations

import json

import pytest

from conftest import clean_env

pytest.importorskip("ipykernel")
manager = pytest.importorskip("jupyter_client.manager")

TIMEOUT = 240

CELL = """\
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
x = torch.randn(32, 4)
out = model(x)
bad = torch.log(out - 10.0)  # here
print("after the stop:", int(torch.isnan(bad).sum()))
"""


class Frontend:
    """A kernel client that answers input requests from a list, as a user types."""

    def __init__(self, client):
        self.client = client

    def run(self, code: str, answers=(), allow_stdin: bool = True):
        """Execute CODE; (status, text of the outputs, prompts seen)."""
        answers, prompts, text = list(answers), [], []

        def on_input(msg):
            prompts.append(msg["content"]["prompt"])
            self.client.input(answers.pop(0) if answers else "q")

        def on_output(msg):
            kind, content = msg["header"]["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                text.append(content["data"].get("text/plain", "") + "\n")
            elif kind == "error":
                text.append(f"{content['ename']}: {content['evalue']}\n")

        reply = self.client.execute_interactive(
            code, allow_stdin=allow_stdin, stdin_hook=on_input, output_hook=on_output,
            timeout=TIMEOUT)
        return reply["content"]["status"], "".join(text), prompts


@pytest.fixture(scope="module")
def frontend(tmp_path_factory):
    km, kc = manager.start_new_kernel(kernel_name="python3", startup_timeout=TIMEOUT,
                                      env=clean_env(), cwd=str(tmp_path_factory.mktemp("k")))
    try:
        front = Frontend(kc)
        status, text, _ = front.run("import json, sys, torch, mldebug\n%load_ext mldebug\n"
                                    "%mldebug on")
        assert status == "ok", text
        yield front
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def test_the_prompt_opens_in_the_input_box_and_continue_ends_the_cell(frontend):
    status, text, prompts = frontend.run(CELL, ["inspect out", "why", "c"])
    assert prompts == ["(mldebug) "] * 3
    assert status == "ok", text
    assert "mldebug: 32 NaN from aten.log.default (torch.log)" in text
    assert "out: tensor[32, 1] f32" in text             # inspect, through the input box
    assert "after the stop: 32" in text                  # `c`: the cell ran to its end
    status, text, _ = frontend.run("print(json.dumps(mldebug.last_stop().to_dict()))",
                                   allow_stdin=False)
    stop = json.loads(text.strip().splitlines()[-1])
    assert stop["op"] == "aten.log.default" and stop["line"] == 5 and stop["reason"] == "nan"


def test_quit_at_the_prompt_ends_the_cell_with_the_stop(frontend):
    status, text, prompts = frontend.run(CELL, ["q"])
    assert prompts == ["(mldebug) "]
    assert status == "error"
    assert "StopInCell: mldebug: stop: 32 NaN from aten.log.default" in text
    assert "after the stop: 32" not in text               # the cell ended at the stop


def test_an_uncaught_exception_opens_mldebugs_post_mortem(frontend):
    status, text, prompts = frontend.run("def f(v):\n    return 1 / v\nf(0)", ["p v + 41", "q"])
    assert status == "error"
    assert prompts == ["(mldebug) "] * 2
    assert "mldebug: uncaught ZeroDivisionError: division by zero" in text
    assert "\n41\n" in text                              # at the user's innermost frame
    # %debug afterwards is mldebug's prompt as well
    status, text, prompts = frontend.run("%debug", ["p v", "q"])
    assert prompts == ["(mldebug) "] * 2 and "\n0\n" in text


COUNTS = ("from torch.nn.modules import module as m\n"
          "print(json.dumps([torch._C._len_torch_dispatch_stack(), len(m._global_forward_hooks),"
          " len(m._global_forward_pre_hooks), torch.autograd.backward.__module__]))")


def test_an_interrupted_cell_leaves_only_the_next_cells_engines(frontend):
    status, text, _ = frontend.run(COUNTS, allow_stdin=False)
    baseline = json.loads(text.strip().splitlines()[-1])   # one cell's engines
    assert baseline[0] >= 1
    status, text, _ = frontend.run(
        "import threading, _thread\n"
        "threading.Timer(1.0, _thread.interrupt_main).start()   # the kernel's interrupt\n"
        "lin = torch.nn.Linear(64, 64)\n"
        "while True:\n"
        "    lin(torch.randn(64, 64)).sum().backward()\n", allow_stdin=False)
    assert status == "error" and "KeyboardInterrupt" in text
    status, text, _ = frontend.run(COUNTS, allow_stdin=False)
    assert json.loads(text.strip().splitlines()[-1]) == baseline


def test_off_leaves_nothing_installed(frontend):
    status, text, _ = frontend.run(
        "%mldebug off\n"
        "from torch.nn.modules import module as m\n"
        "ip = get_ipython()\n"
        "print(json.dumps([torch._C._len_torch_dispatch_stack(), len(m._global_forward_hooks),"
        " repr(sys.gettrace()), ip.call_pdb, type(ip.InteractiveTB.debugger_cls).__name__]))",
        allow_stdin=False)
    assert status == "ok", text
    assert json.loads(text.strip().splitlines()[-1]) == [0, 0, "None", False, "type"]
