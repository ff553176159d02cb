"""The watch itself: a `TorchDispatchMode` that checks every floating output, plus the
global module and optimizer hooks that say where an op runs.

Hot path (per op, see `_Mode.__torch_dispatch__`): one dict lookup for the cached
`OpInfo`, the op, then for each floating CPU output one reduction (`sum`) and one
`.item()`; `math.isfinite` on the float. Ops that cannot make a NaN/Inf (`OpInfo.safe`,
see ops.py) skip the reduction while nothing non-finite has been judged. NaN and Inf
propagate through a sum, so a finite sum means a finite tensor; a non-finite sum (or a
sum that merely overflowed) goes to the slow path, which counts exactly and applies the
stop rule. Outputs on other devices
(CUDA) are summed on the device without a sync and read once per window.

By default this per-op check runs only outside module calls (data handling, the loss):
inside them, in backward and in the optimizer step the mode is off the stack and cheaper
sentinels check instead, re-running a flagged call under the mode (tiered.py, tiers.py).
"""
from __future__ import annotations

import os
import threading
import warnings
import weakref

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optim_hooks
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..core import autograd_patch as _autograd_patch
from ..core import frames as _frames
from ..core import quiet as _quiet
from ..core.errors import NonFiniteError, UsageError
from . import safe as _safe
from . import tiered as _tiered
from . import tiers as _tiers
from .amp import SCALER_OPS, LossScaling
from .checks import (_ALLOWED, _F32, _LOW, _SUM_DTYPE, _caller, _checkable, _counts,
                     _floating, _getframe, _grad_enabled, _isfinite, _summary)
from .context import ModuleNames
from .ops import OpInfo, argument_name, matches
from .tiered import TieredChecks
from .tiers import TierState

_current_node = torch._C._current_autograd_node
_get_ident = threading.get_ident
_USER = _frames._is_user_cache     # file name -> is user code (filled by is_user_file)
_USER_CODE: dict = {}              # code object -> is user code (the hot path's cache)
_is_user_file = _frames.is_user_file

WINDOW_MAX = 1024          # device window: read the flags at least every this many ops
METADATA_KEY = "mldebug"   # grad_fn.metadata key holding the forward op's provenance

_OP_INFOS: dict = {}       # id(overload) -> OpInfo, for every watch (info.func keeps
                           # the overload alive, so its id stays unique)
_ACTIVE = None             # the running Watch
_DYNAMO_MARKED = False     # code objects marked for dynamo to skip
_IN_CHILD = False          # set in forked children (DataLoader workers): do nothing
_HOST_READS = True         # CPU outputs read at once; False: as a device's (tests)


def simulate_device(on: bool) -> None:
    """Tests: treat CPU tensors as a device's (sums kept, read once per window, replays
    and dry runs read op by op), so that a machine without a GPU runs the device paths."""
    global _HOST_READS
    _HOST_READS = _tiered._HOST_READS = _tiers._HOST_READS = not on


_Sequential = torch.nn.Sequential


def _plan(module):
    """Module records inside calls hold (module, parent record, RNG, plan, code): the
    plan of an exact nn.Sequential says which children's outputs need no sentinel, the
    code is that of this call's module in its parent's plan (safe.sequential_plan)."""
    return _safe.sequential_plan(module) if type(module) is _Sequential else None


def _after_fork_in_child():
    global _IN_CHILD
    _IN_CHILD = True
    if _ACTIVE is not None:
        _ACTIVE._skip = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def _skip_dynamo() -> None:
    """Tell dynamo never to trace the watch's code (what torch._dynamo.disable does for
    a mode's __torch_dispatch__, without the per-call wrapper)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except Exception:
        return
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for obj in list(vars(_Mode).values()) + list(vars(Watch).values()):
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is not None:
            try:
                set_code_exec_strategy(code, strategy)
            except Exception:
                return


def active_watch():
    """The running Watch, or None."""
    return _ACTIVE


class _Mode(TorchDispatchMode):
    """The per-op check. Kept lean: this runs for every aten op of the program."""

    def __init__(self, watch):
        super().__init__()
        self.w = watch
        self.infos = watch._infos

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._dynamo.disable: two Python
        # layers per op (~2 us). `_skip_dynamo()` marks the code objects instead.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        info = self.infos.get(id(func))   # OpOverload.__hash__ is Python: key by id
        if info is None:
            info = self.w._info(func)
        w = self.w
        if w._skip:
            op = info.op
            return op(*args, **kwargs) if kwargs else op(*args)
        if w._open:
            w._mark_used(args)
        if info.skip:
            op = info.op
            return op(*args, **kwargs) if kwargs else op(*args)
        if w._pending:
            w._attach_provenance()
        if w._stash:
            w._deliver_stash()
        op = info.op
        safe = info.safe
        if safe and (w._taint or w._win or (safe == 2 and not info.guard(args, kwargs))):
            safe = 0
        out = op(*args, **kwargs) if kwargs else op(*args)
        if safe and (not info.promote or not isinstance(out, Tensor)
                     or out.dtype not in _LOW):
            # cannot make a NaN/Inf from finite inputs, and nothing non-finite was
            # judged yet: no check (see ops.SAFE_ALWAYS)
            if info.prov and _grad_enabled():
                w._pending.append((out, w._provenance(info)))
            return out
        if isinstance(out, Tensor):
            sum_dtype = _SUM_DTYPE.get(out.dtype, 0)
            if sum_dtype == 0:
                return out                # integer, bool, complex: not checked
            if not _checkable(out):
                return out                # fake/meta/nested/mkldnn/subclass: no data to read
            if out.is_cpu and _HOST_READS:
                s = out.sum() if sum_dtype is None else out.sum(dtype=sum_dtype)
                if not _isfinite(s.item()):
                    w._slow(func, info, args, kwargs, (out,), None)
            else:
                w._window_add(func, info, args, kwargs, (out,))
            if _grad_enabled():
                # provenance for backward: the user line of this forward op
                try:
                    f = _getframe(1)
                except ValueError:   # autograd device thread: no Python caller
                    f = None
                while f is not None:
                    code = f.f_code
                    user = _USER_CODE.get(code)
                    if user is None:
                        user = _USER_CODE[code] = _is_user_file(code.co_filename)
                    if user:
                        w._pending.append((out, (w._top, code.co_filename, f.f_lineno,
                                                 code.co_name, info.torch_op)))
                        return out
                    f = f.f_back
                w._pending.append((out, (w._top, "", 0, "", info.torch_op)))
        elif out is None:
            if info.mutated:
                w._check_many(func, info, args, kwargs, w._mutated(info, args, kwargs))
        elif type(out) is tuple or type(out) is list:
            w._check_many(func, info, args, kwargs, out)
            if _grad_enabled():
                w._pending.append((out, w._provenance(info)))
        return out


class Watch(TieredChecks):
    """A running numerics watch. Use as a context manager or call `close()`.

    `enabled` is True while it checks ops (started, not suspended, not in a worker
    process). `suspended()` switches checks off for a block (the debugger prompt).
    `violations` lists what was reported; `seen` counts non-finite outputs judged.
    """

    def __init__(self, on_violation=None, break_on=("nan", "inf"), allow=(), action="break",
                 exact=False):
        from ..core.break_on import parse_break_on
        if action not in ("break", "raise"):
            raise UsageError(f"action must be 'break' or 'raise', action={action!r}")
        if not isinstance(exact, bool):
            raise UsageError(f"exact must be True or False, exact={exact!r}")
        # exact: the per-op check everywhere (no tiers, no replays; slower). Otherwise
        # module calls and backward are checked by sentinels and replayed (tiers.py).
        self.exact = exact
        self._t = TierState()
        self._open = self._t.open   # read on every op (same dict, never rebound)
        self._judged = 0            # non-finite outputs judged by the exact check
        self.break_on = parse_break_on(break_on)
        self.allow = tuple([allow] if isinstance(allow, str) else allow)
        self.action = action
        self.on_violation = on_violation
        self.violations: list = []
        self._infos = _OP_INFOS     # shared: an OpInfo depends on the overload only
        self._mode = None
        self._handles: list = []
        self._started = False
        self._skip = True           # read on every op: closed, suspended or in a child
        self._suspend = 0
        self._owner = None
        self._pid = None
        self._top = None            # module stack: (module, parent_record) or None
        self._names = ModuleNames()
        self._pending: list = []    # forward outputs waiting for their grad_fn
        self._stash: list = []      # violations found off the owner thread
        self._win: list = []        # device window entries
        self._bwd_queued = False
        self._opt_depth = 0
        self._optimizer = None
        self._steps = 0
        self._opt_seen = False
        self._opt_stop_step = None  # optimizer step of the last optimizer-stage stop
        self._taint: dict = {}      # storage ptr -> (weakref, version, has_nan, has_inf)
        self._compile_warned = False
        self._amp = LossScaling()   # GradScaler's scaled losses (amp.py)

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "Watch":
        global _ACTIVE
        if self._started:
            return self
        if _ACTIVE is not None and _ACTIVE is not self:
            raise UsageError("a watch is already running; close it before starting another")
        self._owner = _get_ident()
        self._pid = os.getpid()
        global _DYNAMO_MARKED
        if not _DYNAMO_MARKED:
            _skip_dynamo()
            _DYNAMO_MARKED = True
        self._mode = _Mode(self)
        self._mode.__enter__()
        try:
            self._handles = [
                _module_hooks.register_module_forward_pre_hook(self._module_pre),
                self._register_post_hook(),
                _optim_hooks.register_optimizer_step_pre_hook(self._optimizer_pre),
                _optim_hooks.register_optimizer_step_post_hook(self._optimizer_post),
            ]
            # (exact mode too: stops found on autograd's device threads pause after it)
            _autograd_patch.add(self._around_backward)
            self._amp.start()
        except BaseException:
            self._close_mode()
            raise
        self._started = True
        _ACTIVE = self
        _quiet.watch_started(self)     # mldebug's own work can suspend it (core/quiet.py)
        self._update_skip()
        return self

    def _register_post_hook(self):
        try:
            return _module_hooks.register_module_forward_hook(self._module_post, always_call=True)
        except TypeError:  # torch without always_call
            return _module_hooks.register_module_forward_hook(self._module_post)

    def close(self, _flush: bool = True) -> None:
        """Stop watching and remove every mode and hook (idempotent)."""
        global _ACTIVE
        if not self._started:
            return
        try:
            if _flush and not _IN_CHILD:
                self.flush()
        finally:
            self._started = False
            self._skip = True
            for handle in self._handles:
                handle.remove()
            self._handles = []
            _autograd_patch.remove(self._around_backward)
            self._amp.stop()
            self._close_mode()
            self._t = TierState()
            self._open = self._t.open
            self._pending = []
            self._win = []
            self._stash = []
            self._top = None
            self._opt_depth = 0
            if _ACTIVE is self:
                _ACTIVE = None
            _quiet.watch_closed(self)

    def flush(self) -> None:
        """Judge now what is still pending: the device window, and stops found on
        autograd's device threads (they pause on this thread). The CLI calls it when the
        program ends; `close()` does too."""
        if not self._started or _get_ident() != self._owner:
            return
        if self._win:
            self._flush_window()
        if self._stash:
            self._deliver_stash()

    def _close_mode(self):
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if self._t.popped:       # off the stack already (closed inside a module call)
            self._t.popped = False
            return
        n = torch._C._len_torch_dispatch_stack()
        if n and torch._C._get_dispatch_stack_at(n - 1) is mode:
            mode.__exit__(None, None, None)
        elif _get_ident() != self._owner:
            warnings.warn("mldebug.watch closed from another thread than it was started on: "
                          "its (now inert) dispatch mode stays on that thread's stack",
                          RuntimeWarning, stacklevel=3)
        else:
            warnings.warn("mldebug.watch closed while another dispatch mode is active above "
                          "it: its (now inert) mode stays on the stack", RuntimeWarning,
                          stacklevel=3)

    def __enter__(self) -> "Watch":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(_flush=exc_type is None)

    @property
    def enabled(self) -> bool:
        return self._started and not self._skip

    @property
    def started(self) -> bool:
        return self._started

    def set_break_on(self, break_on) -> None:
        """Change what stops the program while the watch runs (`breakon` at the prompt)."""
        from ..core.break_on import parse_break_on
        self.break_on = parse_break_on(break_on)

    def suspended(self):
        """Context manager: no checks inside (the debugger prompt evaluating user code)."""
        return _Suspended(self)

    def _update_skip(self):
        self._skip = (not self._started) or self._suspend > 0 or _IN_CHILD or (
            self._pid is not None and os.getpid() != self._pid)

    def _info(self, func) -> OpInfo:
        info = OpInfo(func)
        info.func = func                 # keeps the overload alive: its id stays unique
        self._infos[id(func)] = info
        return info

    # -- hooks -----------------------------------------------------------------------
    def _module_pre(self, module, args):
        if self._skip or _get_ident() != self._owner:
            return None
        if self._stash:
            self._deliver_stash()
        top = self._top
        t = self._t
        if top is None:
            self._names.roots.add(module)
            if not self._compile_warned and type(module).__name__ == "OptimizedModule":
                self._compile_note(module)
            if not (self.exact or t.popped or t.replaying or t.in_backward or self._opt_depth):
                # an outermost call: exact mode off inside, sentinels on (tiers.py)
                t.cuda_rng = torch.cuda.is_initialized()
                t.start_rng = _tiers.rng_state(t.cuda_rng)
                t.flag = None
                t.done = False
                t.last_out = None
                t.popped = _tiers.pop_if_top(self._mode)
                if t.popped:
                    self._top = (module, None, t.start_rng, _plan(module), 0)
                    return None
        elif t.popped and not t.replaying:
            plan = top[3] if len(top) > 3 else None
            code = plan.get(id(module), 0) if plan else 0
            # the RNG as this call starts: a replay of just this call draws the same
            # (one whose output its Sequential leaves to the next child is never replayed
            # alone: its flag is the next child's, which defers to the Sequential)
            rng = None if code & _safe.NO_FORWARD_CHECK else _tiers.rng_state(t.cuda_rng)
            self._top = (module, top, rng, _plan(module), code)
            return None
        self._top = (module, top)
        return None

    def _compile_note(self, module):
        self._compile_warned = True
        inner = type(getattr(module, "_orig_mod", module)).__name__
        warnings.warn(f"mldebug: {inner} runs under torch.compile: the watch checks its "
                      "outputs and gradients at the compiled boundary, and pins a NaN/Inf "
                      "inside by re-running the call", RuntimeWarning, stacklevel=4)

    def _module_post(self, module, args, output):
        if self._skip or _get_ident() != self._owner:
            return None
        top = self._top
        t = self._t
        if (t.popped and not t.replaying and output is not None and top is not None
                and top[0] is module):
            self._sentinel(output, top)      # (a re-run has the exact mode on instead)
            if t.flag is not None and t.flag[0] is top and not t.done:
                self._flagged_call(module, args, output, top)
        if top is not None and top[0] is module:
            self._top = top[1]
        else:  # unbalanced (a hook-less exit): unwind to the module if it is on the stack
            record = top
            while record is not None and record[0] is not module:
                record = record[1]
            if record is not None:
                self._top = record[1]
        if self._top is None:
            if t.popped:
                _tiers.push(self._mode)
                t.popped = False
                self._root_end(module, args, output)
            if self._win:
                self._flush_window()
        return None

    def _optimizer_pre(self, optimizer, args, kwargs):
        if self._skip or _get_ident() != self._owner:
            return None
        if self._stash:
            self._deliver_stash()
        if self._win:
            self._flush_window()
        self._forget_calls()     # parameters change: earlier calls cannot be replayed
        self._opt_depth += 1
        self._optimizer = optimizer
        self._opt_seen = True
        t = self._t
        if (not self.exact and self._opt_depth == 1 and not t.replaying
                and len(args or ()) <= 1 and not (kwargs or {}).get("closure")):
            # (args holds the optimizer itself; anything more is a closure)
            # the step without the per-op check; parameters and state checked after it
            # (a step with a closure runs the model inside: it keeps the exact check)
            t.opt_popped = _tiers.pop_if_top(self._mode)
        return None

    def _optimizer_post(self, optimizer, args, kwargs):
        if self._skip or _get_ident() != self._owner:
            return None
        if self._win:
            self._flush_window()
        t = self._t
        popped, t.opt_popped = t.opt_popped, False
        try:
            if popped:
                self._check_step(optimizer)       # (with the mode still off: cheaper)
        finally:
            if popped:
                _tiers.push(self._mode)
            self._opt_depth = max(0, self._opt_depth - 1)
            self._steps += 1
        return None

    # -- provenance for backward -----------------------------------------------------
    def _provenance(self, info):
        """(module record, file, line, function, torch_op) of the op now running."""
        frame = _frames.user_frame(_caller(2))
        if frame is None:
            return (self._top, "", 0, "", info.torch_op)
        return (self._top, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                info.torch_op)

    def _attach_provenance(self):
        pending, self._pending = self._pending, []
        for out, prov in pending:
            if isinstance(out, Tensor):
                node = out.grad_fn
                if node is not None:
                    meta = node.metadata
                    if METADATA_KEY not in meta:
                        meta[METADATA_KEY] = prov
            elif out is not None:
                for t in out:
                    node = t.grad_fn if isinstance(t, Tensor) else None
                    if node is not None:
                        meta = node.metadata
                        if METADATA_KEY not in meta:
                            meta[METADATA_KEY] = prov

    # -- checks ----------------------------------------------------------------------
    def _mutated(self, info, args, kwargs):
        tensors = []
        for key, _ in info.mutated:
            value = args[key] if isinstance(key, int) and key < len(args) else (
                kwargs.get(key) if isinstance(key, str) and kwargs else None)
            if isinstance(value, Tensor):
                tensors.append(value)
            elif isinstance(value, (list, tuple)):
                tensors.append(value)
        return tensors

    def _check_many(self, func, info, args, kwargs, outs):
        """Check a tuple/list of outputs (may hold lists: foreach ops)."""
        cpu = []
        device = []
        for item in outs:
            if isinstance(item, Tensor):
                items = (item,)
            elif isinstance(item, (list, tuple)):
                items = item
            else:
                continue
            for t in items:
                if isinstance(t, Tensor) and _SUM_DTYPE.get(t.dtype, 0) != 0 \
                        and _checkable(t):
                    (cpu if t.is_cpu and _HOST_READS else device).append(t)
        if device:
            self._window_add(func, info, args, kwargs, tuple(outs), device)
        if not cpu:
            return
        if len(cpu) > 4:
            try:
                total = torch.stack(torch._foreach_norm(cpu, 1, dtype=_F32)).sum()
                if _isfinite(total.item()):
                    return
            except Exception:
                pass
        for t in cpu:
            sum_dtype = _SUM_DTYPE[t.dtype]
            s = t.sum() if sum_dtype is None else t.sum(dtype=sum_dtype)
            if not _isfinite(s.item()):
                self._slow(func, info, args, kwargs, outs, None)
                return

    def _stage(self, node):
        if node is not None:
            return "backward"
        return "optimizer" if self._opt_depth else "forward"

    def _slow(self, func, info, args, kwargs, outs, entry, note="", freed=None, dtype=None):
        """An output's check failed: count exactly, apply the rule, report a stop.

        `entry` is a device-window entry (stage, node name, provenance, module record,
        location) when the op ran earlier; None when it is running now. `freed`: an
        input is gone, and what it is taken to have held (has NaN, has Inf, descends
        from a stop). `dtype`: that of the output, when it is gone (judged by its sum).
        """
        if entry is None:
            node = _current_node()
            stage = self._stage(node)
            node_name = node.name() if node is not None else ""
            node_prov = node.metadata.get(METADATA_KEY) if node is not None else None
            record = self._top
            frame = _frames.user_frame(_caller(1))
            here = None
        else:
            stage, node_name, node_prov, record, here = entry
            frame = _frames.user_frame(_caller(1)) if _get_ident() == self._owner else None
        bad = []
        for index, item in enumerate(self._flatten_outputs(outs)):
            t, list_index = item
            if not _floating(t):
                continue
            counts = _counts(t)
            if sum(counts):
                bad.append((t, list_index, counts))
        reported = None
        for t, list_index, counts in bad:
            v = self._judge(info, args, kwargs, t, list_index, counts, stage, node_name,
                            node_prov, record, frame, here, freed, dtype)
            if v is not None and note:
                v.text = f"{v.text}; {note}" if v.text else note
            if v is not None and reported is None:
                reported = v
        if reported is not None:
            self._report(reported)

    @staticmethod
    def _flatten_outputs(outs):
        """[(tensor, index within its list or None)]"""
        flat = []
        for item in outs:
            if isinstance(item, Tensor):
                flat.append((item, None))
            elif isinstance(item, (list, tuple)):
                flat.extend((t, i) for i, t in enumerate(item) if isinstance(t, Tensor))
        return flat

    def _inputs(self, info, args, kwargs, list_index):
        """[(label, value, key)] of the op's arguments; for foreach ops only element
        `list_index` of each list argument."""
        items = []

        def one(label_of, key, value):
            if isinstance(value, (list, tuple)) and value and any(
                    isinstance(x, Tensor) for x in value):
                if list_index is not None and list_index < len(value):
                    items.append((label_of(key, list_index), value[list_index], key))
                else:
                    for i, x in enumerate(value):
                        items.append((label_of(key, i), x, key))
            elif isinstance(value, (Tensor, float, int)) and not isinstance(value, bool):
                items.append((label_of(key, None), value, key))

        for pos, value in enumerate(args):
            one(lambda k, i: argument_name(info, k, i), pos, value)
        for name, value in (kwargs or {}).items():
            one(lambda k, i: argument_name(info, k, i), name, value)
        return items

    # taint: non-finite storages already judged (reported, allowed, or propagated)
    @staticmethod
    def _version(t):
        try:
            return t._version
        except Exception:  # inference tensors have no version counter
            return None

    def _taint_add(self, t, has_nan, has_inf, lineage):
        try:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            ref = weakref.ref(storage)   # storage objects are preserved: dies with the memory
        except Exception:
            return
        if len(self._taint) > 4096:
            self._prune_taint()
        self._taint[ptr] = (ref, self._version(t), has_nan, has_inf, lineage)

    def _prune_taint(self) -> None:
        """Drop the records of non-finite tensors whose memory is gone."""
        self._taint = {k: r for k, r in self._taint.items() if r[0]() is not None}

    def _no_live_taint(self) -> bool:
        """Whether no non-finite tensor judged so far is still alive (dead ones dropped)."""
        if self._taint:
            self._prune_taint()
        return not self._taint

    def _taint_get(self, t):
        """(has_nan, has_inf, lineage) if `t`'s current non-finite values were already
        judged; lineage: they descend from a reported stop."""
        if not self._taint:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:
            return None
        rec = self._taint.get(ptr)
        if rec is None:
            return None
        ref, version, has_nan, has_inf, lineage = rec
        if ref() is None:
            return None     # that memory was freed; this is a new tensor at its address
        now = self._version(t)
        if version is not None and now is not None and now - version not in (0, 1):
            return None  # written by a later op: that op's own check judged it
        return has_nan, has_inf, lineage

    def _judge(self, info, args, kwargs, bad, list_index, counts, stage, node_name, node_prov,
               record, frame, here, freed=None, dtype=None):
        """Apply the stop rule to one non-finite output; return a Violation or None."""
        nan, posinf, neginf = counts
        out_nan = nan > 0
        self._judged += 1
        try:
            bad_ptr = bad.untyped_storage().data_ptr()
        except Exception:
            bad_ptr = None
        mutated_keys = {key for key, _ in info.mutated}
        rows = []              # (label, value, has_nan, has_inf, known, lineage)
        for label, value, key in self._inputs(info, args, kwargs, list_index):
            if isinstance(value, Tensor):
                if not value.is_floating_point() or value.is_complex():
                    rows.append((label, value, False, False, True, False))
                    continue
                in_place = key in mutated_keys and (
                    value is bad or (bad_ptr is not None and bad_ptr and
                                     value.untyped_storage().data_ptr() == bad_ptr))
                if in_place:
                    # the input IS the output: its state before the op is known only
                    # through the taint of an earlier judged op (finite otherwise)
                    prior = self._taint_get(value)
                    has_nan, has_inf, lineage = prior if prior else (False, False, False)
                    rows.append((label, value, has_nan, has_inf, True, lineage))
                    continue
                c = _counts(value)
                has_nan, has_inf = c[0] > 0, c[1] + c[2] > 0
                known, lineage = True, False
                if has_nan or has_inf:
                    prior = self._taint_get(value)
                    known = prior is not None and (prior[0] or not has_nan)
                    lineage = bool(prior and prior[2])
                rows.append((label, value, has_nan, has_inf, known, lineage))
            elif isinstance(value, float) and not _isfinite(value):
                rows.append((f"{label} = {value}", value, value != value,
                             value == value, False, False))
            else:
                rows.append((label, value, False, False, True, False))
        if freed is not None:
            rows.append(("an input freed before the window was read", None, *freed[:2],
                         True, freed[2]))

        any_nan = any(r[2] for r in rows)
        nonfinite = [r for r in rows if r[2] or r[3]]
        lineage = any(r[5] for r in nonfinite)   # descends from a reported stop
        culprit = ""
        text = ""
        stop = False
        if out_nan:
            kind = "nan"
            if not any_nan:
                # a NaN made here: from finite inputs, or from Infs (inf - inf, 0 * inf,
                # softmax of an all -inf row). A consequence only when those Infs
                # descend from a stop already reported.
                created = True
                stop = "nan" in self.break_on and not lineage
                if nonfinite:
                    culprit = nonfinite[0][0]
                    text = f"{culprit} holds Inf (e.g. a fully masked row)"
            else:
                unknown = [r for r in rows if r[2] and not r[4]]
                created = False
                if unknown:
                    stop = "nan" in self.break_on
                    culprit = unknown[0][0]
        else:
            kind = "inf"
            if not nonfinite:
                created = True
                stop = "inf" in self.break_on
            else:
                created = False
                unknown = [r for r in nonfinite if not r[4]]
                if unknown and "inf-all" in self.break_on:
                    stop = True
                    culprit = unknown[0][0]
        if stop and stage == "optimizer" and self._opt_stop_step == self._steps:
            stop = False   # one stop per optimizer step: the other parameters follow
        if stop and (info.name.startswith(SCALER_OPS) or (
                stage == "backward" and self._amp.excuses(dtype or bad.dtype))):
            stop = False   # a loss scaler's overflow: GradScaler skips this step
        if stop and stage == "backward":
            text = self._amp.with_note(text)
        # everything judged here is known from now on: propagation is not a new stop
        self._taint_add(bad, out_nan, posinf + neginf > 0, stop or lineage)
        for r in nonfinite:
            if not r[4] and isinstance(r[1], Tensor):
                self._taint_add(r[1], r[2], r[3], False)
        if not stop:
            return None

        # where
        torch_op = info.torch_op
        param = ""
        if stage == "backward" and node_prov is not None:
            record, file, line, function, fwd_torch_op = node_prov
            file = os.path.abspath(file) if file and not file.startswith("<") else file
            torch_op = fwd_torch_op or torch_op
        elif here is not None:
            file, line, function = here
            file = os.path.abspath(file) if file and not file.startswith("<") else file
        else:
            file, line, function = _frames.location(frame)
        module, module_type = self._names.path(record) if stage != "optimizer" else ("", "")
        if stage == "optimizer":
            param = self._names.param(bad, self._optimizer)
            module, module_type = self._names.owner(param)
        patterns = tuple(_ALLOWED) + self.allow
        if patterns and (matches(patterns, (info.name, info.short, info.name.rsplit(".", 1)[0]))
                         or (module and matches(patterns, (module,)))):
            return None
        if stage == "optimizer":
            self._opt_stop_step = self._steps
        from ..core.records import Violation
        return Violation(
            kind=kind, op=info.name, torch_op=torch_op, module=module,
            module_type=module_type, stage=stage, frame=frame, file=file, line=line,
            function=function, nan=nan, posinf=posinf, neginf=neginf, created=created,
            culprit=culprit, output=_summary(bad),
            inputs=[(label, _summary(value) if isinstance(value, Tensor) else repr(value))
                    for label, value, *_ in rows],
            param=param, node=node_name,
            step=self._steps if self._opt_seen else None, text=text,
        )

    # -- reporting -------------------------------------------------------------------
    def _report(self, v) -> None:
        self.violations.append(v)
        if self.action == "raise":
            self._after_escape(v, exception_type=NonFiniteError)
            raise NonFiniteError(f"mldebug: {v.headline()}", v)
        if _get_ident() != self._owner:
            # autograd's device threads: pause on the user's thread at its next event
            self._stash.append(v)
            return
        callback = self.on_violation
        if callback is None:
            from ..core.session import current
            callback = current().on_violation
        self._suspend += 1
        self._update_skip()
        try:
            callback(v)
        except BaseException as exc:
            self._after_escape(v, exception_type=type(exc))
            raise
        finally:
            self._suspend -= 1
            self._update_skip()

    def _after_escape(self, v, exception_type):
        """An exception leaves the op: the optimizer's post hook will not run, and for
        non-Exception errors (BatchStop) nor will the modules' always-call hooks."""
        if v.stage == "optimizer":
            self._opt_depth = 0
        if not issubclass(exception_type, Exception) and not self._t.replaying:
            self._top = None
            if self._t.popped:         # the outermost call's post hook will not run
                _tiers.push(self._mode)
                self._t.popped = False
        self._pending = []

    def _deliver_stash(self):
        if _get_ident() != self._owner or self._skip:
            return
        stash, self._stash = self._stash, []
        frame = _frames.user_frame(_caller(1))
        for v in stash:
            if v.frame is None:
                v.frame = frame
            self.violations.remove(v)
            self._report(v)

    # -- device window (CUDA and other non-CPU devices) ------------------------------
    def _window_add(self, func, info, args, kwargs, outs, flat=None):
        """Sum the outputs on their device (no sync) and remember enough to judge later.

        `outs`: the op's outputs as returned (tensors, or lists of them for foreach
        ops); `flat`: the floating device tensors among them when already known."""
        if flat is None:
            flat = outs
        sums = [t.sum(dtype=_F32) for t in flat]
        total = sums[0] if len(sums) == 1 else torch.stack(sums).sum()
        if self._t.read_now:
            # a re-run or the loss region's dry run is there to pin the op: read now (a
            # sync per op, on these rare paths), while the op's inputs are alive to judge
            if not _isfinite(total.item()):
                self._slow(func, info, args, kwargs, outs, None)
            return
        node = _current_node()
        if node is not None:
            stage, node_name = "backward", node.name()
            node_prov = node.metadata.get(METADATA_KEY)
            here = None
            if not self._bwd_queued:
                self._bwd_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        else:
            stage = "optimizer" if self._opt_depth else "forward"
            node_name, node_prov = "", None
            f = _caller(2)
            while f is not None and not _USER.get(f.f_code.co_filename, False):
                if f.f_code.co_filename not in _USER:
                    _is_user_file(f.f_code.co_filename)
                    continue
                f = f.f_back
            here = (f.f_code.co_filename, f.f_lineno, f.f_code.co_name) if f is not None else None
        # inputs already judged non-finite, noted now: they may be freed by the time the
        # window is read (a temporary), and then nothing says where their values came from
        prior = None
        if self._taint:
            prior = [k for k in map(self._taint_get, _tiers.flat_tensors((args, kwargs)))
                     if k is not None]
        self._win.append((total, func, info, _weak(args), _weak(kwargs) if kwargs else None,
                          _weak(outs), (stage, node_name, node_prov, self._top, here), prior,
                          flat[0].dtype))
        if len(self._win) >= WINDOW_MAX:
            self._flush_window()

    def _backward_done(self):
        self._bwd_queued = False
        if self._win and not self._skip:
            self._flush_window()

    def _flush_window(self):
        """Read the window's flags with one transfer; judge flagged ops in order.

        Runs from hooks, where the mode is active: suspended, so that its own ops are
        not watched."""
        win, self._win = self._win, []
        if not win:
            return
        self._suspend += 1
        self._update_skip()
        try:
            self._judge_window(win)
        finally:
            self._suspend -= 1
            self._update_skip()

    def _judge_window(self, win):
        try:
            flags = torch.isfinite(torch.stack([e[0] for e in win]))
            if bool(flags.all()):          # the one sync of the window
                return
            flagged = (~flags).nonzero().flatten().tolist()
        except Exception:                  # mixed devices: one read per entry
            flagged = [i for i, e in enumerate(win) if not _isfinite(float(e[0]))]
        n0 = len(self.violations)
        for k, i in enumerate(flagged):
            total, func, info, wargs, wkwargs, wouts, entry, prior, dtype = win[i]
            args = _live(wargs)
            kwargs = _live(wkwargs) if wkwargs else {}
            outs = _live(wouts)
            note = ""
            if not any(t is not None for t, _ in self._flatten_outputs(outs)):
                # freed before the window was read: judge its sum instead (counts are
                # then those of the sum, and an overflowing sum cannot be told apart)
                outs = (total,)
                note = "the output was freed before the window was read: judged by its sum"
            else:
                dtype = None
            freed = None
            if _any_dead(wargs) or _any_dead(wkwargs):
                # an input freed since: what it held is known if it was judged before the
                # op ran; else, after an earlier op of this window made a NaN/Inf, it is
                # taken to hold that (a temporary between the two): not a new stop
                if prior:
                    freed = (any(p[0] for p in prior), any(p[1] for p in prior),
                             any(p[2] for p in prior))
                elif k:
                    freed = (True, True, len(self.violations) > n0)
            self._slow(func, info, args, kwargs, outs, entry, note, freed, dtype)


def _weak(value):
    """Tensors (also inside lists, tuples and dicts) replaced by weak references."""
    if isinstance(value, Tensor):
        return weakref.ref(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_weak(x) for x in value) if any(
            isinstance(x, (Tensor, list, tuple)) for x in value) else value
    if isinstance(value, dict):
        return {k: _weak(v) for k, v in value.items()}
    return value


def _any_dead(value) -> bool:
    """Whether a tensor held by `_weak` is gone."""
    if isinstance(value, weakref.ref):
        return value() is None
    if isinstance(value, (list, tuple)):
        return any(_any_dead(x) for x in value)
    if isinstance(value, dict):
        return any(_any_dead(x) for x in value.values())
    return False


def _live(value):
    """Undo `_weak`: dead tensors become None."""
    if isinstance(value, weakref.ref):
        return value()
    if isinstance(value, (list, tuple)):
        return type(value)(_live(x) for x in value)
    if isinstance(value, dict):
        return {k: _live(v) for k, v in value.items()}
    return value


class _Suspended:
    def __init__(self, watch):
        self.watch = watch

    def __enter__(self):
        self.watch._suspend += 1
        self.watch._update_skip()
        return self.watch

    def __exit__(self, *exc):
        self.watch._suspend -= 1
        self.watch._update_skip()


class Allowed:
    """Handle of `allow()`: patterns stay until `remove()` (or the `with` block ends)."""

    def __init__(self, patterns):
        self.patterns = tuple(patterns)
        _ALLOWED.extend(self.patterns)

    def remove(self) -> None:
        for p in self.patterns:
            if p in _ALLOWED:
                _ALLOWED.remove(p)
        self.patterns = ()

    close = remove

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def allow(*patterns) -> Allowed:
    """Exempt ops ('aten.log.default', 'log', 'aten.log*') or module paths ('encoder.*')
    from stopping. fnmatch patterns; returns a handle whose `remove()` takes them back."""
    for p in patterns:
        if not isinstance(p, str) or not p:
            raise UsageError(f"allow() takes non-empty pattern strings, got {p!r}")
    return Allowed(patterns)


def watch(on_violation=None, break_on=("nan", "inf"), allow=(), action="break",
          exact=False) -> Watch:
    """Start watching every op for NaN/Inf; returns the running `Watch` (close() it, or
    use it as a context manager).

    exact=False (default): inside module calls and backward, cheap sentinels check
    module outputs and gradients, and a flagged call is re-run under the per-op check to
    find its op (see tiers.py). exact=True: the per-op check everywhere, no re-runs."""
    return Watch(on_violation=on_violation, break_on=break_on, allow=allow,
                 action=action, exact=exact).start()
