"""The watch: its design, its state, its lifecycle.

Design: check at the roots, re-run to pin (JAX's `jax_debug_nans`: run the computation
as it is, check its outputs cheaply, and only when one is non-finite run it again op by op
to find the op).

- Two ways to watch. The *full watch* checks every floating output of every aten op (the
  per-op check: a TorchDispatchMode, dispatch.py) and names every module call (global
  module hooks keep a stack of them): it stops at the op, in its module, at its line.
  The *cheap check* looks only at the *roots* (the outermost module calls: the model, a
  loss module), at backward and at the optimizer step, with a few multi-tensor ops and,
  on a device, one host read a step (step.py). Every module below a root runs on
  torch's fast call path, with nothing of mldebug's.
- Where no root runs (data handling, the loss written in the training loop) the per-op
  check stays on: there is no call to re-run there.
- One healthy-step path (step.py, then update.py, top to bottom): a root's pre-hook
  records the call (roots.RootCall: arguments as passed, RNG, autocast, buffers at the
  start) and takes the per-op check off the stack; its post-hook puts it back, checks the outputs and keeps
  their gradients (a pre-hook on each output's autograd node). `loss.backward()` runs
  the loss region op by op when it can make a NaN/Inf, the rest without the mode, then
  checks the outputs' and the parameters' gradients. `optimizer.step()` reads once
  before the update (on a device) and checks the parameters and the optimizer's state
  after it (on a device, with the next step's read: one step late).
- One re-run path (rerun.py): a check that finds a NaN/Inf re-runs the root call (and
  its backward, for a gradient) under the full watch, from its record, as it started;
  the stop is the full watch's. When the re-run does not make the value again, the stop
  says so and names what the check saw.
- The full watch runs on its own for `exact=True` (a sync per op on a device) and while
  the roots are learned (roots.py: from the start to the first optimizer step, or to a
  root's second call, the global hooks see every call; only a compiled root takes the
  cheap path from its first call: the full watch cannot look inside compiled code).
- Checks on the CPU read memory in place (native_check.py: no op, no read); on a device
  they are held by the ledger (step_ledger.py) and read once: at `optimizer.step()` in
  training, at a call's end otherwise. The ops outside the roots wait in the device
  window (device_window.py) for the same read.
- The stop rule (verdict.py) is the same for all: what an op makes from finite inputs,
  or what first comes in from outside; values that flow on from a judged one are not
  new stops (the taint, by storage); NaN/Inf written on purpose stop only where they
  reach a model call, the loss, a gradient or a parameter (marks.py).

State: every attribute of `Watch` is set in `__init__`, with what it is for. The class
is split by job into mixins, one module each: PerOpCheck (dispatch.py), Verdict
(verdict.py), Taint (taint.py: what was judged already), DeviceWindow
(device_window.py), DeviceReads (step_ledger.py), Roots
(roots.py), HealthyStep (step.py), OptimizerStep (update.py), Rerun (rerun.py),
CompiledBoundary (compiled.py), GraphReplays (graph_replays.py), WrittenMarks (marks.py:
NaN/Inf the program writes on purpose, and where they must not go). This module: the
lifecycle and the global hooks.
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

from ..core import autograd_patch as _autograd_patch
from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core import jit_trace as _jit_trace
from ..core import quiet as _quiet
from ..core.break_on import parse_break_on
from ..core.compile import FLAG as _FLAG
from ..core.compile import dynamo_compiling as _dynamo_compiling
from ..core.compile import silence_global_hook_warning
from ..core.device_path import simulated_by_env
from ..core.errors import UsageError
from . import checks as _checks
from . import compiled as _compiled
from . import data_origin as _data_origin
from . import dispatch as _dispatch
from .amp import LossScaling
from .checks import _ALLOWED, METADATA_KEY, _caller, _in_transform, pop_if_top, push
from .compiled import CompiledBoundary
from .context import ModuleNames
from .device_window import DeviceWindow
from .dispatch import _OP_INFOS, PerOpCheck, _Mode, _skip_dynamo
from .graph_replays import GraphReplays
from .marks import WrittenMarks
from .rerun import Rerun
from .roots import Roots, _RootHook, call_kwargs
from .step import HealthyStep
from .update import OptimizerStep
from .step_ledger import DeviceReads, StepLedger, cuda_graph_aside
from .taint import Taint
from .verdict import Verdict

_get_ident = threading.get_ident
_graph_task_id = torch._C._current_graph_task_id

_ACTIVE = None             # the running Watch
_DYNAMO_MARKED = False     # code objects marked for dynamo to skip
_IN_CHILD = False          # set in forked children (DataLoader workers): do nothing


def simulate_device(on: bool) -> None:
    """Tests: treat CPU tensors as a device's (held, read once per step, re-runs read op
    by op), so that a machine without a GPU runs the device paths."""
    _dispatch._HOST_READS = _checks.HOST_READS = not on


if simulated_by_env():       # developers (core/device_path.py)
    simulate_device(True)


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


class Watch(PerOpCheck, Verdict, Taint, DeviceWindow, DeviceReads, Roots, HealthyStep,
            OptimizerStep, Rerun, CompiledBoundary, GraphReplays, WrittenMarks):
    """A running numerics watch. Use as a context manager or call `close()`.

    `enabled` is True while it checks ops (started, not suspended, not in a worker
    process). `suspended()` switches checks off for a block (the debugger prompt).
    `violations` lists what was reported.
    """

    def __init__(self, on_violation=None, break_on=("nan", "inf"), allow=(), action="break",
                 exact=False):
        if action not in ("break", "raise"):
            raise UsageError(f"action must be 'break' or 'raise', action={action!r}")
        if not isinstance(exact, bool):
            raise UsageError(f"exact must be True or False, exact={exact!r}")
        # -- what it stops on, and how
        self.exact = exact          # the full watch everywhere: no roots, no re-runs
        self.break_on = parse_break_on(break_on)
        self.allow = tuple([allow] if isinstance(allow, str) else allow)
        self.action = action
        self.on_violation = on_violation
        self.violations: list = []  # what was reported
        # -- lifecycle
        self._started = False
        self._skip = True           # read on every op: closed, suspended or in a child
        self._suspend = 0
        self._owner = None          # the thread that started it
        self._mode = None           # the per-op check (dispatch._Mode)
        self._handles: list = []    # optimizer hooks
        self._module_handles: list = []   # global module hooks, while installed
                                          # (learning, re-runs, exact, compiled roots)
        self._root_hooks: list = []       # the roots' own hooks
        # -- the per-op check (dispatch.py, device_window.py)
        self._infos = _OP_INFOS     # shared: an OpInfo depends on the overload only
        self._pending: list = []    # forward outputs waiting for their grad_fn
        self._win: list = []        # device window entries
        self._win_returned: list = []   # (its first entry, entries before its return,
                                        # slots): what a backward formula with entries
                                        # in the window returned
        self._formula_node = None   # the last such formula
        self._stash: list = []      # violations found off the owner thread
        self._in_compiled = 0       # a compiled function runs (compiled.py): not held
        self._compiled_seen = False  # ... ran since the start (compiled with our hooks)
        self._bwd_queued = False    # a callback at the end of the running backward
        # -- the verdicts (verdict.py)
        self._taint: dict = {}      # storage ptr -> (weakref, version, has_nan, has_inf,
                                    # lineage) of non-finite values judged
        self._judged = 0            # non-finite outputs judged by the per-op check
        self._opt_stop_step = None  # optimizer step of the last optimizer-stage stop
        self._stop_step = None      # step of the last stop
        self._fruitless: dict = {}  # (root, nan?, inf?) -> (lineage, Mark or None): its
                                    # re-run found no stop
        self._judged_grads: dict = {}   # id(param) -> param whose non-finite gradient was
                                        # judged (until it is reset)
        self._amp = LossScaling()   # GradScaler's scaled losses (amp.py)
        self._marks: dict = {}      # storage ptr -> (weakref, version, Mark): of those, the
                                    # values written on purpose or flowing from one (marks.py)
        self._nan_marks: dict = {}  # storage ptr -> weakref: of those, the ones with a NaN
        self._made_marks = False    # an op's Inf/NaN was judged a value made on purpose
                                    # (ops.py LOG_AT_ZERO, NAN_FROM_INFS): the outermost
                                    # calls' outputs look for it
        self._flowed_mark = None    # the Mark of the last value judged to flow from one
        self._late = None           # (frame, text) while read before an exception
        self._in_formula: list = []  # (node, output, violation): a NaN/Inf made inside
                                     # one of torch's backward formulas, judged once the
                                     # formula returned (verdict.py)
        self._formula_returned: dict = {}   # id(node) -> whether what it returned is finite
        self._constant_unread = False   # a device's op wrote a NaN/Inf constant (or one
                                        # flowing from it) that no read has judged yet
        # -- where an op runs
        self._top = None            # full watch: module stack, (module, parent record)
        self._names = ModuleNames()
        self._recomputing: list = []   # full watch: modules whose forward runs again
                                       # inside backward (torch.utils.checkpoint)
        self._inside = 0            # depth inside a root call (the per-op check is off)
        self._root_popped = False   # ... and it was on the stack as the call began
        self._call = None           # the running root call (step.RootCall)
        self._in_backward = 0       # a checked backward runs (the per-op check is off)
        self._opt_depth = 0         # inside optimizer.step()
        self._opt_popped = False    # ... without the per-op check
        self._optimizer = None
        self._rerunning = 0         # a re-run runs (the full watch)
        self._read_now = 0          # a re-run or dry run: device outputs read op by op
        self._rerun = None          # (where it started, the call's line, micro-batch)
        self._rerun_lineage = False  # the last re-run's outputs descend from a stop
        self._rerun_mark = None     # ... or from a constant written on purpose (marks.py)
        self._compile_warned = False
        # -- the roots (step.py)
        self._learning = not exact  # the full watch runs and learns the roots (roots.py)
        self._learning_root = None  # the root whose call runs while learning
        self._learned = False       # ... a root was called a second time
        self._roots: dict = {}      # id(module) -> roots.RootInfo
        # -- the training step
        self._calls: list = []      # root calls with a gradient, waiting for backward
        self._micro = 0             # backwards since the last optimizer step
        self._accumulating = False  # ... more than one before a step (a stop names it)
        self._steps = 0             # optimizer steps taken
        self._opt_seen = False
        self._step_grads: dict = {}  # id(param) -> update.GradRead of its non-finite
                                     # gradient read before the last step (a device)
        self._step_tensors = weakref.WeakKeyDictionary()   # optimizer -> the tensors
                                     # its step writes (update.StepTensors)
        self._bad_state: dict = {}   # (id(param), state key) -> (step, from a stop): the
                                     # optimizer's state that a step left non-finite
        self._ledger = StepLedger()  # device tensors waiting for their read

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "Watch":
        global _ACTIVE, _DYNAMO_MARKED
        if self._started:
            return self
        if _ACTIVE is not None and _ACTIVE is not self:
            raise UsageError("a watch is already running; close it before starting another")
        self._owner = _get_ident()
        self._learning, self._learned = not self.exact, False
        if not _DYNAMO_MARKED:
            _skip_dynamo((_Mode, Watch, PerOpCheck, Verdict, DeviceWindow, Roots, HealthyStep,
                          OptimizerStep, _RootHook))
            _DYNAMO_MARKED = True
        silence_global_hook_warning()
        _compiled.install(active_watch)     # what torch.compile returns for a function
        _data_origin.install()              # which dataset indices each batch holds
        self._mode = _Mode(self)
        self._mode.__enter__()
        try:
            self._install_module_hooks()    # the full watch (exact) or learning the roots
            self._handles = [
                _optim_hooks.register_optimizer_step_pre_hook(self._optimizer_pre),
                _optim_hooks.register_optimizer_step_post_hook(self._optimizer_post),
            ]
            # (exact mode too: stops found on autograd's device threads pause after it)
            _autograd_patch.add(self._around_backward)
            _jit_trace.add(self)            # (torch.jit.trace runs with the watch suspended)
            self._amp.start()
            self._graphs_start()            # a CUDA graph's outputs, after its replays
        except BaseException:
            self._remove_module_hooks()
            self._close_mode()
            raise
        self._started = True
        _ACTIVE = self
        _quiet.watch_started(self)     # mldebug's own work can suspend it (core/quiet.py)
        self._update_skip()
        return self

    def _install_module_hooks(self) -> None:
        try:
            post = _module_hooks.register_module_forward_hook(self._module_post,
                                                              always_call=True)
        except TypeError:  # torch without always_call
            post = _module_hooks.register_module_forward_hook(self._module_post)
        self._module_handles = [
            _module_hooks.register_module_forward_pre_hook(self._module_pre), post]

    def _remove_module_hooks(self) -> None:
        for handle in self._module_handles:
            handle.remove()
        self._module_handles = []

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
            for handle in self._handles + self._root_hooks:
                handle.remove()
            self._handles, self._root_hooks = [], []
            self._remove_module_hooks()
            _autograd_patch.remove(self._around_backward)
            _jit_trace.remove(self)
            self._graphs_close()
            _compiled.uninstall()
            _data_origin.uninstall()
            self._amp.stop()
            self._close_mode()
            self._pending, self._win, self._stash, self._calls = [], [], [], []
            self._ledger = StepLedger()
            self._step_grads, self._roots = {}, {}
            self._step_tensors, self._bad_state = weakref.WeakKeyDictionary(), {}
            self._top = self._call = None
            self._inside = self._opt_depth = 0
            if _ACTIVE is self:
                _ACTIVE = None
            _quiet.watch_closed(self)

    @property
    def pending(self) -> bool:
        """Whether `flush()` has anything to judge on this thread."""
        return (self._started and _get_ident() == self._owner
                and bool(self._win or self._ledger or self._stash))

    def flush(self) -> None:
        """Judge now what is still pending: the device window and the ledger, and stops
        found on autograd's device threads (they pause on this thread). The CLI calls it
        when the program ends; `close()` does too."""
        if not self._started or _get_ident() != self._owner:
            return
        if self._win or self._ledger:
            self._read_ledger()         # (the window's judge goes in first)
        if self._stash:
            self._deliver_stash()

    def _close_mode(self):
        mode, self._mode = self._mode, None
        if mode is None:
            return
        if self._root_popped or self._opt_popped:   # off the stack already (closed inside
            self._root_popped = self._opt_popped = False   # a root call or the step)
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
        """mldebug's own ops (counts, summaries) off the per-op check and unwatched."""
        return _OwnOps(self)

    def _update_skip(self):
        self._skip = (not self._started) or self._suspend > 0 or _IN_CHILD

    # -- the global module hooks: the full watch's module stack, learning the roots --
    def _module_pre(self, module, args):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or self._skip \
                or _get_ident() != self._owner or _in_transform():
            return None
        if self._inside or not (self.exact or self._learning or self._rerunning):
            # a root's call runs, or a compiled root kept these hooks: the cheap path
            return self._root_pre(module, args, call_kwargs(_caller(1)))
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            self._captured_call_begins()
            return None
        if self._stash:
            self._deliver_stash()
        top = self._top
        if top is None:
            if not self._rerunning and _graph_task_id() != -1:
                # a module's forward inside backward: a checkpoint recomputing what the
                # forward computed (and judged) already
                self._recomputing.append(module)
            elif self._recomputing:
                self._recomputing.clear()   # a forward again: no recomputation is open
            self._names.roots.add(module)
            if (self._nan_marks or self._constant_unread) and not (
                    self._rerunning or self._recomputing or self._opt_depth):
                # a NaN written on purpose must not reach a model call (marks.py); one
                # written on a device is judged by a read (the full watch reads op by
                # op anyway)
                if self._constant_unread:
                    self._read_ledger()
                self._check_call_marks(module, args)
            if not self._compile_warned and type(module).__name__ == "OptimizedModule":
                self._compile_note(module)
        if self._learning and not self._rerunning and not self._recomputing:
            info = self._learn_pre(module, args, top, _caller(1))
            if info is not None and info.compiled:
                # (the full watch cannot look inside compiled code: a compiled root
                # takes the cheap path from its first call, and a re-run pins the op)
                return self._root_pre(module, args, call_kwargs(_caller(1)))
        self._top = (module, top)
        return None

    def _module_post(self, module, args, output):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or self._skip \
                or _get_ident() != self._owner or _in_transform():
            return None
        if self._inside or not (self.exact or self._learning or self._rerunning):
            return self._root_post(module, args, None, output)
        if _cuda_graphs.MAYBE[0] and cuda_graph_aside():
            self._captured_call_ends(module, output)   # (checked after each replay)
            return None
        if self._recomputing and self._recomputing[-1] is module:
            self._recomputing.pop()
        top = self._top
        if top is not None and top[0] is module:
            self._top = top[1]
        else:  # unbalanced (a hook-less exit): unwind to the module if it is on the stack
            record = top
            while record is not None and record[0] is not module:
                record = record[1]
            if record is not None:
                self._top = record[1]
        if self._top is None and self._made_marks:
            self._check_output_marks(module, output)
        if self._learning and not self._rerunning:
            self._learn_post(module, args, _caller(1))
            if self._top is None and self._learned:
                self._end_learning()     # (a root's second call: the roots are known)
        if self._top is None and self._win and not self._rerunning:
            self._flush_window()
        return None

    def _compile_note(self, module):
        self._compile_warned = True
        inner = type(getattr(module, "_orig_mod", module)).__name__
        _frames.warn_at_user_line(
            f"mldebug: {inner} runs under torch.compile: the watch checks its outputs and "
            "gradients at the compiled boundary, and pins a NaN/Inf inside by re-running the "
            "call")

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


class _OwnOps:
    """`Watch._own_ops()`: suspended, and the mode off the stack (one object, not an
    ExitStack of two: the step's read enters it on every training step)."""

    __slots__ = ("watch", "popped")

    def __init__(self, watch):
        self.watch = watch

    def __enter__(self):
        watch = self.watch
        watch._suspend += 1
        watch._update_skip()
        self.popped = pop_if_top(watch._mode)
        return watch

    def __exit__(self, *exc):
        watch = self.watch
        if self.popped:
            push(watch._mode)
        watch._suspend -= 1
        watch._update_skip()


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

    exact=False (default): the roots (outermost module calls), backward and the
    optimizer step are checked cheaply, the ops outside them one by one, and a NaN/Inf
    is pinned by re-running its call under the per-op check (see this module's
    docstring). exact=True: the per-op check everywhere, no re-runs."""
    return Watch(on_violation=on_violation, break_on=break_on, allow=allow,
                 action=action, exact=exact).start()


def watch_session(session) -> Watch:
    """The watch a session describes (its break-on kinds, exemptions and exact setting),
    its stops going to the session: what the CLI, `watch on` and the framework callbacks
    start."""
    return watch(on_violation=session.on_violation, break_on=session.break_on,
                 allow=session.allow, exact=session.exact_watch)
