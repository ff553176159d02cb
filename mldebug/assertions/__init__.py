"""Assertions: properties of a training step that should hold, checked at its stages,
stopping the program in the user's frame when one fails.

    mldebug.assertions()                  # the registered ones (library included)
    mldebug.register_assertion(a)         # an instance of one of the kinds, or a class
    mldebug.deregister_assertion(a)       # instance, class or name
    with mldebug.scan(): train_step()     # one step: graph + assertions
    r = mldebug.assertions.run()          # always-on, as the CLI runs them; r.close()

Kinds (`mldebug.assertions.base`): TensorAssertion, ParamAssertion, TensorNodeAssertion,
FunctionAssertion, ModuleAssertion, FunctionNodeAssertion; each has `name`, `message`,
`hint`, `check_on` (stages) and `check(...) -> bool` (True = fine).
Stages: FORWARD (after the outermost module returned), BEFORE_BACKWARD, BACKWARD (after),
BEFORE_STEP (optimizer.step() called) and OPTIMIZER (after the step); a Stop's `stage`
is forward / backward / backward / optimizer / optimizer respectively.

The library: on by default (cheap, nearly free of false alarms)
    grad_not_zeroed        the optimizer steps on gradients accumulated on top of its
                           previous step's (forgotten zero_grad). Identity + version
                           counter of .grad, no copy; judged at step() per optimizer, so
                           a GAN's cross-model accumulation is not an alarm.
    loss_not_scalar        backward() on a non-scalar without a gradient argument
    loss_requires_no_grad  backward() on a tensor that does not require grad
                           (both raise in torch anyway: the stop comes first, at the
                           backward line, with a hint)
    exploding_gradients    a parameter's gradient norm > 1000x the median of its own last
                           20 steps (after 3): relative to itself, so model size and AMP
                           loss scaling do not trip it. One norm per parameter per step.
    param_no_grad          a parameter the optimizer steps on had no .grad 3 steps in a
                           row (unused layer, detach, no_grad). Alternating heads that get
                           a gradient every other step do not trip it.
    dead_relu              >= 50% of an nn.ReLU's units (>= 8) never positive over a batch;
                           one amax per check, on the 1st and every 10th call of each node.
    nan, inf               listed here, found by the NaN/Inf watch (`--break-on nan,inf`)
The library: opt-in (`assertions on NAME`, or `.enabled = True`), and why
    vanishing_gradients    weights ahead of a normalisation legitimately get ~0 gradient
    param_not_updated      with several optimizers (GANs) each step leaves the other
                           model's parameters alone by design
    update_ratio           copies every weight before each step (memory); warmup/decay
                           legitimately move the ratio away from ~1e-3
    saturated_activation   a trained classifier's output sigmoid is saturated by design
    activation_scale       one reduction per layer output; pre-norm residual streams
                           legitimately grow layer after layer

Each (assertion, target) stops once per run; later trips are in the runner's
`violations`. `assertions` at the prompt lists them and this step's violations.
"""
from __future__ import annotations

from ..core.callable_module import make_callable
from .base import (BACKWARD, BEFORE_BACKWARD, BEFORE_STEP, FORWARD, OPTIMIZER, STAGES,  # noqa: F401
                   STOP_STAGE, Assertion, FunctionAssertion, FunctionNodeAssertion,
                   ModuleAssertion, ParamAssertion, TensorAssertion, TensorNodeAssertion)
from .registry import (assertions as _list, deregister_assertion, get,  # noqa: F401
                       register_assertion, set_enabled)

__all__ = ["register_assertion", "deregister_assertion", "assertions", "run", "Runner",
           "TensorAssertion", "ParamAssertion", "TensorNodeAssertion", "FunctionAssertion",
           "ModuleAssertion", "FunctionNodeAssertion", "Assertion", "STAGES", "FORWARD",
           "BEFORE_BACKWARD", "BACKWARD", "BEFORE_STEP", "OPTIMIZER", "get", "set_enabled"]


def run(on_violation=None):
    """Run the assertions always-on (as the CLI does); returns the Runner (close() it)."""
    # the runner (torch hooks, the graph capture) loads when assertions run, not when a
    # program only registers one
    from .scan import run as _run
    return _run(on_violation)


def __getattr__(name):
    # (lazy for the same reason as run())
    if name in ("Runner", "active_runner"):
        from . import runner
        return getattr(runner, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# `mldebug.assertions` is both this package and the function listing the registered
# assertions (as `mldebug.watch`), in any import order
assertions = make_callable(__name__, _list)
