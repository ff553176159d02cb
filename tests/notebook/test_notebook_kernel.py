"""`%load_ext mldebug` in a real Jupyter kernel (ipykernel), driven by nbclient as
papermill and CI drive notebooks: no input box (allow_stdin is off), so a stop ends the
cell with StopInCell naming it, `mldebug.last_stop()` has it in the next cell, a clean
cell computes the same bits as without mldebug and leaves nothing installed, and a
summary shows as HTML."""
from __future__ import annotations

import json
import sys
import textwrap

import pytest

from conftest import REPO, clean_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

TIMEOUT = 240      # per cell: a cold kernel imports torch on a busy 2-core machine

SETUP = """\
import json, sys
import torch
import mldebug
from torch.nn.modules import module as module_hooks
from torch.optim import optimizer as optim_hooks
print(json.dumps({"executable": sys.executable, "mldebug": mldebug.__file__}))

def installed():
    \"\"\"What mldebug could leave behind: modes, global hooks, patches, a tracer.\"\"\"
    from mldebug.watch import active_watch
    from mldebug.graph import active_capture
    return dict(
        dispatch_modes=torch._C._len_torch_dispatch_stack(),
        function_modes=len(torch.overrides._get_current_function_mode_stack()),
        forward_pre=len(module_hooks._global_forward_pre_hooks),
        forward=len(module_hooks._global_forward_hooks),
        forward_always=len(module_hooks._global_forward_hooks_always_called),
        backward=len(module_hooks._global_backward_hooks),
        backward_pre=len(module_hooks._global_backward_pre_hooks),
        optimizer_pre=len(optim_hooks._global_optimizer_pre_hooks),
        optimizer_post=len(optim_hooks._global_optimizer_post_hooks),
        autograd_backward=torch.autograd.backward.__module__,
        tracer=repr(sys.gettrace()),
        watch=repr(active_watch()),
        capture=repr(active_capture()),
        call_pdb=get_ipython().call_pdb,
        events=[len(get_ipython().events.callbacks[e]) for e in ("pre_run_cell", "post_run_cell")],
        ast_transformers=len(get_ipython().ast_transformers),
    )

BEFORE = installed()

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    return model, opt, x, y

def train(model, opt, x, y, steps=5):
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]
"""

PLANTED = """\
CELL_FILE = sys._getframe().f_code.co_filename
model, opt, x, y = make()
for step in range(3):
    opt.zero_grad()
    out = model(x)
    bad = torch.log(out - 10.0)  # here
    loss = bad.mean()
    loss.backward()
    opt.step()
"""


def planted_line() -> int:
    return next(i for i, line in enumerate(PLANTED.splitlines(), 1) if "# here" in line)


def run_notebook(cells: list[str], tmp_path, allow_errors: bool = True, **env):
    """Execute CELLS in a fresh python3 kernel (this interpreter, this worktree on
    PYTHONPATH, ENV added); the executed notebook."""
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(textwrap.dedent(c))
                                         for c in cells])
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT,
                                     startup_timeout=TIMEOUT, allow_errors=allow_errors,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=clean_env(MPLBACKEND="agg", **env))
    return nb


def text_of(cell) -> str:
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append("\n".join(out.traceback))
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"])
    return "".join(parts)


def errors_of(cell) -> list:
    return [o for o in cell.outputs if o.output_type == "error"]


def last_json(cell):
    lines = [line for line in text_of(cell).splitlines() if line.startswith(("{", "["))]
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nb")
    cells = [
        SETUP,                                                        # 0
        "%load_ext mldebug",                                          # 1
        "plain = train(*make())",                                     # 2 no mldebug
        "%%mldebug\nwatched_once = train(*make())",                   # 3 one cell
        "print(json.dumps(installed()))",                             # 4
        "%mldebug on --break-on nan,inf,assert,exception",            # 5
        "watched = train(*make())",                                   # 6 every cell
        PLANTED,                                                      # 7 the stop
        "stop = mldebug.last_stop()\n"                                # 8
        "print(json.dumps(dict(stop.to_dict(), cell_file=CELL_FILE)))",
        "%mldebug status",                                            # 9
        "%mldebug off",                                               # 10
        "print(json.dumps(installed()))",                             # 11
        "print(json.dumps([torch.equal(a, b) for a, b in zip(plain * 2, watched_once + watched)]"
        " + [len(plain)]))",                                          # 12
        "s = torch.randn(6, 8); s[2, 3] = float('nan'); s[4, 1] = float('inf')\n"
        "mldebug.summary(s)",                                         # 13 rich display
        "%inspect s",                                                 # 14
        "print(json.dumps(BEFORE))",                                  # 15
        "with mldebug.watch():\n    torch.log(-torch.ones(3))",        # 16 a user's watch
        "print(json.dumps(installed()))",                             # 17
        "%%mldebug\nv = 0\n1 / v",                                     # 18 an exception
        "print(json.dumps(mldebug.last_stop().to_dict()))",           # 19
    ]
    return run_notebook(cells, tmp)


def test_the_kernel_runs_this_interpreter_and_this_worktree(executed):
    info = last_json(executed.cells[0])
    assert info["executable"] == sys.executable
    assert info["mldebug"].startswith(str(REPO / "mldebug"))
    assert not errors_of(executed.cells[1])


def test_a_planted_nan_ends_the_cell_with_the_stop(executed):
    cell = executed.cells[7]
    (error,) = errors_of(cell)
    assert error.ename == "StopInCell"
    assert error.evalue.startswith("mldebug: stop: ")
    assert "aten.log.default" in error.evalue and "[forward]" in error.evalue
    shown = "\n".join(error.traceback)
    assert "allow_stdin is off" in shown and "mldebug.last_stop()" in shown
    # the cell's frames only: not the watch's, not torch's
    assert "mldebug/watch" not in shown and "torch/" not in shown
    assert "bad = torch.log(out - 10.0)" in shown


def test_last_stop_in_the_next_cell_has_the_file_line_and_op(executed):
    assert not errors_of(executed.cells[8])
    stop = last_json(executed.cells[8])
    assert stop["reason"] == "nan"
    assert stop["file"] == stop["cell_file"]
    assert stop["line"] == planted_line()
    assert stop["op"] == "aten.log.default" and stop["torch_op"] == "torch.log"
    assert stop["stage"] == "forward" and stop["created"] is True
    assert "last stop:" in text_of(executed.cells[9]) and "aten.log" in text_of(executed.cells[9])


def test_clean_cells_compute_the_same_bits_and_leave_nothing_installed(executed):
    for index in (2, 3, 6):
        assert not errors_of(executed.cells[index]), text_of(executed.cells[index])
    equal = last_json(executed.cells[12])
    assert equal[-1] == 4 and len(equal) == 9 and all(equal[:-1])
    before = last_json(executed.cells[15])
    assert last_json(executed.cells[4]) == before          # after a %%mldebug cell
    assert last_json(executed.cells[11]) == before         # after %mldebug off
    assert before["dispatch_modes"] == 0 and before["forward"] == 0
    assert before["tracer"] == "None" and before["watch"] == "None"


def test_a_summary_shows_as_html_and_its_text_is_the_line(executed):
    (out,) = executed.cells[13].outputs
    html = out.data["text/html"]
    assert out.data["text/plain"].startswith("tensor[6, 8] f32")
    assert "NaN!1" in out.data["text/plain"] and "+Inf!1" in out.data["text/plain"]
    assert 'class="mldebug-hist"' in html and "<svg" in html
    assert 'class="mldebug-heatmap"' in html and "data:image/png;base64," in html
    assert "NaN 1" in html and "+Inf 1" in html
    assert "<script" not in html and "http" not in html.replace("http://www.w3.org/2000/svg", "")
    (inspected,) = executed.cells[14].outputs
    assert "mldebug-heatmap" in inspected.data["text/html"]
    assert inspected.data["text/plain"].startswith("s: tensor[6, 8] f32")


def test_a_watch_of_the_users_own_stops_the_same_way(executed):
    (error,) = errors_of(executed.cells[16])
    assert error.ename == "StopInCell" and "3 NaN from aten.log.default" in error.evalue
    assert last_json(executed.cells[17]) == last_json(executed.cells[15])   # closed by `with`


def test_an_uncaught_exception_in_a_mldebug_cell_is_the_stop_at_its_cell_line(executed):
    (error,) = errors_of(executed.cells[18])
    assert error.ename == "ZeroDivisionError"
    stop = last_json(executed.cells[19])
    assert stop["reason"] == "exception" and stop["exception"] == "ZeroDivisionError: division by zero"
    assert stop["line"] == 3          # the cell's own numbering: %%mldebug is line 1


OUTSIDE_MODELS = """\
x = torch.zeros(3)
y = torch.log(x) * 0  # here
print("after")
"""


# the cells' reads counted (the wrapped call looks cell_end up in its module each time)
COUNT_CELL_ENDS = """\
import mldebug.notebook.cell_end as cell_end_module
ends, real_cell_end = [], cell_end_module.cell_end
def counted(value=None):
    ends.append(1)
    return real_cell_end(value)
cell_end_module.cell_end = counted
"""


def test_on_a_device_a_nan_the_cell_makes_outside_models_ends_that_cell(tmp_path):
    """On a GPU (the device path, simulated in the kernel) an op outside model calls is
    judged at the next read; a cell with no training step after it used to end with the
    op still pending, its stop judged after the cell where it could neither end the cell
    nor open the prompt: nothing showed. Each watched cell now ends with that read (its
    last expression wrapped, same value shown), under `%mldebug on` and `%%mldebug`."""
    nb = run_notebook([
        "import json\nimport torch\nimport mldebug",                        # 0
        "%load_ext mldebug",                                               # 1
        "%mldebug on --break-on nan",                                      # 2
        "torch.ones(2).sum()",                                             # 3 shown
        OUTSIDE_MODELS,                                                    # 4 the stop
        "print(json.dumps(mldebug.last_stop().to_dict()))",                # 5
        "%config InteractiveShell.ast_node_interactivity = 'last_expr_or_assign'",
        "v = torch.ones(3) * 2",                                           # 7 shown
        "%mldebug off",                                                    # 8
        "%%mldebug --break-on nan\n" + OUTSIDE_MODELS,                     # 9 the stop
        "print(len(get_ipython().ast_transformers))",                      # 10
        "%mldebug on --break-on nan",                                      # 11
        COUNT_CELL_ENDS,                                                   # 12
        "%timeit -n 5 -r 2 torch.ones(2) * 2",                             # 13
        "print(len(ends))",                                                # 14
    ], tmp_path, MLDEBUG_SIMULATE_DEVICE="1")
    cells = nb.cells
    for index in (0, 1, 2, 3, 5, 6, 7, 8, 10, 11, 12, 13, 14):
        assert not errors_of(cells[index]), (index, text_of(cells[index]))
    assert text_of(cells[3]) == "tensor(2.)"
    assert text_of(cells[7]) == "tensor([2., 2., 2.])"
    line = next(i for i, text in enumerate(OUTSIDE_MODELS.splitlines(), 1) if "# here" in text)
    for index, at in ((4, line), (9, line + 1)):       # (%%mldebug: line 1 is the magic)
        (error,) = errors_of(cells[index])
        assert error.ename == "StopInCell", index
        assert "aten.mul.Tensor (torch.mul) at " in error.evalue
        assert f".py:{at} [forward]" in error.evalue, (index, error.evalue)
        assert "after" in text_of(cells[index])
        assert "mldebug/" not in "\n".join(error.traceback)
    stop = last_json(cells[5])
    assert (stop["op"], stop["line"], stop["created"]) == ("aten.mul.Tensor", line, True)
    assert text_of(cells[10]).strip() == "0"
    # %timeit's statement is not ended with the read (a sync each time round, timed):
    # the read ends cell 12 (counted from there) and cell 13, not its 10 runs
    assert "per loop" in text_of(cells[13]), text_of(cells[13])
    assert text_of(cells[14]).strip() == "2", text_of(cells[14])


POLICY = """\
from torch.distributions import Categorical
torch.manual_seed(0)
mask = torch.ones(4, 3)
mask[2] = 0
probs = torch.softmax(torch.randn(4, 3), -1) * mask
probs = probs / probs.sum(-1, keepdim=True)  # here
Categorical(probs=probs)
"""


def test_on_a_device_a_nan_comes_before_the_error_it_led_to(tmp_path):
    """On a GPU the NaN of `probs / probs.sum()` is still held by the watch when
    Categorical raises on it: the cell's error is the NaN's stop at its own line, naming
    the ValueError, under `%mldebug on` and `%%mldebug`; with mldebug off, the ValueError."""
    nb = run_notebook([
        "import json\nimport torch\nimport mldebug",                        # 0
        "%load_ext mldebug",                                               # 1
        "%mldebug on",                                                     # 2
        POLICY,                                                            # 3 the stop
        "print(json.dumps(mldebug.last_stop().to_dict()))",                # 4
        "%mldebug off",                                                    # 5
        "%%mldebug\n" + POLICY,                                            # 6 the stop
        POLICY,                                                            # 7 off: plain
    ], tmp_path, MLDEBUG_SIMULATE_DEVICE="1")
    cells = nb.cells
    line = next(i for i, text in enumerate(POLICY.splitlines(), 1) if "# here" in text)
    for index, at in ((3, line), (6, line + 1)):
        (error,) = errors_of(cells[index])
        assert error.ename == "StopInCell", (index, error.ename)
        assert f"3 NaN from aten.div.Tensor (torch.div) at " in error.evalue
        assert f".py:{at} [forward]" in error.evalue and \
            "then: ValueError: Expected parameter probs" in error.evalue, error.evalue
    stop = last_json(cells[4])
    assert (stop["op"], stop["line"]) == ("aten.div.Tensor", line)
    assert stop["then"].startswith("ValueError") and stop["pause_line"] == line + 1
    (plain,) = errors_of(cells[7])
    assert plain.ename == "ValueError"
