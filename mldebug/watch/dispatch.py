"""The per-op check: a `TorchDispatchMode` that checks every floating output of every
aten op while it is on the dispatch stack (outside the roots' calls, backward and the
optimizer step by default; everywhere with `exact=True` and in a re-run).

Hot path (per op, see `_Mode.__torch_dispatch__`): one dict lookup for the cached
`OpInfo`, the op, then for each floating CPU output the C bit test on its memory
(native_check.py: no op, no read), or where that cannot read it one reduction (`sum`)
and one `.item()`, `math.isfinite` on the float. Ops that cannot make a NaN/Inf
(`OpInfo.safe`, see ops.py) skip the check while nothing non-finite has been judged. NaN
and Inf propagate through a sum, so a finite sum means a finite tensor; a non-finite
output (or a sum that merely overflowed) goes to `Watch._slow` (verdict.py), which
counts exactly and applies the stop rule. Outputs on other devices (CUDA) are held by
the ledger without a sync and read once per window or training step (device_window.py,
step_ledger.py).

`PerOpCheck` is mixed into `Watch` (core.py): the methods the mode calls besides the
common single-tensor case. The mode calls them as `watch._x(...)`, one call (a mixin
adds no Python layer).
"""
from __future__ import annotations

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from ..core import frames as _frames
from ..core import cuda_graphs as _cuda_graphs
from .checks import (_LOW, _PLAIN, _STRIDED, _SUM_DTYPE, _getframe, _grad_enabled,
                     _isfinite, host_bad)
from .ops import OpInfo
from .native_check import nonfinite as _native_nonfinite

_current_node = torch._C._current_autograd_node
_USER_CODE: dict = {}              # code object -> is user code (the hot path's cache)
_is_user_file = _frames.is_user_file

_OP_INFOS: dict = {}       # id(overload) -> OpInfo, for every watch (info.func keeps
                           # the overload alive, so its id stays unique)
_HOST_READS = True         # CPU outputs read at once; False: as a device's (tests,
                           # core.simulate_device)


def _skip_dynamo(classes) -> None:
    """Tell dynamo never to trace the watch's code (what torch._dynamo.disable does for
    a mode's __torch_dispatch__, without the per-call wrapper): every function of
    CLASSES (their own, not inherited ones)."""
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy
    except Exception:
        return
    strategy = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    for obj in [obj for cls in classes for obj in vars(cls).values()]:
        code = getattr(getattr(obj, "__func__", obj), "__code__", None)
        if code is not None:
            try:
                set_code_exec_strategy(code, strategy)
            except Exception:
                return


class _Mode(TorchDispatchMode):
    """The per-op check. Kept lean: this runs for every aten op of the program."""

    def __init__(self, watch):
        super().__init__()
        self.w = watch
        self.infos = watch._infos

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # torch.compile compiles under the watch: dynamo turns the mode off while it
        # compiles and on again around the compiled code, which the watch checks at its
        # boundary. (False, torch's default, makes dynamo fall back to eager under any
        # mode: a compiled function would compute other bits than without mldebug.)
        return True

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch would wrap __torch_dispatch__ in torch._dynamo.disable: two Python
        # layers per op (~2 us). `_skip_dynamo()` marks the code objects instead.
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        __tracebackhide__ = True   # (an op's own error: its traceback ends at the caller)
        info = self.infos.get(id(func))   # OpOverload.__hash__ is Python: key by id
        if info is None:
            info = self.w._info(func)
        w = self.w
        if w._skip:
            op = info.op
            return op(*args, **kwargs) if kwargs else op(*args)
        if w._in_formula and w._in_formula[-1][0] is not _current_node():
            w._judge_formulas()     # (a backward formula returned: what it left is judged)
        if info.skip:
            op = info.op
            if info.lifted:
                return w._lifted(op(*args, **kwargs) if kwargs else op(*args))
            return op(*args, **kwargs) if kwargs else op(*args)
        if w._pending:
            w._attach_provenance()
        if w._stash and not _cuda_graphs.capturing():   # (no prompt inside a CUDA graph capture)
            w._deliver_stash()
        if info.mutated and (w._ledger._held or w._ledger.sources):
            w._before_mutation(w._mutated(info, args, kwargs))
        op = info.op
        safe = info.safe
        if safe and (w._taint or (safe == 2 and not info.guard(args, kwargs))):
            safe = 0
        out = op(*args, **kwargs) if kwargs else op(*args)
        if safe:
            if info.promote and isinstance(out, Tensor) and out.dtype in _LOW:
                safe = 0
            elif not w._win:
                # cannot make a NaN/Inf from finite inputs, and nothing non-finite was
                # judged yet: no check (see ops.SAFE_ALWAYS)
                if info.prov and _grad_enabled():
                    w._pending.append((out, w._provenance(info)))
                return out
            # (else held: the device window's earlier ops are not judged yet. At the
            # read it is judged only if one of them was non-finite: `safe` goes with it)
        if isinstance(out, Tensor):
            sum_dtype = _SUM_DTYPE.get(out.dtype, 0)
            if sum_dtype == 0:
                return out                # integer, bool, complex: not checked
            if type(out) not in _PLAIN or out.layout is not _STRIDED or out.is_nested \
                    or out.is_meta:       # (checks._checkable, inline: every op runs it)
                return out                # fake/meta/nested/mkldnn/subclass: no data to read
            if out.is_cpu and _HOST_READS:
                bad = _native_nonfinite(out)       # no op, no read; None: not readable
                if bad is None:
                    s = out.sum() if sum_dtype is None else out.sum(dtype=sum_dtype)
                    bad = not _isfinite(s.item())
                if bad:
                    w._slow(func, info, args, kwargs, (out,), None)
            elif _grad_enabled():
                here = w._window_add(func, info, args, kwargs, (out,), None, safe)
                if here is not None:      # (the user frame it found: no second walk)
                    w._pending.append((out, (w._top, here[0], here[1], here[2],
                                             info.torch_op)))
                    return out
            else:
                w._window_add(func, info, args, kwargs, (out,), None, safe)
                return out
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
                w._check_many(func, info, args, kwargs, w._mutated(info, args, kwargs), safe)
        elif type(out) is tuple or type(out) is list:
            here = w._check_many(func, info, args, kwargs, out, safe)
            if _grad_enabled():
                w._pending.append((out, w._provenance(info) if here is None else
                                   (w._top, here[0], here[1], here[2], info.torch_op)))
        return out


class PerOpCheck:
    """Methods of `Watch` that the per-op check calls: OpInfo cache, several outputs."""

    def _info(self, func) -> OpInfo:
        info = OpInfo(func)
        info.func = func                 # keeps the overload alive: its id stays unique
        self._infos[id(func)] = info
        return info

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

    def _check_many(self, func, info, args, kwargs, outs, safe=0):
        """Check a tuple/list of outputs (may hold lists: foreach ops). Returns the user
        frame the device window found (`_window_add`), else None. SAFE: the op could
        not make a NaN/Inf here (held for the device window only; see `_window_add`)."""
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
                        and type(t) in _PLAIN and t.layout is _STRIDED \
                        and not t.is_nested and not t.is_meta:    # (_checkable, inline)
                    (cpu if t.is_cpu and _HOST_READS else device).append(t)
        here = self._window_add(func, info, args, kwargs, tuple(outs), device, safe) \
            if device else None
        if cpu and host_bad(cpu):
            self._slow(func, info, args, kwargs, outs, None)
            return None
        return here
