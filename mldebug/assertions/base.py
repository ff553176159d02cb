"""The kinds of assertion and the stages they run at.

Every assertion has a `name`, a `message` (what is wrong; a check may rewrite it with the
numbers it found), a `hint` (what to do), `check_on` (the stages it runs at) and a
`check(...) -> bool` that returns True when all is well. `enabled` says whether it runs.
The arguments of `check` depend on the kind:

    TensorAssertion.check(tensor, grad)            the tensor `backward()` is called on
                                                   (before/after backward; grad = the
                                                   gradient argument) and the outputs of
                                                   outermost modules (forward, grad None)
    ParamAssertion.check(name, param, grad)        every parameter of the models and
                                                   optimizers seen
    TensorNodeAssertion.check(node_id, tensor, grad)
                                                   every module output (node ids stable
                                                   across steps: 'h.0.attn#0'); grad =
                                                   the gradient reaching it (backward)
    FunctionAssertion.check(output, inputs, grads) calls of `targets`: module instances,
                                                   module classes, torch functions
                                                   (torch.softmax, F.relu, Tensor.exp) or
                                                   the user's Python functions (called
                                                   through their module's global name)
    ModuleAssertion.check(module, output, inputs, grads)
    FunctionNodeAssertion.check(node_id, output, inputs, grads)

`grads` maps 'output' and 'input N' to the gradients reaching the call's output and its
tensor inputs; it is filled only at the BACKWARD stage ({} at FORWARD).
"""
from __future__ import annotations

import fnmatch
from typing import Any, Iterable

# -- stages -----------------------------------------------------------------------------
FORWARD = "forward"                  # after an outermost module's forward returned
BEFORE_BACKWARD = "before_backward"  # backward() called, before it runs
BACKWARD = "backward"                # backward() returned
BEFORE_STEP = "before_step"          # optimizer.step() called, before the update
OPTIMIZER = "optimizer"              # optimizer.step() returned
STAGES = (FORWARD, BEFORE_BACKWARD, BACKWARD, BEFORE_STEP, OPTIMIZER)

# the `stage` field of a Stop (forward / backward / optimizer / other)
STOP_STAGE = {FORWARD: "forward", BEFORE_BACKWARD: "backward", BACKWARD: "backward",
              BEFORE_STEP: "optimizer", OPTIMIZER: "optimizer"}


def _stages(value) -> tuple:
    stages = (value,) if isinstance(value, str) else tuple(value)
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"unknown stage {bad[0]!r}; choose from {', '.join(STAGES)}")
    return stages


VERSION = [0]     # bumped when any assertion is switched on or off (runners cache lists)


class Assertion:
    """Base of every kind. Subclass one of the kinds below, not this."""

    name: str = ""
    message: str = ""
    hint: str = ""
    check_on: tuple = ()
    default_enabled: bool = True     # class-level default; `enabled` is per instance
    kind: str = "assertion"
    delegate: str = ""               # 'watch': listed here, checked by the NaN watch

    def __init__(self, name: str | None = None, message: str | None = None,
                 hint: str | None = None, check_on=None, enabled: bool | None = None):
        if name is not None:
            self.name = name
        if not self.name:
            self.name = type(self).__name__
        if message is not None:
            self.message = message
        if hint is not None:
            self.hint = hint
        self.check_on = _stages(check_on if check_on is not None else type(self).check_on)
        self._enabled = type(self).default_enabled if enabled is None else bool(enabled)
        VERSION[0] += 1
        self.stage = ""              # the stage being checked, set by the runner
        self.detail = ""             # set by check(): the numbers behind a failure

    @property
    def enabled(self) -> bool:
        return getattr(self, "_enabled", type(self).default_enabled)

    @enabled.setter
    def enabled(self, value) -> None:
        self._enabled = bool(value)
        VERSION[0] += 1

    def check(self, *args, **kwargs) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError(f"{type(self).__name__}.check")

    def text(self) -> str:
        """'message (detail) — hint', as the stop shows it."""
        text = self.message or f"{self.name} failed"
        if self.detail:
            text += f" ({self.detail})"
        if self.hint:
            text += f" — {self.hint}"
        return text

    def describe(self) -> str:
        stages = ",".join(self.check_on) or "every op"
        state = "on" if self.enabled else "off"
        extra = f", checked by the {self.delegate}" if self.delegate else ""
        return f"{self.name} [{self.kind}, {stages}, {state}{extra}]: {self.message}"

    def __repr__(self):
        return f"<{type(self).__name__} {self.name!r} {'on' if self.enabled else 'off'}>"


class TensorAssertion(Assertion):
    """A property of a tensor and its gradient (the loss, outputs of outermost modules)."""

    kind = "tensor"
    check_on = (BEFORE_BACKWARD,)

    def check(self, tensor, grad=None) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class ParamAssertion(Assertion):
    """A property of a parameter and its gradient; `params` (fnmatch patterns on the
    parameter's dotted name) limits which."""

    kind = "param"
    check_on = (BACKWARD,)
    params: tuple = ("*",)

    def applies(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, p) for p in self.params)

    def check(self, name, param, grad) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class TensorNodeAssertion(Assertion):
    """A property of one node's output (and its gradient) followed over steps by its
    stable id; `nodes` (fnmatch patterns on node ids) limits which."""

    kind = "tensor-node"
    check_on = (FORWARD,)
    nodes: tuple = ("*",)

    def applies(self, node_id: str) -> bool:
        return any(fnmatch.fnmatchcase(node_id, p) for p in self.nodes)

    def check(self, node_id, tensor, grad) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class FunctionAssertion(Assertion):
    """A property of every call of `targets` (module instances, module classes, torch
    functions): its output, inputs and (backward) the gradients reaching them."""

    kind = "function"
    check_on = (FORWARD,)
    targets: tuple = ()

    def __init__(self, targets: Iterable[Any] | Any = None, **kwargs):
        super().__init__(**kwargs)
        if targets is not None:
            self.targets = tuple(targets) if isinstance(targets, (list, tuple, set)) else (targets,)
        self.targets = tuple(self.targets)

    def matches_module(self, module) -> bool:
        for t in self.targets:
            if t is module or (isinstance(t, type) and isinstance(module, t)):
                return True
        return False

    def function_targets(self) -> tuple:
        import torch
        return tuple(t for t in self.targets
                     if not isinstance(t, torch.nn.Module)
                     and not (isinstance(t, type) and issubclass(t, torch.nn.Module)))

    def call_check(self, node_id, module, output, inputs, grads) -> bool:
        """How the runner calls this kind (subclasses take more arguments)."""
        return self.check(output, inputs, grads)

    def check(self, output, inputs, grads) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError


class ModuleAssertion(FunctionAssertion):
    """Like FunctionAssertion, and also gets the module instance."""

    kind = "module"

    def call_check(self, node_id, module, output, inputs, grads) -> bool:
        return self.check(module, output, inputs, grads)

    def check(self, module, output, inputs, grads) -> bool:  # pragma: no cover
        raise NotImplementedError


class FunctionNodeAssertion(FunctionAssertion):
    """Like FunctionAssertion, and also gets the stable node id of the call."""

    kind = "function-node"

    def call_check(self, node_id, module, output, inputs, grads) -> bool:
        return self.check(node_id, output, inputs, grads)

    def check(self, node_id, output, inputs, grads) -> bool:  # pragma: no cover
        raise NotImplementedError


KINDS = (TensorAssertion, ParamAssertion, TensorNodeAssertion, FunctionAssertion,
         ModuleAssertion, FunctionNodeAssertion)
