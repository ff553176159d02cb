"""A device block's reductions as one CUDA graph.

On a GPU the end of a recorded step queues some twenty kernels per block
(`tensorbatch._reductions`: min and max per row, the sums, the samples' gather, the
per-sample norms, the per-tensor totals), and a small model's step is bound by kernel
launches, so those launches are much of what recording every step costs there. A step's
layout repeats, and so does its block (the pool hands the same memory back): the second
time the same block (same memory, same layout) comes to be reduced, its reductions are
captured once as a CUDA graph whose outputs lie in one flat float64 tensor. From then on
they are one graph launch and one copy of that output (the next step's replay writes
there again, maybe before the writer thread has read it).

Trust is earned, not assumed: the step that captures also reduces one op at a time, and
the writer thread compares the two value for value (`judge`). Only a graph that gave the
same numbers is replayed. An error while capturing or a difference turns the graphs off
for the process, and the reductions run one op at a time (`GRAPHS.off` says why;
`bench_record.py` prints it). Rolled blocks are not graphed: their reductions zero the
NaN/Inf they count, so a second run could not be compared with the first.

The capture is thread-local (the writer thread or a DataLoader's pin-memory thread may
sync and allocate meanwhile), on a side stream, in its own memory pool (given back if the
capture fails), never while the program has a capture of its own open, and passes none
of mldebug's listeners of the program's captures (`core.cuda_graphs.unwrapped`). At most
MAX_GRAPHS graphs are kept, until the last recorder closes, for blocks of at most
MAX_VALUES values: each graph keeps the memory of its intermediates (up to twice its
block), and a larger block's reductions take longer on the GPU than their launches on
the CPU. A steady training loop needs one graph per dtype (the benchmark MLP's block is
0.7M values, the CNN's last 7M; the GPT's 29M are left one op at a time).
"""
from __future__ import annotations

import threading
from typing import Callable, Optional

import numpy as np
import torch

from ..core import cuda_graphs

MAX_GRAPHS = 4
MAX_VALUES = 1 << 23
_SEEN_MAX = 256


class _CudaGraph:
    """FN's ops captured once (FN returns one tensor: the graph's output, `out`);
    `replay()` runs them again on the current stream, writing `out` again."""

    def __init__(self, device: torch.device, fn: Callable[[], torch.Tensor]):
        self.graph = torch.cuda.CUDAGraph()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            cuda_graphs.unwrapped("capture_begin")(self.graph, pool=pool,
                                                   capture_error_mode="thread_local")
            try:
                self.out = fn()
            finally:
                try:
                    cuda_graphs.unwrapped("capture_end")(self.graph)
                except BaseException:
                    _release_pool(device, pool)
                    raise
        torch.cuda.current_stream(device).wait_stream(side)

    def replay(self) -> None:
        cuda_graphs.unwrapped("replay")(self.graph)


def _release_pool(device: torch.device, pool) -> None:
    """After a capture that failed to end (invalidated): torch's `capture_end` raised
    before it told the allocator the capture is over, which would leave it routing and
    holding memory for a graph that is gone (no `empty_cache`, no retry on out of memory
    from then on). Said here, as `torch.cuda.memory.use_mem_pool` does at its end."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    for name in ("_cuda_endAllocateToPool", "_cuda_releasePool"):
        try:
            getattr(torch._C, name)(index, pool)
        except Exception:  # noqa: BLE001 - a torch without it: nothing more to do
            pass


_GRAPH = _CudaGraph      # (the tests put a pretended graph here, on the CPU)


class _Kept:
    __slots__ = ("graph", "sizes", "meta", "keep", "trusted")

    def __init__(self, graph, sizes: list, meta, keep):
        self.graph, self.sizes, self.meta, self.keep = graph, sizes, meta, keep
        self.trusted = False


class BlockGraphs:
    """The graphs of the blocks reduced so far, by block memory and layout."""

    def __init__(self):
        self._graphs: dict = {}   # key -> _Kept
        self._seen: dict = {}     # key -> times reduced one op at a time
        self._lock = threading.Lock()
        self.off: Optional[str] = None    # why no graph is used (None: they are)
        self.captured = 0
        self.replays = 0

    def reduce(self, v: torch.Tensor, layout_key, reduce: Callable[[], tuple],
               keep=None) -> tuple:
        """Block V's reductions: REDUCE() -> (tensors, meta) queues them one op at a time;
        with a trusted graph for V's memory and LAYOUT_KEY, its replay instead. Returns
        (tensors to bring to the host, the sizes of the arrays they make there, in order,
        meta, check): CHECK, when not None, is the graph on trial, its arrays after the
        eager ones (`judge` them once on the host). KEEP: what the graph's ops read
        besides V (the layout's index tensors), kept alive with it."""
        if self.off is None and _graphable(v):
            # (the stream too: a replay on another one could overwrite the output before
            # the last step's copy of it ran on its own)
            key = (layout_key, v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device,
                   torch.cuda.current_stream(v.device).cuda_stream if v.is_cuda else 0)
            kept = self._graphs.get(key)
            if kept is not None:
                if kept.trusted:
                    kept.graph.replay()
                    self.replays += 1
                    return [kept.graph.out.clone()], kept.sizes, kept.meta, None
            elif self._second_time(key):
                tensors, meta = reduce()
                kept = self._capture(key, v.device, reduce, keep)
                if kept is not None:
                    kept.graph.replay()
                    return (tensors + [kept.graph.out.clone()],
                            [t.numel() for t in tensors] + kept.sizes, meta, kept)
                return tensors, [t.numel() for t in tensors], meta, None
        tensors, meta = reduce()
        return tensors, [t.numel() for t in tensors], meta, None

    def judge(self, kept: _Kept, eager: list, replayed: list) -> None:
        """On the host: the graph on trial gave REPLAYED, the ops one by one EAGER (lists
        of arrays). The same numbers: it is replayed from now on; else no graph is."""
        same = len(eager) == len(replayed) and all(
            np.array_equal(a, b, equal_nan=True) for a, b in zip(eager, replayed))
        if same:
            kept.trusted = True
        elif self.off is None:
            self.off = "a graph's replay differed from the reductions run one by one"

    def release(self) -> None:
        """Let every graph and its memory go: when the last recorder has closed (its
        writer has read every step, so no replay is in flight). What was learned (`off`)
        stays."""
        with self._lock:
            self._graphs.clear()
            self._seen.clear()

    def _second_time(self, key) -> bool:
        with self._lock:
            if len(self._graphs) >= MAX_GRAPHS:
                return False
            n = self._seen.get(key, 0) + 1
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen[key] = n
            return n == 2

    def _capture(self, key, device, reduce, keep) -> Optional[_Kept]:
        found = {}

        def flat_outputs():
            tensors, meta = reduce()
            found["sizes"], found["meta"] = [t.numel() for t in tensors], meta
            return torch.cat([t.reshape(-1).double() for t in tensors])
        try:
            graph = _GRAPH(device, flat_outputs)
        except Exception as exc:  # noqa: BLE001 - not capturable here: one op at a time
            self.off = f"a block's reductions could not be captured ({type(exc).__name__}: " \
                       f"{str(exc).splitlines()[0] if str(exc) else ''})"
            return None
        kept = _Kept(graph, found["sizes"], found["meta"], keep)
        with self._lock:
            self._graphs[key] = kept
            self.captured += 1
        return kept


def _graphable(v: torch.Tensor) -> bool:
    """A CUDA block small enough to be launch-bound, while the program captures no graph
    of its own on any thread (a capture in torch's "global" mode is broken by what
    another thread's capture does)."""
    return v.is_cuda and v.numel() <= MAX_VALUES and not cuda_graphs.MAYBE[0]


GRAPHS = BlockGraphs()
