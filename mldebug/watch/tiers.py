"""The watch's two tiers, and the replay that joins them.

Why: a Python dispatch mode costs per op before it checks anything (1.3x on a small MLP,
1.02-1.07x on a CNN or a transformer, measured here), so the exact per-op check cannot be
on for the whole step and stay under the speed targets. Instead:

- Inside a module call (the model's forward), the exact mode is popped off the dispatch
  stack. Each module's output is checked cheaply in the global forward hook (one sum: NaN
  and Inf propagate through it). A non-finite output *flags* the outermost call.
- At the end of a flagged outermost call, the call is **replayed** with the exact mode on
  (same arguments, RNG state restored, buffers put back afterwards): the exact check then
  stops at the first op that made the NaN/Inf, in the user's own forward code, with that
  op on the stack -- the same stop the exact mode would have made.
- Backward: `loss.backward()` first computes the gradient of the model's outputs through
  the code outside the model (the loss: a few ops) under the exact mode (a "dry run" with
  `retain_graph=True`, so nothing is computed twice by the real pass), then runs the real
  backward without the mode and checks every parameter gradient with one sum each. The dry
  run is skipped when every autograd node of the loss region is in `safe.SAFE_BACKWARD` (its
  backward cannot make a NaN/Inf from finite values, short of an overflow): the gradient
  of each model output is then checked, and kept for a replay, by the pre-hook on its
  node; a non-finite one (that overflow) is a stop that names the loss region's nodes. A
  non-finite gradient replays the model call and its backward (`torch.autograd.grad` from
  the stored output gradient, nothing accumulated into `.grad`) under the exact mode, which
  stops at the backward op that made it, reported against its forward line.
- Inside an exact nn.Sequential of torch.nn layers no user code runs: a child's output
  sentinel is left out when the next child is a layer that passes any NaN/Inf on (its
  own sentinel then flags, and the flag defers to the Sequential), its gradient sentinel
  when the next child's backward cannot make one, and the parameter gradients of such a
  Sequential are not summed (they follow from its output's checked gradient). What only
  an overflow in those layers' backward makes is then seen at the optimizer step
  (safe.py: `sequential_plan`, `params_to_check`).
- A torch.nn layer whose parameters need a gradient (Linear, convolutions, norms,
  embeddings) gets no gradient sentinel: every value of its output's gradient enters
  those parameters' gradients, checked after backward (safe.params_show_grad; the
  modules are kept in RootCall.shown, also when the model does not own them).
- The optimizer step runs without the mode: every parameter and state tensor gets one
  sum afterwards.
- Everything else outside modules and outside backward (data handling, the loss) keeps
  the exact per-op check.

What the replay cannot do (said in the report when it happens): reproduce a call whose
result depends on state it changes itself (other than buffers), or on an input it
modifies in place. Module hooks and forward code run a second time during a replay; the
rest of mldebug (graph capture, assertions, recording) ignores it (`mldebug.core.replay`).
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch
import torch.nn as nn
from torch import Tensor

from ..core import replay as _replay
from ..core.structs import tensors_in
from . import safe as _safe
from .native_check import nonfinite as _native_nonfinite

_F32 = torch.float32
_pop_mode = torch._C._pop_torch_dispatch_stack
_push_mode = torch._C._push_on_torch_dispatch_stack
_stack_len = torch._C._len_torch_dispatch_stack
_stack_at = torch._C._get_dispatch_stack_at
_MODULE_FILE = nn.Module._call_impl.__code__.co_filename
try:
    from torch.autograd.graph import get_gradient_edge as _gradient_edge
except ImportError:  # torch < 2.2: keep the tensor
    def _gradient_edge(tensor):
        return tensor
MAX_CALLS = 4          # outermost calls remembered for a backward replay (an output
                       # read outside modules keeps its graph alive until backward)
MAX_PATTERNS = 256     # flagged patterns whose replay found no stop


flat_tensors = tensors_in   # module outputs, in the order the replay matches them

# False while tests run the device paths on the CPU (core.simulate_device)
_HOST_READS = True


def call_kwargs(start) -> dict:
    """The keyword arguments of the module call whose global hook is running: the
    `_call_impl` frame (or its nested `inner`) above the hook holds them; global hooks
    are not given them."""
    f = start
    for _ in range(4):
        if f is None:
            break
        code = f.f_code
        if code.co_filename == _MODULE_FILE and code.co_name in ("inner", "_call_impl"):
            kwargs = f.f_locals.get("kwargs")
            return dict(kwargs) if isinstance(kwargs, dict) else {}
        f = f.f_back
    return {}


class RootCall:
    """An outermost module call whose output needs a gradient: what a replay needs."""

    __slots__ = ("module", "args", "kwargs", "cpu_rng", "cuda_rng", "autocast", "outs",
                 "grads", "used", "sentinels", "shown", "lineage", "site", "__weakref__")

    def __init__(self, module, args, kwargs, rng, autocast, outs, site=None):
        self.module = module
        # (file, line, function) of the user's line that made the call: a re-run found
        # at a later read (a device's step) names it, not the read's line
        self.site = site
        self.args = args
        self.kwargs = kwargs
        self.cpu_rng, self.cuda_rng = rng
        self.autocast = autocast
        # position in flat_tensors(output) -> weakref (None: needs no gradient)
        self.outs = [weakref.ref(t) if t.requires_grad else None for t in outs]
        self.grads: dict = {}      # position -> gradient of that output (dry run)
        self.used: dict = {}       # position read by ops outside modules -> its edge
        self.sentinels: list = []  # position -> _GradSentinel on its autograd node, or None
        self.shown: list = []      # modules inside whose output gradients are checked in
                                   # their parameters' gradients (safe.params_show_grad)
        self.lineage = False       # a stop was made in this call: its outputs descend

    def use(self, pos, tensor) -> None:
        if pos not in self.used:
            try:
                self.used[pos] = _gradient_edge(tensor)
            except Exception:  # noqa: BLE001 - old torch: the tensor itself
                self.used[pos] = tensor


_get_state = torch._C.Generator.get_state


def rng_state():
    """(cpu state, cuda states or None): taken as every module call starts (1.5 us).

    The generators' own `get_state` (C), not `torch.get_rng_state()` and
    `torch.cuda.get_rng_state_all()`: the same states (the latter is this, device by
    device), without their Python layers -- ~10 calls a module call on a one-GPU machine,
    ~3 more for each further device that torchrun leaves visible. CUDA's generators
    exist once it is initialized (before, the tuple is empty: nothing to save)."""
    try:
        cuda = list(map(_get_state, torch.cuda.default_generators)) or None
    except Exception:  # noqa: BLE001 - no replay of CUDA randomness then
        cuda = None
    return _get_state(torch.default_generator), cuda


def autocast_state():
    """[(device, enabled, dtype)] of the devices where autocast is on, or ()."""
    state = []
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                state.append((device, torch.get_autocast_dtype(device)))
        except Exception:  # noqa: BLE001 - older torch: no per-device query
            pass
    return tuple(state)


def _identity(t):
    return t


def _own_saved_tensors():
    """What the re-run saves for backward stays its own: identity saved-tensor hooks on
    top of the stack hide it from the program's (torch.utils.checkpoint counts the
    tensors its forward saves, and fails the recomputation when a re-run added some)."""
    try:
        return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)
    except Exception:  # noqa: BLE001 - hooks disabled here (functorch): nothing to hide
        return contextlib.nullcontext()


_set_stance = getattr(torch.compiler, "set_stance", None)     # (torch >= 2.6)


@contextlib.contextmanager
def replay_context(call_rng, autocast, module):
    """RNG as it was at the call's start, the call's autocast, the rest of mldebug deaf to
    the re-run, and the modules' buffers swapped for copies while it runs: BatchNorm's
    running stats are updated on the copies. (Writing the old values back instead would
    bump the buffers' version counters, and a backward that saved them would fail.)"""
    cpu_now = torch.get_rng_state()
    cuda_now = None
    cpu_rng, cuda_rng = call_rng
    swapped = []
    try:
        with torch.no_grad():
            for mod in module.modules():
                for name, b in mod._buffers.items():
                    if b is not None:
                        mod._buffers[name] = b.clone()
                        swapped.append((mod, name, b))
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            cuda_now = torch.cuda.get_rng_state_all()
            torch.cuda.set_rng_state_all(cuda_rng)
        with contextlib.ExitStack() as stack:
            stack.enter_context(_replay.replaying())
            stack.enter_context(_own_saved_tensors())
            if _set_stance is not None:
                # a compiled model (or a compiled part of it) re-runs eagerly: its ops one
                # by one under the exact mode, which compiled code hides from it
                stack.enter_context(_set_stance("force_eager"))
            for device, dtype in autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield
    finally:
        for mod, name, b in swapped:
            mod._buffers[name] = b
        torch.set_rng_state(cpu_now)
        if cuda_now is not None:
            torch.cuda.set_rng_state_all(cuda_now)


class TierState:
    """The watch's tier bookkeeping (one per Watch)."""

    def __init__(self):
        self.popped = False          # the exact mode is off the stack (inside a call)
        self.replaying = 0
        self.read_now = 0            # a re-run or a dry run: device outputs read op by op
        self.in_backward = 0
        self.flag = None             # (module record, counts): the call to replay
        self.done = False            # this outermost call had its stop: no more replays
        self.start_rng = None        # RNG at the start of the running outermost call
        self.last_out = None         # last output checked (a parent returning it again)
        self.last_sentinels: list = []   # grad sentinels of the last call's outputs
        self.loss_bflag = None       # (RootCall, position, counts): a model output's
                                     # gradient made non-finite by an unchecked loss region
        self.device_loss_slots: list = []  # (ledger slot, RootCall, position) of those
        self.device_outputs: list = []   # (ledger slot, weakref(output), module record)
                                         # of this outermost call's device outputs
        self.calls: list = []        # RootCall, oldest first
        self.open: dict = {}         # id(output tensor) -> (RootCall, position)
        self.fruitless: dict = {}    # flag pattern -> True: its replay found no stop
        self.judged_grads: dict = {}     # id(param) -> param whose non-finite grad was
                                         # judged (until it is reset)
        self.bflag = None            # (module record, counts): first bad output gradient
        self.device_grad_slots: list = []  # (ledger slot, record) of output gradients
        self.opt_popped = False      # the optimizer step runs without the exact mode
        self.replay_lineage = False  # the last re-run's outputs descend from a stop
        self.replay_mark = None      # ... or from a constant written on purpose (marks.py)
        self.fruitless_marks: dict = {}  # flag pattern -> that Mark, of `fruitless` ones
        self.recomputing: list = []  # modules whose forward runs again inside backward
                                     # (torch.utils.checkpoint's recomputation)
        self.shown: dict = {}        # the running outermost call's RootCall.shown, by id
        self.shown_ok = False        # its parameter gradients are this process's own
        # a re-run's (where it was started, the call's own line): an op of the re-run
        # whose innermost user line is where the re-run started ran in library code
        # (torch's modules) right under the call, and was made at the call's line
        self.replay_site = None


def mode_on_top(mode) -> bool:
    n = _stack_len()
    return bool(n) and _stack_at(n - 1) is mode


def pop_if_top(mode) -> bool:
    if mode is not None and mode_on_top(mode):
        _pop_mode(None)
        return True
    return False


def push(mode) -> None:
    _push_mode(mode)


@contextlib.contextmanager
def mode_off(mode):
    """The exact mode off the stack for mldebug's own ops (cheaper than suspending it:
    a suspended mode still costs a Python call per op)."""
    popped = pop_if_top(mode)
    try:
        yield
    finally:
        if popped:
            _push_mode(mode)


@contextlib.contextmanager
def mode_on(mode):
    """The exact mode on top of the stack (a re-run needs it), also from where it is off:
    inside its own `__torch_dispatch__`, or the optimizer step."""
    pushed = mode is not None and not mode_on_top(mode)
    if pushed:
        _push_mode(mode)
    try:
        yield
    finally:
        if pushed:
            pop_if_top(mode)


def any_nonfinite(obj) -> bool:
    """Whether any floating tensor in OBJ (arguments of a call) holds a NaN/Inf."""
    return any_nonfinite_sum([t for t in flat_tensors(obj) if t.is_floating_point()
                              and t.layout is torch.strided and not t.is_meta])


def step_tensors(optimizer) -> list:
    """[(tensor, param, 'value' or state key, param group)] an optimizer step writes:
    its floating parameters and their floating state tensors."""
    out = []
    state = getattr(optimizer, "state", {})
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            if not isinstance(p, Tensor) or not p.is_floating_point() \
                    or p.layout is not torch.strided or p.is_meta:
                continue
            out.append((p, p, "value", group))
            for key, value in (state.get(p) or {}).items():
                if isinstance(value, Tensor) and value.is_floating_point() \
                        and value.layout is torch.strided and not value.is_meta:
                    out.append((value, p, key, group))
    return out


def step_grads(optimizer) -> list:
    """[(param, its gradient)] of the floating, strided gradients a step will use."""
    out = []
    for group in getattr(optimizer, "param_groups", ()):
        for p in group.get("params", ()):
            g = getattr(p, "grad", None) if isinstance(p, Tensor) else None
            if g is not None and g.is_floating_point() and g.layout is torch.strided \
                    and not g.is_meta:
                out.append((p, g))
    return out


_OWN_SUM = (torch.float32, torch.float64)    # summed in their own dtype (no copy)


def any_nonfinite_sum(tensors) -> bool:
    """One sum per tensor (one read each on CPU, where a read is free; one read per
    device elsewhere): True when any may hold a NaN/Inf."""
    by_device: dict = {}
    isfinite = math.isfinite
    for x in tensors:
        if x.is_cpu and _HOST_READS:
            bad = _native_nonfinite(x)             # no op, no read; None: not readable
            if bad is None:
                d = x.detach()
                s = d.sum() if d.dtype in _OWN_SUM else d.sum(dtype=_F32)
                bad = not isfinite(s.item())
            if bad:
                return True
        else:
            by_device.setdefault(x.device, []).append(x)
    for xs in by_device.values():
        with torch.no_grad():               # our own reduction: no autograd node
            total = device_total(xs)
        if not math.isfinite(total.item()):
            return True
    return False


def device_total(xs):
    """A total over tensors of one device, as a 0-d float32 tensor (not read): NaN/Inf
    when any holds one (or, rarely, when finite values overflow). On a device it is
    Σ|x| (`_foreach_norm`), else plain sums. On a GPU a sum per tensor
    is a kernel launch each (~10 us of CPU time: most of the watch's cost on a
    launch-bound model); `_foreach_norm` covers a list in a few fused launches."""
    if len(xs) == 1:
        return xs[0].sum(dtype=_F32)
    if not xs[0].is_cpu or not _HOST_READS:   # (the CPU standing in for a device: as there)
        try:
            return torch.stack(torch._foreach_norm(xs, 1, dtype=_F32)).sum()
        except (RuntimeError, TypeError):   # an older torch: one sum each
            pass
    return torch.stack([x.sum(dtype=_F32) for x in xs]).sum()


def grad_inputs(module, args, checked_only=False, shown=()) -> list:
    """What a replayed backward differentiates with respect to: the module's parameters
    and the leaf tensors among its arguments that need a gradient. CHECKED_ONLY: those
    whose gradient needs a check after backward (safe.params_to_check). SHOWN: modules
    called inside whose parameters' gradients stand for their outputs' (RootCall.shown),
    also when they are not the module's own (`model(x)` calling a layer kept elsewhere)."""
    seen = set()
    inputs = []
    for p in (_safe.params_to_check(module) if checked_only else module.parameters()):
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            inputs.append(p)
    for m in shown:
        for p in m._parameters.values():
            if p is not None and p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                inputs.append(p)
    for t in flat_tensors(args):
        if t.requires_grad and t.is_leaf and id(t) not in seen:
            seen.add(id(t))
            inputs.append(t)
    return inputs


def floating_grads(tensors) -> list:
    """The floating, strided `.grad`s of TENSORS."""
    grads = []
    for t in tensors:
        g = t.grad
        if g is not None and g.is_floating_point() and g.layout is torch.strided:
            grads.append(g)
    return grads


def split_by_device(items, tensor_of=None) -> tuple[list, list]:
    """(those checked on the host now: CPU tensors, those a device's read checks);
    TENSOR_OF(item) is the tensor of an item that is not one itself."""
    host, device = [], []
    for item in items:
        x = item if tensor_of is None else tensor_of(item)
        (host if x.is_cpu and _HOST_READS else device).append(item)
    return host, device
