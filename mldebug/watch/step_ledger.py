"""The device ledger: every NaN/Inf check of a tensor on a device (a GPU) goes through it,
and one read answers all of them.

On a GPU each op is a kernel launch (~5-10 us of CPU time, what a launch-bound step pays
in full) and each read of a value on the host is a sync. So a device check is not a
reduction and a read of its own: the tensor is *held* here, and a window of the watch
(an outermost module call, the loss region, backward, the optimizer step) registers what
to do should one of its tensors turn out non-finite (its *judge*). A read reduces what is
held with one `_foreach_norm` per device and dtype (the infinity norm: a NaN or an Inf
survives it, finite values never overflow it; the few tensors with gaps or overlaps in
one more, `fused_key`), one `stack`, one `amax` and one `.item()`.
Only when that one value is not finite are the norms read one by one and the judges run,
oldest first, each doing what its window would have done had it been read at once.

When a read happens is the watch's choice (`Watch._can_defer`): at the end of each
window while it cannot defer, else once a training step, at the optimizer's step (before
it changes the parameters, so a re-run still computes what the step computed): the
forward, the loss region and backward of step k and what the update of step k-1 wrote are
then checked by one read. Temporaries are held at most _GROUP tensors / _GROUP_BYTES at a
time (beyond that they are reduced at once and let go), so holding them changes a
program's memory by at most that much. One reduced early (an op is about to write its
memory) and an empty one stay alive until the read inside that bound: a judge reads the
op's inputs (a stop's hint: a divisor's zeros, an empty input's shape). Parameters,
gradients and optimizer state live on anyway and are held without a bound; an
optimizer's are asked whether their memory is still there (FSDP lets it go) by the size
of their storage, measured once (`core.native.memory_needed`).

Tested without a GPU through the same code: the `device` fixture's `cpu-as-device` case,
and `pytest --device-path` runs a whole test directory so (`MLDEBUG_SIMULATE_DEVICE=1`,
the CLI's subprocesses included; tests/conftest.py). The host path's verdicts are the
reference; tests that expect a stop inside the op itself (a raise, a pause at its line)
differ there by design. On a GPU, tests/test_cuda_paths.py and the device-path tests run
for real (benchmarks/gpu_session.sh).
"""
from __future__ import annotations

import logging
import math
import operator
import threading

import torch

from ..core import cuda_graphs as _cuda_graphs
from ..core.native import with_values
from ..core.structs import tensors_in
from .checks import mode_on
from .checks import _F32, _PLAIN, torch_formula
from .native_check import _dense

_log = logging.getLogger(__name__)
_current_node = torch._C._current_autograd_node
_grad_enabled = torch.is_grad_enabled
_set_grad_enabled = torch._C._set_grad_enabled
_DisableTorchDispatch = torch._C._DisableTorchDispatch
_UNREADABLE: list = []     # the first tensor the ledger could not read (said once)
# what the watch says, once, when it first steps aside for a CUDA graph capture
CAPTURE_NOTE = ("the watch does not check inside it (its kernels have no values until a "
                "replay, and a read would break the capture); it checks the outputs of "
                "the model called in it after each replay, and what the program computes "
                "with them")
_GROUP = 64
_GROUP_BYTES = 64 << 20
_le, _nbytes, _storage = operator.le, torch._C.StorageBase.nbytes, torch.Tensor.untyped_storage
_address = torch.Tensor.data_ptr


def fused_key(x) -> tuple:
    """The group X is reduced in: (device, dtype, dense). On a GPU one `_foreach_norm` of
    dense tensors (no gaps, no overlaps: contiguous, channels-last, transposed) is one
    fused launch; one tensor that is not (a slice, an expanded gradient) sends the whole
    list down the path of one reduction per tensor (ATen's `can_use_fast_route`):
    hundreds of launches a step. Those few go in a list of their own."""
    return (x.get_device(), x.dtype, x.is_contiguous() or _dense(x))


class StepLedger:
    """Device tensors waiting for their check, by slot, and the judges to run on a bad one."""

    __slots__ = ("_held", "_held_bytes", "_aside", "_aside_bytes", "_literals", "_kept",
                 "_kept_ids",
                 "_grouped", "_norms", "_slots", "_judges", "_late", "_lock", "slots",
                 "backwards", "calls", "sources", "waiting")

    def __init__(self):
        self._held: list = []      # temporaries: (tensor, slot), bounded
        self._held_bytes = 0
        self._literals: list = []  # Python data with a NaN/Inf a window op may read (keep)
        self._aside: list = []     # temporaries reduced already (before an op wrote
        self._aside_bytes = 0      # them) or empty: alive for the judges, in the bound
        self._kept: list = []      # tensors that live on anyway: (tensor, slot)
        self._kept_ids: dict = {}  # id(tensor) -> slot, of those
        self._grouped: list = []   # tensors that live on anyway, grouped by their holder:
                                   # (fused_key, tensors, indices, first slot)
        self._norms: list = []     # 0-d float32 norms on the device, of reduced tensors
        self._slots: list = []     # their slots
        self._judges: list = []    # (judge, always): judge(values) at the read
        self._late: dict = {}      # slot -> non-finite value found by the last read
        self.slots = 0             # slots handed out (never reused)
        self.backwards = 0         # judges of backwards among the judges
        self.calls = 0             # judges of outermost calls (each keeps its arguments)
        self.sources: list = []    # what waiting judges read or re-run from: RootCalls
                                   # (their parameters and arguments), lists of tensors
        self.waiting = None        # the memory of those, when an op outside modules writes
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._judges)

    def holds_tensors(self) -> bool:
        return bool(self._held or self._kept or self._grouped or self._norms)

    def hold(self, tensors, alive: bool = False) -> list:
        """Slots for TENSORS (floating, strided, on a device), checked at the next read.
        ALIVE: they live on anyway (parameters, gradients, state): no bound applies, and
        one held already keeps its slot (a gradient that two windows check is read once)."""
        with self._lock:            # (backward runs on one thread per device)
            return self._hold(tensors, alive)

    def _hold(self, tensors, alive):
        slots = []
        for x in tensors:
            if type(x) not in _PLAIN:
                # a subclass: its local values (a DTensor's shard: each rank checks its
                # own, no collective), or nothing that a norm could read
                x = getattr(x, "_local_tensor", None)
                if type(x) not in _PLAIN:
                    slots.append(self.slots)
                    self.slots += 1
                    continue
            if alive:
                slot = self._kept_ids.get(id(x))
                if slot is None:
                    slot = self.slots
                    self.slots += 1
                    if x.numel():   # (held, so its id is not reused before the read)
                        self._kept_ids[id(x)] = slot
                        self._kept.append((x, slot))
                slots.append(slot)
                continue
            if x.numel():
                self._held.append((x, self.slots))
                self._held_bytes += x.numel() * x.element_size()
            else:                   # (nothing to reduce: its slot stays finite; kept for
                self._aside.append(x)   # a judge, which may read its shape)
            slots.append(self.slots)
            self.slots += 1
        if len(self._held) + len(self._aside) >= _GROUP \
                or self._held_bytes + self._aside_bytes >= _GROUP_BYTES:
            held, self._held, self._held_bytes = self._held, [], 0
            self._aside, self._aside_bytes = [], 0
            self._reduce(held)
        return slots

    def keep(self, x) -> None:
        """X alive until the read (at most _GROUP of them): a tensor no op of the window
        made (Python data holding a NaN/Inf, `torch.tensor(values)`) that a window op may
        read, so that its judge reads what it held rather than take it for gone."""
        if len(self._literals) < _GROUP:
            self._literals.append(x)

    def hold_grouped(self, groups, n) -> range:
        """Slots for N tensors that live on anyway (an optimizer's parameters and state),
        grouped once by their holder: GROUPS {fused_key: (tensors, their indices among
        the N, `memory_needed` of them)} (update.StepTensors). Not shared with `hold`'s
        tensors: one held both ways is read twice."""
        with self._lock:
            start = self.slots
            self.slots += n
            for key, (xs, indices, needed) in groups.items():
                self._grouped.append((key, xs, indices, start, needed))
        return range(start, start + n)

    def reduce_before_write(self, written) -> None:
        """An op is about to write WRITTEN (memory addresses) in place: if a held
        temporary lives there, reduce what is held now (queued, no sync), so that its
        check sees what the op that made it made, not what the write leaves (`x =
        torch.zeros(n); x.copy_(src)` must not blame the zeros)."""
        with self._lock:
            for x, _ in self._held:
                try:
                    if x.untyped_storage().data_ptr() in written:
                        break
                except RuntimeError:       # (no storage to share; held are plain tensors)
                    continue
            else:
                return
            held, self._held, self._held_bytes = self._held, [], 0
            self._reduce(held)
            # (alive until the read, within the bound: a judge reads an op's inputs)
            self._aside.extend(x for x, _ in held)
            self._aside_bytes += sum(x.numel() * x.element_size() for x, _ in held)

    def then(self, judge, always: bool = False) -> None:
        """Run JUDGE(values) at the read when a slot held so far is not finite (ALWAYS:
        also when all are, with values None). values: slot -> float."""
        self._judges.append((judge, always))

    def _reduce(self, items, grouped=()) -> None:
        groups: dict = {}
        for x, slot in with_values(items):   # (not memory let go since it was held)
            key = (x.get_device(), x.dtype, x.is_contiguous() or _dense(x))  # (fused_key)
            group = groups.get(key)
            if group is None:
                group = groups[key] = ([], [])
            group[0].append(x)
            group[1].append(slot)
        for key, xs, indices, start, needed in grouped:
            slots = list(map(start.__add__, indices))
            # (memory let go since they were found: FSDP's resize_(0). The same addresses
            # and their memory as then measured, compared in C loops: ~0.15 us a tensor,
            # not `with_values`'s ~0.5)
            if needed is None or list(map(_address, xs)) != needed[0] \
                    or not all(map(_le, needed[1], map(_nbytes, map(_storage, xs)))):
                kept = with_values(list(zip(xs, slots)))
                if len(kept) != len(xs):
                    xs, slots = [x for x, _ in kept], [slot for _, slot in kept]
            group = groups.get(key)
            if group is None:
                groups[key] = (list(xs), slots)
            else:
                group[0].extend(xs)
                group[1].extend(slots)
        grad = _grad_enabled()
        if grad:
            _set_grad_enabled(False)  # our own reduction: no autograd node
        # ... nor through the watch's own mode, on the stack when a hook holds (a root's
        # outputs past the bound): its window would wait on this ledger's lock
        unwatched = _DisableTorchDispatch()
        unwatched.__enter__()
        try:
            for xs, slots in groups.values():    # (one fused launch each on a GPU)
                try:
                    norms = torch._foreach_norm(xs, math.inf, dtype=_F32)
                except (RuntimeError, TypeError):   # an older torch: one reduction each
                    norms, slots = _one_by_one(xs, slots)
                self._norms.extend(norms)
                self._slots.extend(slots)
        finally:
            unwatched.__exit__(None, None, None)
            if grad:
                _set_grad_enabled(True)

    def _empty(self):
        """Empty the ledger: (norms, their slots, judges)."""
        emptied = (self._norms, self._slots, self._judges)
        self._held, self._kept, self._held_bytes, self._kept_ids = [], [], 0, {}
        self._aside, self._aside_bytes = [], 0
        self._literals = []
        self._grouped = []
        self._norms, self._slots, self._judges = [], [], []
        self.backwards = self.calls = 0
        self.sources, self.waiting = [], None
        return emptied

    def take(self):
        """The read: (values, judges, held), the ledger emptied. values is None when every
        tensor held was finite (one transfer), else slot -> float (one more); held keeps
        the tensors alive while the judges run."""
        items = self._held + self._kept
        grouped = self._grouped
        if items or grouped:
            self._reduce(items, grouped)
            items.extend(grouped)     # (kept alive while the judges run)
        items.extend(self._aside)
        items.extend(self._literals)
        norms, slots, judges = self._empty()
        values = None
        if norms:
            try:
                # (the norms need no gradient: stack and amax make no autograd node)
                vector = torch.stack(norms)
                # the one sync (amax keeps a NaN; norms are never negative)
                if not math.isfinite(vector.amax().item()):
                    values = vector.tolist()
            except RuntimeError:  # several devices: one read each
                values = [float(n) for n in norms]
                if all(math.isfinite(v) for v in values):
                    values = None
        # a judge may come after the read of its tensors (held while its window was
        # still open): what was not finite waits one read for it
        late = self._late
        self._late = {} if values is None else {
            slot: v for slot, v in zip(slots, values) if not math.isfinite(v)}
        if not late and not self._late:
            return None, judges, ()
        return {**late, **self._late}, judges, items


def memory_addresses(tensors, found=None) -> set:
    """Addresses of the memory of TENSORS (tensors, or lists / tuples of them; a tensor
    without storage to share has none), added to FOUND."""
    found = set() if found is None else found
    for x in tensors:
        for t in (x if isinstance(x, (list, tuple)) else (x,)):
            try:
                found.add(t.untyped_storage().data_ptr())
            except (RuntimeError, AttributeError):
                continue
    return found


def _storages(sources) -> set:
    """Addresses of the memory of SOURCES: lists of tensors, and root calls (their
    parameters and their tensor arguments)."""
    found = set()
    for source in sources:
        memory_addresses(source if isinstance(source, list) else
                         source.info.params + tensors_in((source.args, source.kwargs)), found)
    return found


def cuda_graph_aside() -> bool:
    """Whether the watch steps aside now: this thread's CUDA stream is capturing a graph
    (said once; `core.cuda_graphs`)."""
    return bool(_cuda_graphs.MAYBE[0]) and _cuda_graphs.step_aside("watch", CAPTURE_NOTE)


def _one_by_one(xs, slots):
    """Norms of XS one reduction each; one that cannot be read (a CUDA graph's output
    overwritten by a later replay raises on access) is left out, said once."""
    norms, kept = [], []
    for x, slot in zip(xs, slots):
        try:
            norms.append(x.abs().amax().to(_F32))
            kept.append(slot)
        except RuntimeError as exc:
            if not _UNREADABLE:
                _UNREADABLE.append(exc)
                _log.warning("mldebug: a tensor held for the watch's NaN/Inf check could "
                             "not be read (%s): it is not checked", str(exc).splitlines()[0])
    return norms, kept


def first_bad(values, slots) -> float | None:
    """The first non-finite value among SLOTS (a range or list), or None."""
    if values is None:
        return None
    for slot in slots:
        v = values.get(slot, 0.0)
        if not math.isfinite(v):
            return v
    return None


class DeviceReads:
    """Methods of `Watch` that decide when the ledger (`Watch._ledger`) is read."""

    def _read_ledger(self) -> None:
        """The read: one transfer; the judges run when it shows a NaN/Inf (and those
        that always run, run anyway), oldest first."""
        ledger = self._ledger
        if cuda_graph_aside():
            # a read would break the capture: what is held (made before it, with values;
            # nothing is held inside it) waits for the first read after it
            return
        if self._win:            # (what the ledger holds of it is read now: judged too)
            self._window_to_ledger()
        if not ledger:
            return
        self._constant_unread = False   # (the judges below mark what was written)
        with self._own_ops():
            values, judges, held = ledger.take()
        if values is None and not any(always for _, always in judges):
            return
        with mode_on(self._mode):     # (a judge may re-run a call)
            for judge, always in judges:
                if values is not None or always:
                    try:
                        judge(values)
                    except RuntimeError as exc:   # never the program's: its step goes on
                        _log.warning("mldebug: the watch could not judge what its read "
                                     "found (%s)", str(exc).splitlines()[0],
                                     exc_info=_log.isEnabledFor(logging.DEBUG))
        del held

    def _before_mutation(self, tensors) -> None:
        """An op outside modules is about to write TENSORS in place. A temporary held
        for the per-op check in that memory is reduced first. If it writes what a judge
        waiting for the step's read reads or re-runs from (a parameter, a call's argument,
        an optimizer's state: weight clipping, a manual update), read now, while the judge
        still sees what the program saw (and a re-run computes what it did)."""
        ledger = self._ledger
        written = memory_addresses(tensors)
        if ledger._held and not torch_formula(_current_node()):
            # (inside one of torch's backward formulas the write is the formula's own:
            # what it leaves is checked, as on the host, verdict.py
            # `_judge_when_formula_ends`: `(grad / norm).masked_fill_(norm == 0, 0)`)
            ledger.reduce_before_write(written)
        if not ledger.sources:
            return
        if ledger.waiting is None:
            ledger.waiting = _storages(ledger.sources)
        if not written.isdisjoint(ledger.waiting):
            self._read_ledger()
