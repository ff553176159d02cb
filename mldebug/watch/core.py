"""The watch itself: the `Watch` lifecycle (start, close, suspend), the global module and
optimizer hooks that say where an op runs, and the provenance that backward reports.

What a `Watch` does is spread over mixins, one per concern (each module says more):
  dispatch.py       the per-op check: `_Mode`, the TorchDispatchMode on every aten op
  verdict.py        the stop rule: an op's non-finite output -> `Violation` or not; reporting
  step_ledger.py    every check of a tensor on a device (CUDA): held, reduced by a few
                    fused ops and read once a window, or once a training step
  device_window.py  the per-op check's outputs on a device: judged at the ledger's read
  module_tier.py    inside module calls: output sentinels, replay of a flagged call
  backward_tier.py  around `loss.backward()`: loss region, gradient sentinels, replay
  optimizer_tier.py around `optimizer.step()`: the step read, parameters and state after
  marks.py          NaN/Inf the program writes on purpose: where they must not go

By default the per-op check runs only outside module calls (data handling, the loss):
inside them, in backward and in the optimizer step the mode is off the stack and cheaper
sentinels check instead, re-running a flagged call under the mode (tiers.py).
"""
from __future__ import annotations

import os
import threading
import warnings

import torch
import torch.nn.modules.module as _module_hooks
import torch.optim.optimizer as _optim_hooks
from torch import Tensor

from ..core import autograd_patch as _autograd_patch
from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core import quiet as _quiet
from ..core.break_on import parse_break_on
from ..core.compile import FLAG as _FLAG
from ..core.compile import dynamo_compiling as _dynamo_compiling
from ..core.compile import silence_global_hook_warning
from ..core.device_path import simulated_by_env
from ..core.errors import UsageError
from . import backward_tier as _backward_tier
from . import compiled as _compiled
from . import data_origin as _data_origin
from . import dispatch as _dispatch
from . import module_tier as _module_tier
from . import safe as _safe
from . import tiers as _tiers
from .amp import LossScaling
from .backward_tier import BackwardTier
from .compiled import CompiledBoundary
from .checks import _ALLOWED, METADATA_KEY, _caller
from .context import ModuleNames
from .device_window import DeviceWindow
from .graph_replays import GraphReplays
from .dispatch import _OP_INFOS, PerOpCheck, _Mode, _skip_dynamo
from .marks import WrittenMarks
from .module_tier import ModuleTier
from .optimizer_tier import OptimizerTier
from .step_ledger import DeviceReads, StepLedger, cuda_graph_aside, memory_addresses
from .tiers import TierState
from .verdict import Verdict

_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id


def _in_autograd_backward() -> bool:
    """Whether autograd's engine runs a backward on this thread now."""
    return _graph_task_id() != -1

_ACTIVE = None             # the running Watch
_DYNAMO_MARKED = False     # code objects marked for dynamo to skip
_IN_CHILD = False          # set in forked children (DataLoader workers): do nothing


def simulate_device(on: bool) -> None:
    """Tests: treat CPU tensors as a device's (sums kept, read once per window, replays
    and dry runs read op by op), so that a machine without a GPU runs the device paths."""
    _dispatch._HOST_READS = _module_tier._HOST_READS = _backward_tier._HOST_READS = \
        _tiers._HOST_READS = not on


if simulated_by_env():       # developers (core/device_path.py)
    simulate_device(True)

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


def active_watch():
    """The running Watch, or None."""
    return _ACTIVE


class Watch(PerOpCheck, Verdict, DeviceWindow, DeviceReads, ModuleTier, BackwardTier,
            OptimizerTier, CompiledBoundary, GraphReplays, WrittenMarks):
    """A running numerics watch. Use as a context manager or call `close()`.

    `enabled` is True while it checks ops (started, not suspended, not in a worker
    process). `suspended()` switches checks off for a block (the debugger prompt).
    `violations` lists what was reported; `seen` counts non-finite outputs judged.
    """

    def __init__(self, on_violation=None, break_on=("nan", "inf"), allow=(), action="break",
                 exact=False):
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
        self._in_compiled = 0       # a compiled function runs (compiled.py): not held
        self._ledger = StepLedger() # device tensors waiting for their read (step_ledger.py)
        self._step_grads: dict = {} # id(param) -> (counts, judged, from a stop) of its
                                    # non-finite gradient at the last step (on a device)
        self._bwd_queued = False
        self._opt_depth = 0
        self._optimizer = None
        self._steps = 0
        self._opt_seen = False
        self._opt_stop_step = None  # optimizer step of the last optimizer-stage stop
        self._taint: dict = {}      # storage ptr -> (weakref, version, has_nan, has_inf)
        self._marks: dict = {}      # storage ptr -> (weakref, version, Mark): of those, the
                                    # values written on purpose or flowing from one (marks.py)
        self._nan_marks: dict = {}  # storage ptr -> weakref: of those, the ones with a NaN
        self._flowed_mark = None    # the Mark of the last value judged to flow from one
        self._compile_warned = False
        self._amp = LossScaling()   # GradScaler's scaled losses (amp.py)
        self._late = None           # (frame, text) while read before an exception

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
            # (the classes that held Watch's methods before they were split up; the
            # tiers' were not marked then either)
            _skip_dynamo((_Mode, Watch, PerOpCheck, Verdict, DeviceWindow))
            _DYNAMO_MARKED = True
        silence_global_hook_warning()
        _compiled.install(active_watch)     # what torch.compile returns for a function
        _data_origin.install()              # which dataset indices each batch holds
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
            self._graphs_start()            # a CUDA graph's outputs, after its replays
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
            self._graphs_close()
            _compiled.uninstall()
            _data_origin.uninstall()
            self._amp.stop()
            self._close_mode()
            self._t = TierState()
            self._open = self._t.open
            self._pending = []
            self._win = []
            self._ledger = StepLedger()
            self._step_grads = {}
            self._stash = []
            self._top = None
            self._opt_depth = 0
            if _ACTIVE is self:
                _ACTIVE = None
            _quiet.watch_closed(self)

    @property
    def pending(self) -> bool:
        """Whether `flush()` has anything to judge on this thread."""
        return (self._started and _get_ident() == self._owner
                and bool(self._win or self._ledger or self._stash))

    def flush(self) -> None:
        """Judge now what is still pending: the device window, and stops found on
        autograd's device threads (they pause on this thread). The CLI calls it when the
        program ends; `close()` does too."""
        if not self._started or _get_ident() != self._owner:
            return
        if self._win:
            self._flush_window()
        if self._ledger:
            self._read_ledger()
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
        if isinstance(exc, Exception) and self.pending:
            # a NaN/Inf still held (read late, on a device) before the exception it
            # led to: its stop first (before_exception.py)
            from .before_exception import read_before_exception
            try:
                read_before_exception(exc, self)
            finally:
                self.close(_flush=False)
            return
        self.close(_flush=exc_type is None)

    @property
    def enabled(self) -> bool:
        return self._started and not self._skip

    @property
    def started(self) -> bool:
        return self._started

    def set_break_on(self, break_on) -> None:
        """Change what stops the program while the watch runs (`breakon` at the prompt)."""
        self.break_on = parse_break_on(break_on)

    def suspended(self):
        """Context manager: no checks inside (the debugger prompt evaluating user code)."""
        return _Suspended(self)

    def _own_ops(self):
        """mldebug's own ops (counts, summaries) off the exact mode and unwatched."""
        stack = _tiers.contextlib.ExitStack()
        stack.enter_context(self.suspended())
        stack.enter_context(_tiers.mode_off(self._mode))
        return stack

    def _update_skip(self):
        self._skip = (not self._started) or self._suspend > 0 or _IN_CHILD or (
            self._pid is not None and os.getpid() != self._pid)

    # -- hooks -----------------------------------------------------------------------
    def _module_pre(self, module, args):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or self._skip \
                or _get_ident() != self._owner:
            return None
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            self._captured_call_begins()
            return None
        if self._stash:
            self._deliver_stash()
        top = self._top
        t = self._t
        if top is None and not t.replaying and _in_autograd_backward():
            # a module's forward inside backward: a checkpoint recomputing what the
            # forward computed (and judged) already
            t.recomputing.append(module)
        elif top is None and t.recomputing:
            t.recomputing.clear()   # a forward again: no recomputation is open (one that
                                    # raised a BaseException never ran its post hook)
        if top is None:
            self._names.roots.add(module)
            if self._nan_marks and not (t.replaying or t.recomputing or self._opt_depth):
                # a NaN written on purpose must not reach a model call (marks.py)
                self._check_call_marks(module, args)
            if not self._compile_warned and type(module).__name__ == "OptimizedModule":
                self._compile_note(module)
            # (a recomputation after a stop runs op by op: what it makes again is marked
            # as the stop's, so its backward is no new stop)
            if not (self.exact or t.popped or t.replaying or t.in_backward or self._opt_depth
                    or (t.recomputing and self.violations)):
                # an outermost call: exact mode off inside, sentinels on (tiers.py)
                t.start_rng = _tiers.rng_state()
                t.flag = None
                t.done = False
                t.last_out = None
                t.shown = {}
                t.shown_ok = _safe.grads_local()
                t.popped = _tiers.pop_if_top(self._mode)
                if t.popped:
                    if self._ledger._held:
                        self._reduce_arguments(args)
                    self._top = (module, None, t.start_rng, _plan(module), 0)
                    return None
        elif t.popped and not t.replaying:
            plan = top[3] if len(top) > 3 else None
            code = plan.get(id(module), 0) if plan else 0
            if not code & _safe.NO_GRAD_CHECK and t.shown_ok \
                    and _safe.params_show_grad(module):
                # its output's gradient is checked in its parameters' gradients
                code |= _safe.PARAMS_SHOW_GRAD
                t.shown[id(module)] = module   # (once, however often it is called)
            # the RNG as this call starts: a replay of just this call draws the same
            # (one whose output its Sequential leaves to the next child is never replayed
            # alone: its flag is the next child's, which defers to the Sequential)
            rng = None if code & _safe.NO_FORWARD_CHECK else _tiers.rng_state()
            self._top = (module, top, rng, _plan(module), code)
            return None
        self._top = (module, top)
        return None

    def _reduce_arguments(self, args):
        """An outermost call begins with the per-op check off: it may write an argument
        in place (`nn.ReLU(inplace=True)` turns -inf into 0) unseen. A temporary the
        ledger holds in an argument's memory (the device window's output, read later) is
        reduced first (queued, no sync), so its check sees what the op that made it
        made."""
        kwargs = _tiers.call_kwargs(_caller(1))
        self._ledger.reduce_before_write(memory_addresses(_tiers.flat_tensors((args, kwargs))))

    def _compile_note(self, module):
        self._compile_warned = True
        inner = type(getattr(module, "_orig_mod", module)).__name__
        _frames.warn_at_user_line(
            f"mldebug: {inner} runs under torch.compile: the watch checks its outputs and "
            "gradients at the compiled boundary, and pins a NaN/Inf inside by re-running the "
            "call")

    def _module_post(self, module, args, output):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or self._skip \
                or _get_ident() != self._owner:
            return None
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            self._captured_call_ends(module, output)   # (checked after each replay)
            return None
        top = self._top
        t = self._t
        if t.recomputing and t.recomputing[-1] is module:
            t.recomputing.pop()
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


def watch_session(session) -> Watch:
    """The watch a session describes (its break-on kinds, exemptions and exact setting),
    its stops going to the session: what the CLI, `watch on` and the framework callbacks
    start."""
    return watch(on_violation=session.on_violation, break_on=session.break_on,
                 allow=session.allow, exact=session.exact_watch)
