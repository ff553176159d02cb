"""A CUDA graph capture under mldebug (issue 22): while the program captures
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
from mldebug.record import stats
from mldebug.record.history import History
from mldebug.watch import core, watch

from conftest import needs_cuda

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
    monkeypatch.setattr(cuda_graphs, "_SAID", set())
    return on


@pytest.fixture(params=["cpu-as-device", pytest.param("cuda", marks=needs_cuda)])
def device_path(request):
    """The device path mldebug takes on a GPU: on the CPU standing in for one, or CUDA."""
    if request.param == "cuda":
        yield "cuda"
        return
    core.simulate_device(True)
    stats.simulate_device(True)
    try:
        yield "cpu"
    finally:
        core.simulate_device(False)
        stats.simulate_device(False)


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
    """`torch.cuda.graph` captures in global mode: a read on the writer thread during the
    capture would break it. The step still being written when the program enters the
    capture is written first (the capture's own start is pretended: it needs a GPU)."""
    import threading
    began = []
    monkeypatch.setattr(torch.cuda.graphs.graph, "__enter__",
                        lambda self: began.append(len(written)))
    monkeypatch.setattr(cuda_graphs, "_PATCHED", [])
    model, step = _training("cpu")
    written = []
    rec = mldebug.record(model, run_dir=str(tmp_path), run="drained")
    try:
        slow = threading.Event()
        rec._writer.submit(lambda: (slow.wait(0.5), written.append("step")))
        torch.cuda.graphs.graph.__enter__(object.__new__(torch.cuda.graphs.graph))
    finally:
        rec.close()
    assert began == [1]                 # the capture began after the write, not during
    torch.cuda.graphs.graph.__enter__(object.__new__(torch.cuda.graphs.graph))
    assert began == [1, 1] and cuda_graphs._PATCHED == []   # closed: as it was
