"""A CUDA graph capture under mldebug: while the program captures
(`torch.cuda.graph`, `make_graphed_callables`, reduce-overhead's trees), kernels are
recorded, not run. A read to the host there is an error that breaks the program's
capture, and a kernel of ours captured with the program's would run again at every
replay. So every part steps aside while a capture is underway, says so once, and works
again after it.

The capture itself needs a GPU (test_cuda_paths.py captures a real one); here the CPU
takes the device path and the capture is pretended, so that CI counts what each part
dispatches inside it: nothing.
"""
from __future__ import annotations

import inspect
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mldebug
from mldebug.assertions.scan import AlwaysOn
from mldebug.core import cuda_graphs
from mldebug.record.history import History
from mldebug.watch import watch

from conftest import cpu_as_device, marker_line, needs_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from opcount import count_step  # noqa: E402

class _EmptyMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


PARTS = ("the watch", "the assertions", "mldebug.record", "the step history")


@pytest.fixture
def capture_pretended(monkeypatch):
    """[False]; set it to True while the program 'captures' a CUDA graph."""
    on = [False]
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: on[0])
    monkeypatch.setattr(cuda_graphs, "MAYBE", [1])     # (no capture_begin counted it)
    monkeypatch.setattr(cuda_graphs, "_SAID", set())
    return on


@pytest.fixture(params=["cpu-as-device", pytest.param("cuda", marks=needs_cuda)])
def device_path(request):
    """The device path mldebug takes on a GPU: on the CPU standing in for one, or CUDA."""
    if request.param == "cuda":
        yield "cuda"
        return
    with cpu_as_device() as dev:
        yield dev


def _training(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(16, 8, device=device)
    y = torch.randint(0, 4, (16,), device=device)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, step


def test_inside_a_capture_mldebug_adds_no_op_and_no_read_and_says_so_once(
        capture_pretended, device_path, tmp_path):
    _, plain_step = _training(device_path)

    def plain_under_a_mode():
        # the watch's dispatch mode stays on the stack through a capture (popping it is
        # for eager steps): under any mode the profiler sees two of autograd's own
        # detaches at the top level, so the plain step is counted under an empty one
        with _EmptyMode():
            plain_step()
    plain_ops, plain_reads = count_step(plain_under_a_mode)

    model, step = _training(device_path)
    stops = []
    engines = AlwaysOn(assertions=True)       # what the CLI runs, with its history
    history = History().start()
    rec = mldebug.record(model, run_dir=str(tmp_path), run="graphs")
    try:
        with watch(on_violation=stops.append):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
                step()                                  # eager: watched and recorded
                recorded, counted = rec.step_index, history.step
                capture_pretended[0] = True
                ops, reads = count_step(step, warmup=1)  # two steps "captured"
                capture_pretended[0] = False
                # nothing of the captured steps is counted as a step of the program
                assert (rec.step_index, history.step) == (recorded, counted)
                step()                                  # eager again: all of it back
                with torch.no_grad():
                    model[0].weight[0, 0] = float("nan")
                step()
    finally:
        rec.close()
        history.close()
        engines.close()
    assert ops == plain_ops and reads == plain_reads == 0
    said = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    assert len(said) == len(PARTS), said          # each part once, for both steps
    assert all(any(part in text for text in said) for part in PARTS), said
    assert rec.step_index == recorded + 2 and history.step == counted + 2
    assert stops and stops[0].kind == "nan"       # the watch looks again after it


def test_outside_a_capture_nothing_is_said():
    assert cuda_graphs.step_aside("a part", "never said") is False
    assert "a part" not in cuda_graphs._SAID


def test_the_recorders_writer_is_drained_before_a_capture_begins(monkeypatch, tmp_path):
    """A capture in global mode (`torch.cuda.graph`'s default): a read on the writer thread
    during it would break it. The step still being written when the capture begins is
    written first (the capture's own start is pretended: it needs a GPU)."""
    import threading
    began = []
    graph_class = torch.cuda.graphs.CUDAGraph
    monkeypatch.setattr(graph_class, "capture_begin", lambda self: began.append(len(written)))
    _fresh_wrappers(monkeypatch)
    model, step = _training("cpu")
    written = []
    rec = mldebug.record(model, run_dir=str(tmp_path), run="drained")
    try:
        slow = threading.Event()
        rec._writer.submit(lambda: (slow.wait(0.5), written.append("step")))
        graph_class.capture_begin(object.__new__(graph_class))
    finally:
        rec.close()
    assert began == [1]                 # the capture began after the write, not during
    graph_class.capture_begin(object.__new__(graph_class))
    assert began == [1, 1] and cuda_graphs._LISTENERS["before"] == []   # closed: gone


class _Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def _fresh_wrappers(monkeypatch):
    """mldebug's wrappers of torch's graph methods made afresh over the test's stand-ins
    (and torch's methods as they were after the test)."""
    graphs = torch.cuda.graphs
    for cls, name in ((graphs.graph, "__enter__"), (graphs.CUDAGraph, "capture_begin"),
                      (graphs.CUDAGraph, "capture_end"), (graphs.CUDAGraph, "replay")):
        monkeypatch.setattr(cls, name, getattr(cls, name), raising=False)
    monkeypatch.setattr(cuda_graphs, "_PATCHED", [])
    monkeypatch.setattr(cuda_graphs, "_LISTENERS", {k: [] for k in cuda_graphs._LISTENERS})
    # the captures these wrappers count (a test may begin one it never ends) are the
    # test's own: the process's count is put back after it (conftest checks it is 0)
    monkeypatch.setattr(cuda_graphs, "MAYBE", [0])


@pytest.fixture
def graphs_pretended(monkeypatch, capture_pretended):
    """CUDAGraph as on a GPU, pretended: `capture_begin()` starts the 'capture' and
    `capture_end()` ends it; `replay()` runs the graph's kernels, here a function of the
    test run as mldebug's own work (a replay's kernels are not seen by Python).
    Returns capture(run): a graph whose capture runs RUN()."""
    from mldebug.core.quiet import own_work
    graphs = torch.cuda.graphs

    def replay(graph):
        with own_work():
            graph.kernels()

    monkeypatch.setattr(graphs.CUDAGraph, "capture_begin",
                        lambda self, *a, **k: capture_pretended.__setitem__(0, True))
    monkeypatch.setattr(graphs.CUDAGraph, "capture_end",
                        lambda self: capture_pretended.__setitem__(0, False))
    monkeypatch.setattr(graphs.CUDAGraph, "replay", replay)
    _fresh_wrappers(monkeypatch)

    def capture(run):
        graph = object.__new__(graphs.CUDAGraph)
        graph.kernels = lambda: None
        graph.capture_begin()
        try:
            run()
        finally:
            graph.capture_end()
        return graph
    return capture


def test_after_a_replay_the_graphs_outputs_are_checked_and_a_nan_stops_at_the_replay(
        graphs_pretended, device_path):
    model = nn.Sequential(nn.Linear(4, 4), _Log()).to(device_path)
    x = torch.ones(2, 4, device=device_path)
    static = {}
    stops = []
    with watch(on_violation=stops.append):
        graph = graphs_pretended(lambda: static.update(out=model(x)))

        def kernels():                     # what a replay of the graph computes
            static["out"].data.copy_(model(x))
        graph.kernels = kernels
        with torch.no_grad():
            model[0].weight.fill_(0.1)
            model[0].bias.fill_(1.0)
        graph.replay()
        assert stops == []                 # finite: one read, no stop
        with torch.no_grad():
            model[0].bias.fill_(-5.0)      # the next replay takes the log of negatives
        replay_line = inspect.currentframe().f_lineno + 1
        graph.replay()
    assert len(stops) == 1, stops
    stop = stops[0]
    assert stop.kind == "nan" and stop.nan == 8 and stop.torch_op == "CUDAGraph.replay"
    assert (stop.file, stop.line) == (__file__, replay_line)
    assert stop.module_type == "Sequential" and stop.stage == "forward"
    assert "CUDA graph" in stop.text and "without the graph" in stop.text
    assert not any(cuda_graphs._LISTENERS.values())       # the watch closed: gone


def test_what_the_last_eager_update_made_is_read_before_a_capture(graphs_pretended,
                                                                    device_path):
    """On a device the last eager step's update is judged at the next step's read; a
    capture comes first, and nothing can be read inside it: it is read before."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).to(device_path)
    opt = torch.optim.SGD(model.parameters(), lr=float("inf"))
    x = torch.randn(8, 4, device=device_path)
    stops = []
    with watch(on_violation=stops.append):
        model(x).pow(2).mean().backward()
        opt.step()                         # the update makes Inf/NaN: judged later
        assert stops == []
        graphs_pretended(lambda: None)
        assert stops and stops[0].stage == "optimizer"


def test_in_a_loop_of_replays_what_the_program_does_is_read_at_each_replay(
        graphs_pretended, device_path):
    """No optimizer hook fires in a loop of replays: the ops outside the graph (its data
    copied in) are read before each replay, not held to the end of the program."""
    model = nn.Linear(4, 4).to(device_path)
    x = torch.ones(2, 4, device=device_path)
    stops = []
    with watch(on_violation=stops.append):
        model(x).sum().backward()
        torch.optim.SGD(model.parameters(), lr=0.1).step()   # (an eager step was seen)
        graph = graphs_pretended(lambda: model(x))
        for i in range(3):
            batch = torch.full_like(x, float("nan") if i == 2 else 1.0)  # here
            x.copy_(batch)
            graph.replay()
            assert len(stops) == (1 if i == 2 else 0)   # at this replay, not at the end
    assert stops[0].line == marker_line(__file__) and stops[0].torch_op == "torch.full_like"


def test_a_step_ended_by_hand_inside_a_capture_is_not_a_step(capture_pretended, tmp_path):
    model, step = _training("cpu")
    rec = mldebug.record(model, run_dir=str(tmp_path), run="by-hand")
    try:
        step()                            # (counted at optimizer.step(): step 1)
        rec.step()                        # by hand from now on
        capture_pretended[0] = True
        rec.step()                        # captured: nothing read, no step counted
        rec.log_scalar("loss", torch.tensor(1.0))
        capture_pretended[0] = False
        assert rec.step_index == 2 and rec._scalars == []
        rec.step()
    finally:
        rec.close()
    assert rec.step_index == 3


def _graphed_log(graphs_pretended, device, watch_kwargs, replays):
    """A graph whose outputs turn NaN from the second replay on; REPLAYS replays, then an
    eager op on its output. Returns the stops."""
    model = nn.Sequential(nn.Linear(4, 4), _Log()).to(device)
    x = torch.ones(2, 4, device=device)
    static, stops = {}, []
    with watch(on_violation=stops.append, **watch_kwargs):
        graph = graphs_pretended(lambda: static.update(out=model(x)))
        # (a replay's kernels write without moving the tensor's version counter)
        graph.kernels = lambda: static["out"].data.copy_(model(x))
        for i in range(replays):
            with torch.no_grad():
                model[0].bias.fill_(1.0 if i == 0 else -5.0)
                model[0].weight.fill_(0.1)
            graph.replay()
        static["out"] * 2                 # the program uses the outputs
    return stops


def test_a_graph_that_stays_bad_stops_once_and_what_it_feeds_is_no_new_stop(
        graphs_pretended, device_path):
    stops = _graphed_log(graphs_pretended, device_path, {}, replays=4)
    assert [s.torch_op for s in stops] == ["CUDAGraph.replay"]


def test_allow_silences_a_replays_stop(graphs_pretended, device_path):
    stops = _graphed_log(graphs_pretended, device_path, {"allow": ("CUDAGraph.replay",)},
                         replays=2)
    assert [s.torch_op for s in stops if s.torch_op == "CUDAGraph.replay"] == []


def test_a_graph_replayed_inside_a_module_call_is_checked_by_the_modules_hooks_only(
        graphs_pretended, device_path):
    """As `make_graphed_callables` does: the graph is captured and replayed inside the
    module's call; no read of ours in the middle of the call, the module's hooks judge."""
    inner = nn.Sequential(nn.Linear(4, 4), _Log()).to(device_path)
    with torch.no_grad():
        inner[0].weight.fill_(0.1)
        inner[0].bias.fill_(1.0)
    x = torch.ones(2, 4, device=device_path)
    static = {}

    class Graphed(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner
            self.graph = None

        def forward(self, x):
            if self.graph is None:
                self.graph = graphs_pretended(lambda: static.update(out=inner(x)))
                self.graph.kernels = lambda: static["out"].data.copy_(inner(x))
            self.graph.replay()
            return static["out"].clone()

    model, stops = Graphed(), []
    with watch(on_violation=stops.append) as w:
        model(x)
        model(x)
        assert w._graph_outs.get(model.graph) is None   # not followed: judged as a module
    assert stops == []                      # finite


def test_a_logged_scalar_is_the_value_it_had_when_logged(tmp_path):
    """A CUDA graph's loss is written over in place at every replay: each logged value is
    kept as it was (one copy on the device, no read)."""
    from mldebug.record import open_run
    model, _ = _training("cpu")
    loss = torch.zeros(())
    rec = mldebug.record(model, run_dir=str(tmp_path), run="scalars")
    try:
        for i in range(3):
            loss.fill_(float(i))
            rec.log_scalar("loss", loss)
    finally:
        rec.close()
    with open_run(rec.path) as run:
        assert [v for _, v in run.scalars("loss")["loss"]] == [0.0, 1.0, 2.0]


def test_open_captures_are_counted_so_a_hook_asks_nothing_when_none_is(monkeypatch):
    """`MAYBE` counts the captures begun and not ended, through torch's methods (a begin
    that fails is not one; an end that raises may not have ended it: still counted, and
    the hooks ask the driver from then on); while it is 0 `step_aside` answers without
    asking the driver."""
    graphs = torch.cuda.graphs

    def begin(self, fail=False):
        if fail:
            raise RuntimeError("capture could not begin")

    def end(self, fail=False):
        if fail:
            raise RuntimeError("the capture was invalidated")
    monkeypatch.setattr(graphs.CUDAGraph, "capture_begin", begin)
    monkeypatch.setattr(graphs.CUDAGraph, "capture_end", end)
    _fresh_wrappers(monkeypatch)
    monkeypatch.setattr(cuda_graphs, "MAYBE", [0])
    cuda_graphs._install()
    g = object.__new__(graphs.CUDAGraph)
    asked = []
    monkeypatch.setattr(cuda_graphs, "capturing", lambda: asked.append(1) or False)
    assert not cuda_graphs.step_aside("test", "x") and asked == []
    g.capture_begin()
    g.capture_begin()
    assert cuda_graphs.MAYBE == [2]
    assert not cuda_graphs.step_aside("test", "x") and asked == [1]
    g.capture_end()
    with pytest.raises(RuntimeError):
        g.capture_begin(fail=True)
    assert cuda_graphs.MAYBE == [1]
    with pytest.raises(RuntimeError):
        g.capture_end(fail=True)
    assert cuda_graphs.MAYBE == [1]
    assert not cuda_graphs.step_aside("test", "x") and asked == [1, 1]
    g.capture_end()
    assert cuda_graphs.MAYBE == [0]
    g.capture_end()                       # (an end without a begin we saw)
    assert cuda_graphs.MAYBE == [0]
