"""torch.compile under mldebug, driven through the CLI as a user runs it: a clean run is
untouched (same weights bit for bit, no graph break or extra graph, none of dynamo's
warnings about our hooks; a compiled function is compiled, not run eagerly under the
watch's dispatch mode), and a NaN made inside a compiled module is pinned at the
user's line with its op."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env, marker_line, read_report, run_cli

TRAIN = """
    import sys
    import torch
    from torch import nn
    import torch._dynamo.utils as dynamo_utils



    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x):
            return self.body(x).tanh()


    form = sys.argv[1]
    mode = sys.argv[2] if len(sys.argv) > 2 else "default"
    torch.manual_seed(0)
    model = Net()
    if form == "torch.compile(model)":
        run = torch.compile(model, mode=mode)
    elif form == "model.compile()":
        model.compile()
        run = model
    else:                                         # a compiled function around the model
        run = torch.compile(lambda x: torch.tanh(model(x)) * 0.5)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for step in range(4):
        loss = ((run(x) - y) ** 2).mean()  # the call
        opt.zero_grad()
        loss.backward()
        opt.step()
    counters = dynamo_utils.counters
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
    print("graph breaks", sum(counters["graph_break"].values()))
    print("graphs", counters["stats"]["unique_graphs"],
          "ops captured", counters["stats"]["calls_captured"])
"""

NAN_INSIDE = """
    import torch
    from torch import nn


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            return torch.log(h - 100.0)  # here


    torch.manual_seed(0)
    model = torch.compile(Net())
    out = model(torch.randn(4, 8))
    print("finished", out.sum().item())
"""


@pytest.mark.parametrize("form,mode", [
    ("torch.compile(model)", "default"), ("model.compile()", "default"),
    ("torch.compile(function)", "default"),
    # on the CPU these compile without CUDA graphs; the point is that our hooks stay out
    ("torch.compile(model)", "reduce-overhead"),
    ("torch.compile(model)", "max-autotune-no-cudagraphs")])
def test_a_compiled_model_trains_as_without_mldebug(write_program, tmp_path, form, mode):
    prog = write_program(TRAIN)
    plain = subprocess.run([sys.executable, str(prog), form, mode], capture_output=True,
                           text=True, env=clean_env(), timeout=300)
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog), form, mode],
                     timeout=300)
    assert result.returncode == 0, result.stderr
    assert read_report(report) == []                        # no false stop
    # the same weights bit for bit, and dynamo compiled the same graphs with no break
    assert result.stdout == plain.stdout
    assert "graph breaks 0" in result.stdout and "graphs 1" in result.stdout
    err = result.stderr
    assert "Traceback" not in err
    assert "Dynamo does not know how to trace" not in err    # nothing of ours traced
    assert "global hooks on modules" not in err              # torch's note on our hooks
    if form == "torch.compile(model)":                     # the one line that stays,
        # at the program's line that calls the model (not torch's line that ran our hook)
        (note,) = [line for line in err.splitlines() if "Net runs under torch.compile" in line]
        assert note.startswith(f"{prog}:{marker_line(prog, '# the call')}: RuntimeWarning: "), note


@pytest.mark.parametrize("form", ["torch.compile(model)", "model.compile()"])
def test_a_compiled_model_with_the_watch_off(write_program, tmp_path, form):
    """The original crash came with --watch off too: what stays on without the watch (the
    graph capture and its assertions) is no more visible to dynamo."""
    prog = write_program(TRAIN)
    plain = subprocess.run([sys.executable, str(prog), form], capture_output=True,
                           text=True, env=clean_env(), timeout=300)
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--watch", "off", "--report", str(report), str(prog), form],
                     timeout=300)
    assert result.returncode == 0, result.stderr
    assert read_report(report) == []
    assert result.stdout == plain.stdout                   # same bits, graphs, no break
    assert "graph breaks 0" in result.stdout and "graphs 1" in result.stdout
    assert "Traceback" not in result.stderr
    assert "Dynamo does not know how to trace" not in result.stderr
    assert "global hooks on modules" not in result.stderr


def test_a_nan_inside_a_compiled_module_stops_at_the_users_line(write_program, tmp_path):
    prog = write_program(NAN_INSIDE)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["op"]) == ("nan", "forward", "aten.log.default")
    assert (stop["file"], stop["line"], stop["function"]) == (str(prog), marker_line(prog),
                                                              "forward")
    assert stop["module"] == ""              # the compiled root, not torch's `_orig_mod`
    assert "finished" not in result.stdout


NAN_IN_FUNCTION = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(8, 8)


    @torch.compile
    def step(x):
        return torch.log(model(x) - 100.0).sum()


    x = torch.randn(4, 8)
    loss = step(x)  # here
    loss.backward()
    print("finished", loss.item())
"""


def test_a_nan_made_inside_a_compiled_function_stops_where_it_is_called(write_program,
                                                                        tmp_path):
    prog = write_program(NAN_IN_FUNCTION)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", True)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog))
    assert "1 NaN in step() at prog.py" in stop["message"]
    assert "finished" not in result.stdout
    # at the prompt, `why` says where it was made and how to pin the op; `c` goes on
    result = run_cli([str(prog)], stdin="why\nc\n", timeout=300)
    assert f"> {prog}({marker_line(prog)})<module>()" in result.stdout
    assert "made inside the compiled function step" in result.stdout
    assert "TORCH_COMPILE_DISABLE=1" in result.stdout
    assert "finished nan" in result.stdout


CORRUPT_PARAMETER = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    with torch.no_grad():
        model[2].weight.numpy()[0, 3] = float("nan")   # a corrupt checkpoint
    run = torch.compile(model)
    pred = run(torch.randn(4, 8))  # here
    print("finished")
"""


def test_a_nan_that_comes_into_a_compiled_model_stops_at_the_users_line(write_program,
                                                                      tmp_path):
    """The code torch.compile generated (inductor's cache dir, /tmp/torchinductor_USER)
    is not the user's: the stop was in its `call`, at a line of a generated file."""
    prog = write_program(CORRUPT_PARAMETER)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", False)
    assert (stop["file"], stop["line"], stop["function"]) == (str(prog), marker_line(prog),
                                                              "<module>")
    assert stop["data"] is None                       # a parameter, not the data
    assert "torchinductor" not in result.stderr
    assert "finished" not in result.stdout


def test_a_nan_inside_a_compiled_module_is_pinned_by_an_eager_re_run(device):
    # on a device the call is judged at a later read, and re-run from what it kept: the
    # re-run is eager (compiled code hides its ops from the per-op check)
    import torch
    from torch import nn

    from mldebug.watch import watch

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(self.fc(x) - 100.0)  # here

    torch.manual_seed(0)
    torch._dynamo.reset()
    try:
        with watch(on_violation=lambda v: None) as w:
            model = torch.compile(Net())
            out = model(torch.randn(4, 8, device=device))
        assert [(v.op, v.function, v.module) for v in w.violations] == [
            ("aten.log.default", "forward", "")]
        assert out.isnan().any()
    finally:
        torch._dynamo.reset()
