"""Break on the first NaN/Inf, in forward, backward and the optimizer step, at the root cause.

    w = mldebug.watch()                 # started; on_violation=None → the session pauses
    ...                                 # every aten op's floating outputs are checked
    w.close()                           # off means off: no mode, no hook, zero cost

    with mldebug.watch(action="raise"):  # scripts/tests: NonFiniteError from the op
        train()

API
    watch(on_violation=None, break_on=('nan', 'inf'), allow=(), action='break') -> Watch
    Watch: context manager, close() (idempotent), start(), enabled, suspended(),
           violations (list of Violation reported)
    allow(*patterns) -> handle with remove(): fnmatch on op names ('aten.log.default',
           'log', 'aten.softmax*') or module paths ('encoder.*'); also `allow=` of watch()
    active_watch() -> the running Watch or None

The stop rule
    A NaN is always a stop: created by an op from inputs that hold no NaN, or first seen
    coming in from outside the watched ops (corrupt data, a checkpoint, `torch.from_numpy`)
    — a rule that only stops on NaN created from finite inputs never stops on bad data.
    An Inf is a stop only when the op CREATES it from finite inputs AND finite scalar
    arguments (overflow in exp/matmul, log(0), division by zero, an infinite derivative,
    fp16 overflow). An Inf written deliberately as a constant (`masked_fill(..., -inf)`,
    `full`, `fill_`, `torch.where` with an inf scalar, any op with an inf scalar argument)
    or merely flowing on from an input (scores + (-inf) mask) is not a stop. Neither is
    log(0) = -inf inside a model where no gradient flows (T5's relative-position
    buckets): judged as a constant written (below), a stop where it reaches the model's
    output, the loss, a gradient or a parameter (ops.LOG_AT_ZERO); nor CTCLoss's +inf
    under zero_infinity=True, which torch zeroes.
    A NaN or Inf the program writes on purpose (`x[mask] = nan`, `fill_`, `masked_fill`,
    `full`, `index_fill`, `torch.where(c, x, nan)`, a `torch.tensor([...])` literal) is
    not a stop where it is written nor where it flows on; it is a stop where it first
    reaches a model call (a NaN among an outermost module call's arguments), the loss,
    a gradient or a parameter, pointing at the line that wrote it (marks.py). A NaN
    read from a file, made from numpy or by a DataLoader came in with the data: above.
    With 'inf-all' in break_on every Inf is a stop: created, written as a constant or
    coming in from outside (but, like NaN, not when it merely flows on from an Inf
    already judged).
    After a stop, values that merely propagate from an already judged non-finite tensor
    are not new stops (every non-finite tensor judged is remembered by storage and
    version counter); a NEW creation (an op whose inputs hold no NaN → NaN, or finite
    inputs → Inf) always stops. So after `continue` the next stop is the next real root
    cause, not the 500 ops downstream of the first.

What is checked
    Every floating output of every aten op: forward (inside and outside modules),
    backward (the dispatch mode is carried into autograd), the optimizer step (foreach,
    fused and in-place updates: for an in-place op the written input's state before
    the op is taken from what the watch judged before — a non-finite value that no op
    made is seen, and remembered, at the first op that reads it). Not checked: integer,
    bool and complex outputs, view ops (`OpOverload.is_view`), ops that return
    uninitialized memory (empty, empty_like, empty_strided, new_empty, resize_).
    Not checked while no non-finite value has been judged yet (`ops.SAFE_*`): ops that
    cannot make a NaN or an Inf from finite inputs nor a NaN from Infs — copies and
    selections (clone, cat, relu, threshold_backward, max-pool, sort, ...), constants and
    clamps with finite scalars, widening casts, `x * s` with 0 < |s| <= 1, `x / s` with
    |s| >= 1, `x + s` with |s| <= 1 (an optimizer's `mul_(beta2)`, `add_(eps)`). A
    NaN/Inf passing through them is judged at the next checked op that reads it (as
    coming in from outside); once anything was judged they are checked like any op.
    Allowed ops and modules are still checked and remembered (their NaN flowing on is
    not reported downstream as "from outside"), they just never stop.

Where a stop points
    Forward/optimizer: `frame` is the innermost user frame (the op is still on the
    stack); file/line/function its location. Backward: the forward op that built the
    autograd node (`grad_fn.metadata['mldebug']`, attached at the next op after the
    forward op returned), while `frame` is the live user frame (the `loss.backward()`
    line). `torch_op` is derived from the aten name ('aten.log.default' → 'torch.log',
    'aten.add_.Tensor' → 'Tensor.add_'), not observed at the torch level; in backward it
    is the forward op's. `stage` is 'backward' when `torch._C._current_autograd_node()`
    is set, 'optimizer' between the global optimizer step pre/post hooks, otherwise
    'forward' (also for ops outside any module).

Devices
    CPU outputs are checked immediately, by a C bit test that reads the tensor's memory in
    place (watch/native_check.py: no torch op, no read); without a compiler by one `sum` +
    `.item()` per output (an exact isfinite count only when the sum is not finite).
    Tensors on other devices (CUDA) are held by the ledger (watch/step_ledger.py), without
    an op or a sync, and a read reduces them all with one `_foreach_norm` per dtype, one
    stack, one amax and ONE transfer. Until an optimizer step has been seen a read ends
    each window (the outermost module returns, backward ends, the optimizer steps, every
    WINDOW_MAX ops, close()); in training after that, once a step, at `optimizer.step()`
    (before the parameters change): the step's forward, loss, backward and the previous
    step's update in one read. A forward under no_grad, a loss scaler's backward, a second
    backward before the step (gradient accumulation) and a step's closure still read at
    their end. The stop names the first bad op of what was read, with its module and user
    line (a forward or backward op by re-running its call, as on the CPU), but the pause
    happens at the read (inside that re-run, or at the `optimizer.step()` line), and a
    re-run computes again from what the call kept: a call whose result depends on state
    changed between it and the read (other than buffers) is not pinned, and says so.
    Temporaries are held at most 64 tensors / 64 MiB at a time. Backward on CUDA runs on
    autograd's device thread: a 'break' stop found there is delivered on the thread that
    started the watch, at its next op or hook; 'raise' raises from backward().

Processes and threads
    In forked children (DataLoader workers) the watch does nothing; a NaN in a sample
    then stops at the first main-process op that reads it, as "came in from outside".
    The module stack follows the thread that started the watch; close() on that thread.
"""
from __future__ import annotations

from ..core.callable_module import make_callable
from . import core as _core
from . import before_exception as _before_exception
from .core import Allowed, Watch, active_watch, allow, watch_session  # noqa: F401
from .device_window import WINDOW_MAX  # noqa: F401

__all__ = ["watch", "allow", "Watch", "Allowed", "active_watch", "watch_session", "WINDOW_MAX",
           "read_before_exception"]


# `mldebug.watch` is both this package and the function that starts a watch:
# `mldebug.watch(...)`, `from mldebug.watch import watch` and `mldebug.watch.active_watch()`
# all work, in any import order (core/callable_module.py)
watch = make_callable(__name__, _core.watch)


def read_before_exception(exc: BaseException, watch=None) -> bool:
    """Before EXC is reported: judge what WATCH (the active watch) still holds; a stop
    found is the first stop, naming EXC as what it led to (watch/before_exception.py)."""
    return _before_exception.read_before_exception(
        exc, watch if watch is not None else active_watch())
