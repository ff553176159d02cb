"""The device window: outputs of the per-op check (outside the roots' calls: the loss,
data handling) on a non-CPU device (CUDA) are held by the ledger without an op or a sync
(step_ledger.py), and the window's judge is registered when it ends (a root call starts,
backward starts or ends, the optimizer steps, every WINDOW_MAX ops, close()); the ledger
is read then, or at the training step's read. A flagged op is judged as the per-op check
would have (verdict.py), with the inputs and outputs that are still alive.

Mixed into `Watch` (core.py).
"""
from __future__ import annotations

import math
import weakref
from functools import partial

import torch
from torch import Tensor

from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core.structs import tensors_in
from .checks import (_F32, METADATA_KEY, _counts, _floating, _getframe, _grad_enabled,
                     _isfinite, any_requires_grad, torch_formula, user_code_in_backward)
from .context import module_record
from .ops import LOG_AT_ZERO, WORKSPACE_OUTPUTS
from .step_ledger import cuda_graph_aside, first_bad

_current_node = torch._C._current_autograd_node
_ref = weakref.ref
_USER = _frames._is_user_cache     # file name -> is user code (filled by is_user_file)
_is_user_file = _frames.is_user_file

WINDOW_MAX = 1024          # device window: read the flags at least every this many ops
# a module's forward called by torch's module call (fast path, or its hooks' `inner`)
_CALL_CODES = frozenset([torch.nn.Module._call_impl.__code__] + [
    c for c in torch.nn.Module._call_impl.__code__.co_consts if hasattr(c, "co_name")])


class DeviceWindow:
    """Methods of `Watch` for the device window (entries in `Watch._win`)."""

    def _window_add(self, func, info, args, kwargs, outs, flat=None, safe=0):
        """Sum the outputs on their device (no sync) and remember enough to judge later.
        Returns the user frame's (file, line, function) found for a forward op, else None
        (the caller's provenance reuses it: one walk up the stack per op).

        `outs`: the op's outputs as returned (tensors, or lists of them for foreach
        ops); `flat`: the floating device tensors among them when already known; `safe`:
        the op could not make a NaN/Inf from these inputs (ops.SAFE_ALWAYS). The host
        path checks such an op only after something non-finite was judged, and so does
        the window's judge: one made before the window is read is held for that. Not
        while a CUDA graph is captured: a reduction of ours would be captured with the
        program's kernels and run at each of its replays.

        This runs for every op outside module calls on a GPU, where the training thread's
        CPU time is the step's time: hence no helper calls on its common path (the ledger's
        lock taken here, the stack walked inline, `_weak` only for nested arguments)."""
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            return None
        if self._in_compiled:
            return None                      # (checked at its return: compiled.py)
        if flat is None:
            flat = outs
        if info.short in WORKSPACE_OUTPUTS:
            flat = flat[:1]     # (the rest is uninitialized memory kept for its backward)
        if self._read_now or self.exact or self._learning_root is not None \
                or self._recomputing:
            # a re-run or the loss region's dry run is there to pin the op, `exact` and a
            # root's call while the roots are learned pause at the op itself, a
            # checkpoint's recomputation is judged as it recomputes: read now (a sync per
            # op), while the op's inputs (and its frame) are alive to judge
            sums = [t.sum(dtype=_F32) for t in flat]
            total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
            if not _isfinite(total.item()):
                if (self._ledger or self._win) and not self._rerunning:
                    # what ran before (a forward waiting for the step's read) is judged
                    # first, as the host path judged it already: a NaN it made is then
                    # known here, not a new stop (the loss's dry run in backward)
                    self._read_ledger()
                self._slow(func, info, args, kwargs, outs, None)
            return None
        ledger = self._ledger
        with ledger._lock:                   # no op here: reduced with the window
            slots = ledger._hold(flat, False)
        node = _current_node()
        record = self._top
        if node is not None:
            stage, node_name = "backward", node.name()
            node_prov = node.metadata.get(METADATA_KEY)
            here = None
            if node is not self._formula_node and torch_formula(node):
                self._formula_node = node     # (its first op here: what it returns, too)
                self._hold_what_it_returns(node)
            try:
                f = user_code_in_backward(_getframe(2))
            except ValueError:               # (autograd's device thread: no caller)
                f = None
            if f is not None:                # a hook's op, or a backward the program
                node_prov = None             # wrote: its own line, as on the CPU
                here = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
            if not self._bwd_queued:
                self._bwd_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        else:
            stage = "optimizer" if self._opt_depth else "forward"
            node_name, node_prov = "", None
            try:
                f = _getframe(2)
            except ValueError:               # (no Python caller that deep)
                f = None
            called = None                    # a module call between it and the user
            while f is not None:
                code = f.f_code
                name = code.co_filename
                user = _USER.get(name)
                if user is None:
                    user = _is_user_file(name)
                if user:
                    break
                if called is None and code in _CALL_CODES:
                    called = f
                f = f.f_back
            here = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) if f is not None else None
            if self._top is None:
                # (a module outside the roots: a library's, called by a library function
                # such as `generate`, or the user's own)
                if called is not None:
                    record = module_record(called)
                elif f is not None and f.f_back is not None and f.f_back.f_code in _CALL_CODES:
                    record = module_record(f)
        # inputs already judged non-finite, noted now: they may be freed by the time the
        # window is read (a temporary), and then nothing says where their values came from
        prior = None
        if self._taint:
            prior = [k for k in map(self._known_with_mark, tensors_in((args, kwargs)))
                     if k is not None]
            if not self._constant_unread and any(k[3] is not None for k in prior):
                self._constant_unread = True    # (flowing from one: judged at the read)
        if info.writes and not self._constant_unread and _writes_nonfinite(args, kwargs):
            # a NaN/Inf written on purpose (marks.py) is known at the read: the model
            # calls and the losses before it look for it then (step.py)
            self._constant_unread = True
        # the arguments and outputs held weakly: a flat tuple of tensors and scalars (most
        # ops) without a call. With each tensor argument, the address of its memory: if it
        # is gone by the read, an earlier op of the window that wrote there tells what it
        # held (identity cannot: a factory's output that the ledger holds reaches the
        # program as another Python object)
        tensors = nested = grad = False      # (grad: an input requires one)
        for x in args:
            if isinstance(x, Tensor):
                tensors = True
                if x.requires_grad:
                    grad = True
            elif isinstance(x, (list, tuple, dict)):
                nested = True
                break
        if nested or type(args) is not tuple:
            wargs = _weak(args)
            memory = _memory_of(args, [])
        elif tensors:
            refs = []                        # (a loop: a comprehension is a call)
            memory = []
            for a in args:
                if isinstance(a, Tensor):
                    ref = _ref(a)
                    refs.append(ref)
                    try:
                        storage = a.untyped_storage()
                        memory.append((ref, storage.data_ptr(), _ref(storage), a._version))
                    except Exception:        # noqa: BLE001 - no storage: nothing to tell
                        pass
                else:
                    refs.append(a)
            wargs = tuple(refs)
        else:
            wargs = args
            memory = []
        if kwargs:
            wkwargs = _weak(kwargs)
            _memory_of(kwargs, memory)
        else:
            wkwargs = None
        wouts = None
        if type(outs) is tuple:
            refs = []
            for t in outs:
                if not isinstance(t, Tensor):
                    break
                refs.append(_ref(t))
            else:
                wouts = tuple(refs)
        if wouts is None:
            wouts = _weak(outs)
        # the memory each output is in: (address, weak reference to the storage, version,
        # whether the output covers all of it: a write into part says nothing of the rest)
        written = []
        for t in flat:
            try:
                storage = t.untyped_storage()
                written.append((storage.data_ptr(), _ref(storage), t._version,
                                t.numel() * t.element_size() >= storage.nbytes()))
            except Exception:                # noqa: BLE001 - (a subclass without storage)
                pass
        self._win.append((slots, func, info, wargs, wkwargs, wouts,
                          (stage, node_name, node_prov, record, here, self._micro), prior,
                          flat[0].dtype, safe, memory, written,
                          _grad_enabled() and (grad or (nested or bool(kwargs)) and
                                               any_requires_grad(args, kwargs))))
        if len(self._win) >= WINDOW_MAX:
            self._flush_window()
        return here

    def _backward_done(self):
        self._bwd_queued = False
        if self._win and not self._skip:
            self._flush_window()

    def _flush_window(self):
        """The window ends: its judge goes to the ledger, read now or at the training
        step's read (step_ledger.py)."""
        if self._win:
            self._window_to_ledger()
            if not (self._can_defer() and self._ledger.holds_tensors()):
                self._read_ledger()

    def _hold_what_it_returns(self, node):
        """NODE is one of torch's backward formulas: what it returns is held too, and
        where in the window it returned, so that a NaN/Inf made inside it that it
        discards itself (`where(grad > 0, log(|grad|), min)` in logcumsumexp's) is judged
        as the host path judges it: by what the formula returns (verdict.py)."""
        start = len(self._win)    # (its first op's entry comes next)

        def returned(grad_inputs, _grad_outputs):
            handle.remove()
            held = [g for g in grad_inputs if isinstance(g, Tensor) and g.is_floating_point()]
            slots = self._ledger.hold(held)    # (its reduction passes no mode)
            self._win_returned.append((start, len(self._win), slots))
        handle = node.register_hook(returned)

    def _window_to_ledger(self):
        win, self._win = self._win, []
        returned, self._win_returned = self._win_returned, []
        self._formula_node = None
        self._ledger.then(partial(self._judge_window, win, returned))

    def _judge_window(self, win, returned, values):
        """A judge of the ledger: the window's flagged ops, in order, judged as the
        per-op check would have. Runs from hooks, where the mode may be active:
        suspended, so that its own ops are not watched."""
        with self.suspended():
            self._judge_flagged_ops(win, returned, values)

    def _judge_flagged_ops(self, win, returned, values):
        n0 = len(self.violations)
        made: dict = {}   # memory address -> (the non-finite value, or None, of the last
                          # op of this window that wrote there; a stop came before it;
                          # the Mark of a value written on purpose, or None)
        for index, (slots, func, info, wargs, wkwargs, wouts, entry, prior, dtype, safe,
                    memory, written, grad) in enumerate(win):
            value = first_bad(values, slots)
            if value is None or (safe and not self._taint):
                # (safe: what the host path would not have checked: a NaN/Inf that came
                # in from outside the watched ops (a constant, a tensor made before the
                # watch) passes through; the next op that could have made it says where
                # it came in)
                for address, _, _, whole in written:
                    if whole or value is not None:
                        made[address] = (value, len(self.violations) > n0, None)
                continue
            args = _live(wargs)
            kwargs = _live(wkwargs) if wkwargs else {}
            # an argument written since the op ran (`x.copy_(torch.full_like(x, nan))`)
            # does not hold what the op read: judged as one that is gone, when something
            # tells what its memory held (an earlier op of the window wrote it, or it was
            # judged); else its values now (a write may have left the part the op read
            # as it was). One the op wrote itself moved on by the op: the verdict judges
            # it by what was judged of it before, as on the host
            own = _written_by(info, args, kwargs) if info.mutated else ()
            if own and made:
                self._as_read_then(memory, own, made)
            since = {id(t) for ref, address, storage_ref, version in memory
                     if (t := ref()) is not None and t._version != version
                     and id(t) not in own and (
                         address in made or prior
                         or self._taint_at(address, storage_ref()) is not None)}
            if since:
                args, kwargs = _without(args, since), _without(kwargs, since)
            outs = _live(wouts)
            note = ""
            live = [t for t, _ in self._flatten_outputs(outs) if t is not None]
            gone = "freed" if not live else "written over" if not any(
                sum(_counts(t)) for t in live if _floating(t)) else ""
            if gone:
                # freed before the read, or written over since (`x.nan_to_num_()`):
                # computed again from its inputs when they are as the op read them, so
                # that the stop counts and describes what the host path would; else
                # judged by its norm, which tells NaN from Inf and nothing more
                again = _computed_again(func, info, args, kwargs, memory, since, grad)
                if again is not None:
                    outs, dtype = again, None
                else:
                    outs = (_stand_in(value, info, grad),)
                    note = f"its output was {gone} before the device read"
            else:
                dtype = None
            freed = _freed_inputs(made, memory, prior, self._taint_at, self._mark_at, since)
            # (in one of torch's backward formulas: whether what it returned was finite)
            formula = next((first_bad(values, held) is None for start, end, held in returned
                            if start <= index < end), None) if returned else None
            self._slow(func, info, args, kwargs, outs, entry, note, freed, dtype, formula)
            mark = None
            if note:
                # judged by its norm: what was judged of it is of the op's memory too (a
                # factory's output reaches the program as another Python object)
                mark = self._judged_memory(outs[0], written)
            for address, _, _, _ in written:
                made[address] = (value, len(self.violations) > n0,
                                 mark or self._mark_at(address))

    def _as_read_then(self, memory, own, made):
        """An op wrote arguments OWN (ids) in place, memory that an earlier op of the
        window wrote last (MADE): what was judged of that is what the op read, though
        later writes moved the tensor's version on (`p.sub_(m).exp_()`: sub_ read the
        -inf that masked_fill_ wrote). The record is dated now, for the verdict."""
        for ref, address, storage_ref, _ in memory:
            t = ref()
            if t is None or id(t) not in own or made.get(address, (None,))[0] is None:
                continue                      # (the last write there was finite)
            rec = self._taint_at(address, storage_ref())
            if rec is not None:
                self._taint[address] = (rec[0], t._version, *rec[2:])
                mark = self._marks.get(address) if self._marks else None
                if mark is not None:
                    self._marks[address] = (mark[0], t._version, mark[2])

    def _judged_memory(self, norm, written):
        """The taint (and mark) just judged of NORM, the stand-in of an op's output that
        is gone, given to the memory the output was in (WRITTEN), where it lives on.
        Returns the Mark judged of it (a NaN/Inf written on purpose), or None."""
        try:
            ptr = norm.untyped_storage().data_ptr()
        except Exception:                    # noqa: BLE001
            return None
        rec = self._taint.get(ptr)
        if rec is None:
            return None
        mark = self._marks.get(ptr) if self._marks else None
        for address, storage_ref, version, _ in written:
            if storage_ref() is None:
                continue
            self._taint[address] = (storage_ref, version, *rec[2:])
            if mark is not None:
                self._marks[address] = (storage_ref, version, mark[2])
                if rec[2]:
                    self._nan_marks[address] = storage_ref
        return mark[2] if mark is not None else None


def _computed_again(func, info, args, kwargs, memory, since, grad):
    """The outputs of the op run again on ARGS and KWARGS (as a tuple), when that makes
    what it made: an aten op that writes nothing and draws no random numbers, every
    tensor it read alive and unwritten since (MEMORY's version counters; SINCE empty);
    and only when they hold a NaN/Inf again (a nondeterministic kernel may not). Else
    None. Runs at a stop only, under the watch's own ops."""
    if info.mutated or since or func.namespace != "aten" \
            or torch.Tag.nondeterministic_seeded in func.tags:
        return None           # (another namespace's op may be a collective: not alone)
    for ref, _, _, version in memory:
        t = ref()
        if t is None or t._version != version:
            return None
    try:
        with torch.no_grad():
            out = func(*args, **kwargs)
    except Exception:                        # noqa: BLE001 - (an argument it cannot take)
        return None
    outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    floating = [t for t in outs if isinstance(t, Tensor) and _floating(t)]
    if not any(sum(_counts(t)) for t in floating[:1 if info.short in WORKSPACE_OUTPUTS
                                                 else None]):
        return None
    if grad:
        read = tensors_in((args, kwargs))
        for t in floating:     # (as the op's output did: marks.py reads it; not an input
            if t.is_leaf and not any(t is x for x in read):   # returned as it is)
                t.requires_grad_(True)
    return outs


def _stand_in(norm, info, grad) -> Tensor:
    """What is judged of an op's output that is gone: its norm (NaN, or the largest
    magnitude), requiring grad as the output did. The norm has no sign; a log's output,
    infinite where its input was finite, is -inf (log(0): ops.LOG_AT_ZERO)."""
    if info.short in LOG_AT_ZERO and norm == math.inf:
        norm = -math.inf
    return torch.tensor(norm, requires_grad=grad)


def _writes_nonfinite(args, kwargs) -> bool:
    """Whether a constant writer's Python scalar argument is a NaN or an Inf."""
    for value in (*args, *kwargs.values()) if kwargs else args:
        if type(value) is float and not _isfinite(value):
            return True
    return False


def _freed_inputs(made, memory, prior, taint_at, mark_at, since=()):
    """What the op's tensor arguments that are gone since held: (has NaN, has Inf,
    descends from a stop, the Mark of a value written on purpose or None), or None when
    none held a NaN/Inf (or none is gone).

    MEMORY: (weak reference, memory address, weak reference to the storage, version
    counter) of each argument, from the op; one written since (SINCE: their ids) is
    taken for gone, its values now not those the op read. One gone is known by the check of the last earlier op of the
    window that wrote its memory (a temporary between two ops of the window), or by its
    judgement before the op ran (PRIOR: the taint of the op's arguments then), or, while
    its memory lives on (a view of a parameter), by what was judged of that memory since
    (TAINT_AT: Verdict._taint_at, for the same storage, not another one at the same
    address). Else it came from outside the window's ops (a constant, a module's output)
    and was finite: a NaN/Inf there was judged where it was made, or is new here."""
    nan = inf = lineage = dead = False
    mark = None
    for ref, address, storage_ref, version in memory:
        t = ref()
        if t is not None and id(t) not in since:
            continue                  # (alive, read as it is: the judge reads it)
        dead = True
        found = made.get(address)
        if found is None:
            storage = storage_ref()
            record = taint_at(address, storage) if storage is not None else None
            if record is not None:
                was_nan, was_inf, was_lineage = record[2:5]
                nan, inf, lineage = nan or was_nan, inf or was_inf, lineage or was_lineage
                mark = mark or mark_at(address)
        elif found[0] is not None:
            value = found[0]
            nan, inf = nan or value != value, inf or value == value
            lineage = lineage or found[1]
            mark = mark or found[2] or mark_at(address)
    if dead and prior:
        nan, inf = nan or any(p[0] for p in prior), inf or any(p[1] for p in prior)
        lineage = lineage or any(p[2] for p in prior)
        mark = mark or next((p[3] for p in prior if p[3] is not None), None)
    return (nan, inf, lineage, mark) if nan or inf else None


def _memory_of(value, found) -> list:
    """(weak reference, memory address, weak reference to its storage, version counter)
    of the tensors in VALUE (lists, tuples, dicts), appended to FOUND."""
    if isinstance(value, Tensor):
        try:
            storage = value.untyped_storage()
            found.append((_ref(value), storage.data_ptr(), _ref(storage), value._version))
        except Exception:                    # noqa: BLE001 - no storage: nothing to tell
            pass
    elif isinstance(value, (list, tuple)):
        for x in value:
            _memory_of(x, found)
    elif isinstance(value, dict):
        for x in value.values():
            _memory_of(x, found)
    return found


def _weak(value):
    """Tensors (also inside lists, tuples and dicts) replaced by weak references."""
    if isinstance(value, Tensor):
        return weakref.ref(value)
    if isinstance(value, (list, tuple)):
        # (loops, not generators: this runs for every op of the device window)
        for x in value:
            if isinstance(x, (Tensor, list, tuple)):
                return type(value)([weakref.ref(x) if isinstance(x, Tensor) else _weak(x)
                                    for x in value])
        return value
    if isinstance(value, dict):
        return {k: _weak(v) for k, v in value.items()}
    return value


def _written_by(info, args, kwargs) -> set:
    """The ids of the tensors the op of INFO writes (its mutated arguments; a list's
    tensors for a foreach op)."""
    found = set()
    for key, _ in info.mutated:
        value = args[key] if type(key) is int and key < len(args) else kwargs.get(key)
        for t in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(t, Tensor):
                found.add(id(t))
    return found


def _without(value, gone):
    """VALUE (tensors, also inside lists, tuples and dicts) with the tensors whose id is
    in GONE replaced by None."""
    if isinstance(value, Tensor):
        return None if id(value) in gone else value
    if isinstance(value, (list, tuple)):
        return type(value)(_without(x, gone) for x in value)
    if isinstance(value, dict):
        return {k: _without(v, gone) for k, v in value.items()}
    return value


def _live(value):
    """Undo `_weak`: dead tensors become None."""
    if isinstance(value, weakref.ref):
        return value()
    if isinstance(value, (list, tuple)):
        return type(value)(_live(x) for x in value)
    if isinstance(value, dict):
        return {k: _live(v) for k, v in value.items()}
    return value
