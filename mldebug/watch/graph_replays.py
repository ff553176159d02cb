"""CUDA graphs: the watch checks what a captured graph's outermost module calls return,
after each replay.

While a graph is captured the watch steps aside (`core.cuda_graphs`): no op of its own
may be captured, and no value can be read. It only notes, in Python, the tensors that
the outermost module calls there return: the graph's static outputs, which every replay
writes again. Once the capture has ended well (`after_capture`) they are kept with the
graph (weakly: a graph let go takes them along), and after each `replay()`
(`after_replay`) one reduction over them and one read check them. A NaN/Inf stops at the
user's line that replayed the graph, naming the module. It is not pinned to an op: a
replay runs captured kernels, not Python (and re-running it would take an optimizer step
in it twice), so the stop says how to pin it instead.

Before a capture the watch reads what it holds (the last eager step's parameters and
update: they could not be read inside it), and before each replay of a graph it follows
what the program did since (its data copied into the graph's inputs): a loop of replays
fires no optimizer hook, the watch's usual read. So such a loop costs up to two reads a
replay, as an eager step costs one.

A module graphed by `make_graphed_callables`, or compiled with reduce-overhead, is also
called as a module, so its hooks check it at that boundary like any module.

Tested: tests/test_cuda_graph_capture.py counts, with the capture and replays pretended on
the CPU, that nothing of mldebug's is dispatched inside a capture and that a replay's NaN
stops at its line; tests/test_cuda_paths.py does both with real CUDA graphs under the CLI.
"""
from __future__ import annotations

import threading
import weakref

from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core.records import Violation
from ..core.structs import tensors_in
from .checks import _ALLOWED, _caller, _counts, _summary
from .ops import matches
from .step_ledger import StepLedger, first_bad

_get_ident = threading.get_ident


class GraphReplays:
    """Methods of `Watch`: the outputs of a captured graph, checked after its replays."""

    def _graphs_start(self) -> None:
        self._capture_depth = 0
        self._capture_outs: list = []      # (module, [weakref]) of the capture underway
        self._capture_stepped = False      # an optimizer step in the capture underway
        self._graph_outs = weakref.WeakKeyDictionary()   # graph -> ([(module, ts)], site)
        self._graph_bad = weakref.WeakSet()   # graphs whose last replay stopped
        self._graph_handles = [_cuda_graphs.before_capture(self._capture_begins),
                               _cuda_graphs.after_capture(self._graph_captured),
                               _cuda_graphs.before_replay(self._graph_replaying),
                               _cuda_graphs.after_replay(self._graph_replayed)]

    def _graphs_close(self) -> None:
        for handle in getattr(self, "_graph_handles", ()):
            handle.remove()
        self._graph_handles = []
        self._capture_outs = []
        self._graph_outs = weakref.WeakKeyDictionary()

    def _mine_at_top(self) -> bool:
        """This watch's thread, running, and not inside a module call: a graphed module
        (`make_graphed_callables`, reduce-overhead's trees) captures and replays inside
        its call, where its hooks check it at the boundary and a read of ours would run
        in the middle of the call (inside the trees' lock, a re-run would deadlock)."""
        return (not self._skip and _get_ident() == self._owner and self._top is None
                and not self._inside)

    def _capture_begins(self) -> None:
        """Before a capture begins (before `torch.cuda.graph` switches streams): what the
        ledger holds is read now, while it has values (the last eager step's parameters
        and update: no optimizer hook fires at the replays), and a stop found on
        autograd's device threads pauses now, not inside the capture."""
        if not self._mine_at_top():
            return
        self._capture_outs, self._capture_depth, self._capture_stepped = [], 0, False
        if self._stash:
            self._deliver_stash()
        if self._ledger or self._win:
            self._read_ledger()

    def _captured_call_begins(self) -> None:
        self._capture_depth += 1

    def _captured_call_ends(self, module, output) -> None:
        """A module call in a capture returned: an outermost one's floating outputs are
        noted (Python only: nothing is dispatched), weakly: one the program lets go within
        the capture can still be reused by the graph's memory pool."""
        self._capture_depth = max(self._capture_depth - 1, 0)
        if self._capture_depth:
            return
        outs = [weakref.ref(t) for t in tensors_in(output) if t.is_floating_point()]
        if outs:
            self._capture_outs.append((module, outs))

    def _captured_step(self) -> None:
        self._capture_stepped = True

    def _graph_captured(self, graph) -> None:
        if not self._mine_at_top():
            return
        noted, self._capture_outs, self._capture_depth = self._capture_outs, [], 0
        outs = [(m, alive) for m, refs in noted
                if (alive := [t for t in (r() for r in refs) if t is not None])]
        stepped, self._capture_stepped = self._capture_stepped, False
        if not outs and not stepped:
            return       # (one with a step in it is followed too: its replays are steps)
        frame = _frames.user_frame(_caller(1))
        file, line, _ = _frames.location(frame)
        try:
            self._graph_outs[graph] = (outs, f"{file}:{line}" if file else "")
        except TypeError:    # a graph object without weak references: not followed
            pass

    def _followed(self, graph):
        """(outputs, capture site) of GRAPH when the watch follows it, else None."""
        if not self._mine_at_top():
            return None
        try:
            return self._graph_outs.get(graph)
        except TypeError:
            return None

    def _graph_replaying(self, graph) -> None:
        """Before a replay: what the program did since the last read (its data copied
        into the graph's inputs) is read now, before the replay writes over what a judge
        would re-run from; no optimizer hook fires in a loop of replays to read it."""
        if (self._ledger or self._win) and self._followed(graph) is not None:
            self._read_ledger()

    def _graph_replayed(self, graph) -> None:
        got = self._followed(graph)
        if got is None or not got[0]:
            return
        outs, site = got
        flat = [t for _, ts in outs for t in ts]
        with self._own_ops():
            ledger = StepLedger()           # (one reduction per device and dtype, one read)
            slots = ledger.hold(flat, alive=True)
            values, _, _ = ledger.take()
            if values is None:
                if graph in self._graph_bad:     # finite again: judged afresh
                    self._graph_bad.discard(graph)
                    for t in flat:
                        self._taint.pop(t.untyped_storage().data_ptr(), None)
                return
            if graph in self._graph_bad:
                return       # stopped at an earlier replay, and not finite since
            self._graph_bad.add(graph)
            k = next(i for i, slot in enumerate(slots)
                     if first_bad(values, (slot,)) is not None)
            bad = flat[k]
            module = next(m for m, ts in outs for t in ts if t is bad)
            nan, posinf, neginf = _counts(bad)
            output = _summary(bad)
        # what the program computes from them next came in with them: no second stop
        self._taint_outputs(flat, True)
        self._report_replayed(module, site, nan, posinf, neginf, output)

    def _report_replayed(self, module, site, nan, posinf, neginf, output) -> None:
        kind = "nan" if nan or not (posinf or neginf) else "inf"
        if kind not in self.break_on:
            return
        path, mtype = self._names.path((module, None))
        patterns = tuple(_ALLOWED) + self.allow
        if patterns and matches(patterns, tuple(n for n in ("CUDAGraph.replay", path) if n)):
            return
        frame = _frames.user_frame(_caller(2))
        file, line, function = _frames.location(frame)
        where = f" captured at {site}" if site else ""
        self._report(Violation(
            kind=kind, torch_op="CUDAGraph.replay", module=path, module_type=mtype,
            stage="forward", frame=frame, file=file, line=line, function=function,
            nan=nan, posinf=posinf, neginf=neginf, created=True, output=output,
            step=self._steps if self._opt_seen else None,
            text=(f"the output of {path or mtype} after a replay of the CUDA graph{where}: "
                  "made inside the graph, whose kernels the watch does not see one by one; "
                  "run the step without the graph and mldebug pins the op and its line")))
