"""Issue 22: on a GPU, the recorder's reductions of a block become one CUDA graph once the
same block and layout come back (`record/block_graphs.py`), trusted only after its first
replay gave the numbers the ops one by one gave.

The CPU has no graphs: a pretended one stands in (`PretendGraph`: its "capture" runs the
ops, its replay runs them again into the same output tensor, as a replay writes its static
output), on the recorder's device path (`cpu-as-device`). What this checks is mldebug's
part: which blocks are graphed and when, the host arrays a graph's one output makes, the
trial and what a failed trial or capture does. tests/test_cuda_paths.py runs the real
graphs where CUDA is present."""
from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.record import block_graphs, open_run

from conftest import cpu_as_device, needs_cuda

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from opcount import count_step  # noqa: E402


class PretendGraph:
    made = 0

    def __init__(self, device, fn):
        PretendGraph.made += 1
        self.fn = fn
        self.out = fn()

    def replay(self):
        self.out.copy_(self.fn())


class WrongGraph(PretendGraph):
    def replay(self):
        self.out.copy_(self.fn() + 1.0)


class FailingGraph:
    def __init__(self, device, fn):
        raise RuntimeError("operation not permitted when stream is capturing")


@pytest.fixture
def graphs(monkeypatch):
    """A fresh BlockGraphs that graphs the simulated device's blocks with GRAPH."""
    def use(graph):
        fresh = block_graphs.BlockGraphs()
        monkeypatch.setattr(block_graphs, "GRAPHS", fresh)
        monkeypatch.setattr(block_graphs, "_GRAPH", graph)
        monkeypatch.setattr(block_graphs, "_graphable",
                            lambda v: v.numel() <= block_graphs.MAX_VALUES)
        return fresh
    return use


def train(tmp_path, run: str, steps: int = 8, seed: int = 0, device: str = "cpu") -> tuple:
    """An MLP trained STEPS steps, recorded every step with all four logs on the device
    path (the CPU standing in for one, or DEVICE); the writer is waited for after each
    step (so a trial is judged before the next step, and the blocks come back to the
    pool). (run path, final weights)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 24), nn.ReLU(),
                          nn.Linear(24, 3)).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = torch.randn(6, 12).to(device), torch.randint(0, 3, (6,)).to(device)
    simulated = cpu_as_device() if device == "cpu" else contextlib.nullcontext()
    with simulated, mldebug.record(model, run_dir=tmp_path, run=run) as rec:
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            rec._writer.flush()
    return rec.path, torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def everything(path) -> dict:
    with open_run(path) as run:
        table = run.table()
        norms = {(s["key"], step): run.norms(s["key"], step)
                 for s in run.series() for step in run.steps()}
    return table, norms


def assert_same_records(a, b) -> None:
    (ta, na), (tb, nb) = a, b
    assert sorted(ta) == sorted(tb) and ta
    for key in ta:
        for field in ("steps", "calls", "stats", "hist", "ranges", "outside", "sample_n"):
            assert np.array_equal(ta[key][field], tb[key][field], equal_nan=True), (key, field)
    assert na.keys() == nb.keys()
    for k in na:
        assert (na[k] is None) == (nb[k] is None) and (na[k] is None or
                                                       np.array_equal(na[k], nb[k])), k


def test_a_blocks_reductions_are_replayed_once_its_graph_gave_the_same_numbers(
        tmp_path, graphs):
    off = graphs(PretendGraph)
    off.off = "the test's run without graphs"
    plain_path, plain_weights = train(tmp_path, "plain")
    assert off.captured == 0 and off.replays == 0

    on = graphs(PretendGraph)
    path, weights = train(tmp_path, "graphed")
    assert on.off is None
    # the block is reduced one by one when first seen, captured (and on trial) the second
    # time, replayed from the third on: for each block graphed
    # (a replay is of a trusted graph only)
    assert on.captured >= 1 and on.replays >= 4 * on.captured, (on.captured, on.replays)
    # the numbers recorded are those of the run without graphs, bit for bit, and so is
    # what the program computed
    assert_same_records(everything(path), everything(plain_path))
    assert torch.equal(weights, plain_weights)


def test_a_graph_whose_trial_differs_is_never_replayed_and_the_records_stay_right(
        tmp_path, graphs):
    graphs(PretendGraph).off = "no graphs"
    plain_path, _ = train(tmp_path, "plain")
    wrong = graphs(WrongGraph)
    path, _ = train(tmp_path, "wrong")
    assert wrong.captured >= 1 and wrong.replays == 0
    assert wrong.off == "a graph's replay differed from the reductions run one by one"
    assert_same_records(everything(path), everything(plain_path))


def test_a_block_that_cannot_be_captured_is_reduced_one_op_at_a_time(tmp_path, graphs):
    graphs(PretendGraph).off = "no graphs"
    plain_path, _ = train(tmp_path, "plain")
    failing = graphs(FailingGraph)
    path, _ = train(tmp_path, "failing")
    assert failing.captured == 0 and failing.replays == 0
    assert failing.off.startswith("a block's reductions could not be captured (RuntimeError: "
                                  "operation not permitted"), failing.off
    assert_same_records(everything(path), everything(plain_path))


def test_which_blocks_are_graphed(graphs, monkeypatch):
    """The second sighting of the same memory and layout captures; a block over
    MAX_VALUES values, a rolled block, and blocks past MAX_GRAPHS are not graphed."""
    made = graphs(PretendGraph)
    calls = []

    def reduce():
        calls.append(1)
        return [torch.arange(3.0), torch.ones(2)], "meta"

    v = torch.zeros(4, 8)
    got = [made.reduce(v, "layout", reduce) for _ in range(2)]
    assert got[0][3] is None and [t.tolist() for t in got[0][0]] == [[0, 1, 2], [1, 1]]
    tensors, sizes, meta, trial = got[1]
    assert trial is not None and sizes == [3, 2, 3, 2] and meta == "meta"
    assert tensors[-1].tolist() == [0, 1, 2, 1, 1] and tensors[-1].dtype == torch.float64
    # not trusted yet: reduced one by one until judged
    assert made.reduce(v, "layout", reduce)[3] is None and made.replays == 0
    made.judge(trial, [np.arange(3.0), np.ones(2)], [np.arange(3.0), np.ones(2)])
    n = len(calls)
    tensors, sizes, meta, trial = made.reduce(v, "layout", reduce)
    assert len(tensors) == 1 and sizes == [3, 2] and trial is None and made.replays == 1
    assert len(calls) == n + 1          # (the pretended replay runs the ops again)
    # another layout, or the same layout in other memory, is another graph
    made.reduce(v, "other", reduce)
    assert made.reduce(v, "other", reduce)[3] is not None
    w = torch.zeros(4, 8)
    made.reduce(w, "layout", reduce)
    assert made.reduce(w, "layout", reduce)[3] is not None and made.captured == 3
    # too large: never
    big = torch.zeros(block_graphs.MAX_VALUES + 1)
    assert all(made.reduce(big, "big", reduce)[3] is None for _ in range(3))
    # at most MAX_GRAPHS
    monkeypatch.setattr(block_graphs, "MAX_GRAPHS", 3)
    x = torch.zeros(2)
    assert all(made.reduce(x, "late", reduce)[3] is None for _ in range(3))
    assert made.captured == 3


def test_rolled_blocks_are_not_graphed(tmp_path, graphs, monkeypatch):
    """A step larger than the blocks' budget rolls its blocks (reduced as they fill, their
    NaN/Inf zeroed as counted): those reductions are never graphed, the block left at the
    step's end is."""
    from mldebug.record import stats, tensorbatch
    made = graphs(PretendGraph)
    monkeypatch.setattr(stats, "DEVICE_BUDGET", 4 * 1024)     # 4 rows
    rolled, offered = [], []
    real_reductions, real_reduce = tensorbatch._reductions, block_graphs.BlockGraphs.reduce
    monkeypatch.setattr(tensorbatch, "_reductions", lambda *a: rolled.append(a[-1]) or
                        real_reductions(*a))
    monkeypatch.setattr(block_graphs.BlockGraphs, "reduce", lambda self, *a, **k:
                        offered.append(1) or real_reduce(self, *a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64))
    with cpu_as_device(), mldebug.record(model, log=("params",), run_dir=tmp_path,
                                         run="r") as rec:
        for _ in range(4):
            model(torch.randn(2, 64)).sum().backward()
            rec.step()
            rec._writer.flush()
    with open_run(rec.path) as run:
        rows = run.stats("0.weight:param")
    assert [r["numel"] for r in rows] == [4096] * 4
    # three rolled blocks a step, one at its end: only that one is offered to the graphs
    assert rolled.count(True) == 12 and len(offered) == 4
    assert made.captured == 1 and made.replays == 2


def test_no_graph_is_made_on_the_cpu():
    made = block_graphs.BlockGraphs()
    calls = []
    for _ in range(3):
        made.reduce(torch.zeros(8), "k", lambda: calls.append(1) or ([torch.ones(1)], None))
    assert made.captured == 0 and len(calls) == 3


@needs_cuda
def test_on_a_gpu_a_blocks_reductions_are_one_graph_launch_with_the_same_records(
        tmp_path, monkeypatch):
    """The real thing: the graph is captured and trusted, what is recorded is what the
    ops one by one record, bit for bit, and a recorded step dispatches fewer ops."""
    off = block_graphs.BlockGraphs()
    off.off = "the test's run without graphs"
    monkeypatch.setattr(block_graphs, "GRAPHS", off)
    plain_path, plain_weights = train(tmp_path, "plain", device="cuda")
    on = block_graphs.BlockGraphs()
    monkeypatch.setattr(block_graphs, "GRAPHS", on)
    path, weights = train(tmp_path, "graphed", device="cuda")
    assert on.off is None, on.off
    assert on.captured >= 1 and on.replays >= 4, (on.captured, on.replays)
    assert_same_records(everything(path), everything(plain_path))
    assert torch.equal(weights, plain_weights)

    ops = {}
    for name, graphs in (("one by one", off), ("graphed", on)):
        monkeypatch.setattr(block_graphs, "GRAPHS", graphs)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 3)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randn(6, 12, device="cuda")

        def step():
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        with mldebug.record(model, run_dir=tmp_path, run=name) as rec:
            for _ in range(6):
                step()
                rec._writer.flush()
            counted, _ = count_step(step, warmup=0)
        ops[name] = sum(counted.values())
    # ~20 ops of a block's reductions become one copy of the graph's output
    assert ops["graphed"] <= ops["one by one"] - 12, ops


def test_the_graphs_go_when_the_last_recorder_closes(tmp_path, graphs):
    made = graphs(PretendGraph)
    train(tmp_path, "r", steps=3)
    assert made.captured == 1 and made._graphs == {}
