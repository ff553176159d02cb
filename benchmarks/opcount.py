"""Machine-independent counts of a training step: the aten ops it dispatches and its host
reads, from torch's profiler (the watch's op and read budgets).

    ops, reads = count_step(step, warmup=3)
    calls = count_calls(step)      # Python calls on this thread, all code

An op is a top-level `aten::` event: what the step dispatches, not the calls a kernel
makes inside itself (a `sum` is one op, not `sum` + its `fill_` and `as_strided`). A host
read is an op that copies a device value to the host for Python to look at (`item`,
`_local_scalar_dense`, `is_nonzero`); on a GPU each is a sync. Used by bench_watch.py,
bench_record.py and tests/watch/test_op_budget.py.

The Python function calls a step makes in one package's code (`count_calls`) are the
other machine-independent cost: on a step bound by kernel launches, the CPU time of the
training thread is the step's time, and what a debugger adds there is mostly its Python.
"""
from __future__ import annotations

import collections
import sys
from typing import Callable, Optional

from torch.profiler import ProfilerActivity, profile

HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero")


def count_step(step: Callable[[], None], warmup: int = 3,
               settle: Optional[Callable[[], None]] = None) -> tuple[collections.Counter, int]:
    """(Counter of top-level aten ops by name, host reads) of one call of STEP, after
    WARMUP calls (optimizer state, caches and lazy set-up are not a step's cost) and
    SETTLE() (see `settled`)."""
    for _ in range(warmup):
        step()
    if settle is not None:
        settle()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    ops = collections.Counter(
        e.name for e in prof.events() if e.name.startswith("aten::") and not _nested(e))
    # a read nested in another op (item -> _local_scalar_dense) is one read
    reads = sum(ops[name] for name in HOST_READS)
    return ops, reads


def _nested(event) -> bool:
    """Whether an aten op runs inside another aten op. An ancestor, not only the parent:
    a Python dispatch mode's own profiler range stands between a composite op and the
    ops it calls (cross_entropy -> log_softmax), which are not more launches for it."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def count_calls(step: Callable[[], None], under: str = "", warmup: int = 3,
                settle: Optional[Callable[[], None]] = None) -> int:
    """Python function calls, on this thread, of code in files under the folder UNDER
    (all of them by default), during one call of STEP after WARMUP calls and SETTLE():
    the thread that launches a GPU's kernels (a writer thread's work is not counted)."""
    return _count(step, lambda code: code.co_filename.startswith(under), warmup, settle)


def settled(recorder) -> Callable[[], None]:
    """A `settle` for a step RECORDER records: wait until its writer thread is done with
    the last step. A step that begins while the writer still reads the last step's blocks
    takes a new block from the pool and makes its views (~2 ops a tensor, once): how
    often that happens depends on the machine's load, not on the step, so a count that
    must not depend on the machine waits."""
    return recorder._writer.flush


def count_runs(step: Callable[[], None], code, warmup: int = 3) -> int:
    """How often the function whose code object is CODE runs on this thread during one
    call of STEP after WARMUP calls (the watch's `__torch_dispatch__`: the ops that pass
    through its Python dispatch mode, each a Python round trip on top of its launch)."""
    return _count(step, lambda seen: seen is code, warmup)


def _count(step: Callable[[], None], match: Callable, warmup: int,
           settle: Optional[Callable[[], None]] = None) -> int:
    """Calls on this thread of functions whose code object MATCH accepts, during one call
    of STEP after WARMUP calls and SETTLE()."""
    for _ in range(warmup):
        step()
    if settle is not None:
        settle()
    calls = [0]

    def seen(frame, event, arg):
        if event == "call" and match(frame.f_code):
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(seen)
    try:
        step()
    finally:
        sys.setprofile(previous)
    return calls[0]
