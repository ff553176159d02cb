"""The default library. Which ones are on by default, and why: see the package docstring.

Each check keeps what it needs across steps keyed by `id()` of the parameter (with a weak
reference, so a freed parameter's entry is never confused with a new one at the same
address). `self.stage` is set by the runner to the stage being checked.
"""
from __future__ import annotations

import math
import re
import statistics
import weakref

import torch
from torch import nn

from .base import (BACKWARD, BEFORE_BACKWARD, BEFORE_STEP, FORWARD, OPTIMIZER, Assertion,
                   ModuleAssertion, ParamAssertion, TensorAssertion, TensorNodeAssertion)


def _first_tensor(x):
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        for v in x.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


class _PerParam:
    """id(param) -> value, forgotten when the parameter dies."""

    def __init__(self):
        self._d = {}

    def get(self, p, default=None):
        rec = self._d.get(id(p))
        if rec is None or rec[0]() is not p:
            return default
        return rec[1]

    def set(self, p, value):
        try:
            self._d[id(p)] = (weakref.ref(p), value)
        except TypeError:
            return
        if len(self._d) > 100000:
            self._d = {k: r for k, r in self._d.items() if r[0]() is not None}


def _norm(t, cache=None) -> float:
    """‖t‖, from the runner's per-stage cache (one transfer for all gradients) if there."""
    if cache:
        value = cache.get(id(t))
        if value is not None:
            return value
    with torch.no_grad():
        return float(torch.linalg.vector_norm(t.detach(), dtype=torch.float32))


# -- on by default ---------------------------------------------------------------------
class GradNotZeroed(ParamAssertion):
    """The optimizer is about to step on gradients that were not zeroed since its last
    step: backward added this step's gradient to the last one (a forgotten `zero_grad`).

    Judged per optimizer at `step()`: a parameter is stale when, at the start of the last
    backward before this step, its `.grad` was still the very tensor (same object, same
    version counter) that its optimizer's previous step left behind, and held a value
    other than zero: a write the version counter does not see (`p.grad.data.zero_()`, an
    old idiom) leaves zeros, and adding to zeros is no accumulation. Those values are
    asked only of such gradients, all at once (one read) as the backward starts. Judging
    at the step and not at backward keeps GANs quiet: G's backward also accumulates into
    D's stale gradients, which is harmless because D zeroes them before D's own step."""

    name = "grad_not_zeroed"
    message = "gradients were not zeroed before backward: this step uses the sum of this and earlier steps' gradients"
    hint = "call optimizer.zero_grad() (or model.zero_grad()) before loss.backward() in every step"
    check_on = (OPTIMIZER, BEFORE_BACKWARD, BEFORE_STEP)

    def __init__(self, **kw):
        super().__init__(**kw)
        self._after_step = _PerParam()   # param -> (weakref(grad), version) after its step
        self._stale = _PerParam()        # param -> stale at the last backward start
        self._unchanged: list = []       # (param, grad) as its step left it: judged at finish

    def check(self, name, param, grad) -> bool:
        if self.stage == OPTIMIZER:
            if grad is not None:
                self._after_step.set(param, (weakref.ref(grad), grad._version))
            else:
                self._after_step.set(param, None)
            self._stale.set(param, False)
            return True
        if self.stage == BEFORE_BACKWARD:
            rec = self._after_step.get(param)
            unchanged = (rec is not None and grad is not None and rec[0]() is grad
                         and rec[1] == grad._version)
            self._stale.set(param, False)
            if unchanged:
                self._unchanged.append((param, grad))
            return True
        # BEFORE_STEP
        if grad is not None and self._stale.get(param, False):
            self.detail = f"{name}.grad accumulated on top of the previous step's gradient"
            return False
        return True

    def finish(self) -> bool:
        """As the backward starts: of the gradients left as their step left them, those
        that hold a value other than zero are stale (one reduction, one read)."""
        if self.stage != BEFORE_BACKWARD or not self._unchanged:
            return True
        unchanged, self._unchanged = self._unchanged, []
        with torch.no_grad():
            try:
                norms = torch.stack(torch._foreach_norm(
                    [g.detach() for _, g in unchanged], 1, dtype=torch.float32)).tolist()
            except (RuntimeError, TypeError):      # (several devices, an odd dtype)
                norms = [float(g.detach().abs().sum()) for _, g in unchanged]
        for (param, _), norm in zip(unchanged, norms):
            self._stale.set(param, norm != 0.0)
        return True


class LossNotScalar(TensorAssertion):
    name = "loss_not_scalar"
    message = "backward() was called on a tensor that is not a scalar"
    hint = "reduce the loss (.mean() or .sum(); check reduction= of the loss function)"
    check_on = (BEFORE_BACKWARD,)

    def check(self, tensor, grad=None) -> bool:
        if grad is None and tensor.numel() != 1:
            self.detail = f"shape {list(tensor.shape)}"
            return False
        return True


class LossNoGrad(TensorAssertion):
    name = "loss_requires_no_grad"
    message = "backward() was called on a tensor that does not require grad: no parameter will get a gradient"
    hint = ("the loss was computed under torch.no_grad()/inference_mode, from .detach()ed or "
            ".item()-rebuilt values, or the parameters have requires_grad=False")
    check_on = (BEFORE_BACKWARD,)

    def check(self, tensor, grad=None) -> bool:
        return bool(tensor.requires_grad)


class ExplodingGradients(ParamAssertion):
    """Per parameter: the gradient norm jumped `factor` times above the median of its own
    last `window` steps (after `warmup` steps of history), or above `max_norm` if set.
    History-relative, so loss scaling (AMP) and model size do not make false alarms."""

    name = "exploding_gradients"
    message = "a gradient norm jumped far above its own history"
    hint = "lower the learning rate, clip gradients (torch.nn.utils.clip_grad_norm_), check the loss scale and inputs"
    check_on = (BACKWARD,)
    wants_norms = True

    def __init__(self, factor=1e3, window=20, warmup=3, max_norm=None, **kw):
        super().__init__(**kw)
        self.factor, self.window, self.warmup, self.max_norm = factor, window, warmup, max_norm
        self._hist = _PerParam()

    def check(self, name, param, grad) -> bool:
        if grad is None or not grad.is_floating_point() or grad.layout != torch.strided:
            return True       # (a sparse gradient, nn.Embedding(sparse=True): no norm kernel)
        n = _norm(grad, getattr(self, "grad_norms", None))
        if not math.isfinite(n):
            return True       # NaN/Inf: the watch's business
        hist = self._hist.get(param)
        if hist is None:
            hist = []
            self._hist.set(param, hist)
        ok = True
        if self.max_norm is not None and n > self.max_norm:
            self.detail = f"‖grad {name}‖ = {n:.3g} > max_norm {self.max_norm:.3g}"
            ok = False
        else:
            # the steps it had a gradient at all: a gradient that is exactly 0 most steps
            # (a hinge loss, a WGAN critic's bias) says nothing of its usual size
            moving = [h for h in hist if h > 0]
            if len(moving) >= self.warmup:
                med = statistics.median(moving)
                if n > 1e-6 and n > self.factor * med:
                    self.detail = (f"‖grad {name}‖ = {n:.3g}, {n / med:.3g}x its median "
                                   f"{med:.3g} of the last {len(moving)} steps it was not 0")
                    ok = False
        hist.append(n)
        del hist[:-self.window]
        return ok


class NoGradient(ParamAssertion):
    """A parameter the optimizer steps on had no gradient (`.grad is None`) at `persist`
    consecutive steps from the start: it is not connected to the loss (unused layer, a
    `.detach()`, an accidental `torch.no_grad()`, a module built but never called); or
    at `persist_after` consecutive steps once it had one (a layer cut off later). A
    layer that is skipped at random (LayerDrop, stochastic depth: half the steps) or an
    expert that no token was routed to misses a few steps in a row now and then: the
    counts leave it room. Not judged: the parameters of a
    `DistributedDataParallel(..., find_unused_parameters=True)` model, which the program
    declared may get none (the runner skips them)."""

    name = "param_no_grad"
    message = "a parameter that the optimizer updates received no gradient"
    hint = "check that the layer is used in forward and not cut off by .detach()/no_grad; drop it from the optimizer or freeze it (requires_grad_(False)) if intended"
    check_on = (BEFORE_STEP,)
    skips_declared_unused = True

    def __init__(self, persist=10, persist_after=50, **kw):
        super().__init__(**kw)
        self.persist, self.persist_after = persist, persist_after
        self._missing = _PerParam()      # param -> (steps in a row without, had one)

    def check(self, name, param, grad) -> bool:
        if grad is not None or not param.requires_grad:
            self._missing.set(param, (0, grad is not None))
            return True
        n, had = self._missing.get(param, (0, False))
        n += 1
        self._missing.set(param, (n, had))
        if n == (self.persist_after if had else self.persist):
            self.detail = f"{name} had no .grad at {n} steps in a row"
            return False
        return True


class DeadReLU(ModuleAssertion):
    """Share of units (channels for conv activations, the last dimension otherwise) that
    are never positive over a whole batch. Checked while training (module.training and
    grad enabled) on the first call of each ReLU node and then every `every`-th (dead
    units are a lasting state; one reduction per check)."""

    name = "dead_relu"
    message = "most units of a ReLU are never active over the batch (dead ReLUs)"
    hint = "lower the learning rate, check the initialisation and biases, or use LeakyReLU/GELU"
    check_on = (FORWARD,)
    targets = (nn.ReLU,)

    def __init__(self, threshold=0.5, min_units=8, min_positions=16, every=10, **kw):
        super().__init__(**kw)
        self.threshold, self.min_units, self.min_positions = threshold, min_units, min_positions
        self.every = every
        self._calls = {}

    def call_check(self, node_id, module, output, inputs, grads) -> bool:
        if not module.training or not torch.is_grad_enabled():
            return True     # training only: inference on one small input is no evidence
        n = self._calls.get(node_id, 0)
        self._calls[node_id] = n + 1
        if n % self.every:
            return True
        return self.check(module, output, inputs, grads)

    def check(self, module, output, inputs, grads) -> bool:
        out = _first_tensor(output)
        if out is None or out.dim() < 2 or not out.is_floating_point():
            return True
        fdim = 1 if out.dim() in (4, 5) else out.dim() - 1
        units = out.shape[fdim]
        if units < self.min_units or out.numel() // max(units, 1) < self.min_positions:
            return True
        with torch.no_grad():
            others = tuple(d for d in range(out.dim()) if d != fdim)
            peak = out.detach().amax(dim=others)
            # `<= 0`, not `not > 0`: a unit whose max is NaN is broken, not dead; NaN is
            # the watch's to report (after a NaN stop and `c`, NaN weights must not read
            # as dead ReLUs)
            dead = float((peak <= 0).float().mean())
        if dead >= self.threshold:
            self.detail = f"{dead:.0%} of {units} units dead"
            return False
        return True


class NonFinite(Assertion):
    """Listed for completeness: NaN and Inf are found by the watch (`--break-on nan,inf`)."""

    kind = "tensor"
    delegate = "watch"

    def check(self, *args, **kwargs) -> bool:
        return True


# -- opt-in ------------------------------------------------------------------------------
class VanishingGradients(ParamAssertion):
    """A weight's (ndim >= 2) gradient norm fell below `min_norm`, or `factor` times below
    the median of its own history. Off by default: weights ahead of a normalisation, or
    layers whose gradient legitimately vanishes late in training, would trip it."""

    name = "vanishing_gradients"
    message = "a layer's gradient norm is vanishingly small"
    hint = "check activations (saturated sigmoid/tanh, dead ReLUs), initialisation, depth without residuals/normalisation"
    check_on = (BACKWARD,)
    default_enabled = False
    wants_norms = True

    def __init__(self, min_norm=1e-7, factor=1e3, window=20, warmup=3, **kw):
        super().__init__(**kw)
        self.min_norm, self.factor, self.window, self.warmup = min_norm, factor, window, warmup
        self._hist = _PerParam()

    def check(self, name, param, grad) -> bool:
        if grad is None or param.dim() < 2 or not grad.is_floating_point():
            return True
        n = _norm(grad, getattr(self, "grad_norms", None))
        if not math.isfinite(n):
            return True
        hist = self._hist.get(param)
        if hist is None:
            hist = []
            self._hist.set(param, hist)
        ok = True
        if n < self.min_norm:
            self.detail = f"‖grad {name}‖ = {n:.3g} < {self.min_norm:.3g}"
            ok = False
        elif len(hist) >= self.warmup:
            med = statistics.median(hist)
            if n * self.factor < med:
                self.detail = f"‖grad {name}‖ = {n:.3g}, {med / max(n, 1e-30):.3g}x below its median {med:.3g}"
                ok = False
        hist.append(n)
        del hist[:-self.window]
        return ok


class NotUpdated(ParamAssertion):
    """A parameter that has a gradient was not changed by the optimizer step (judged by
    the version counter, no copy): it is in no optimizer, or in one that did not step.
    Off by default: with several optimizers (GANs) each step legitimately leaves the other
    model's parameters alone."""

    name = "param_not_updated"
    message = "a parameter with a gradient was not updated by the optimizer step"
    hint = "build the optimizer from the right parameters (after replacing layers), or include the parameter group"
    check_on = (BEFORE_STEP, OPTIMIZER)
    scope = "all"
    default_enabled = False

    def __init__(self, **kw):
        super().__init__(**kw)
        self._version = _PerParam()

    def check(self, name, param, grad) -> bool:
        if self.stage == BEFORE_STEP:
            self._version.set(param, param._version if grad is not None else None)
            return True
        before = self._version.get(param)
        if before is not None and grad is not None and param.requires_grad \
                and param._version == before:
            self.detail = f"{name} is unchanged"
            return False
        return True


class UpdateRatio(ParamAssertion):
    """‖update‖/‖weight‖ of a weight (ndim >= 2) per step, outside [low, high] (healthy
    training sits near 1e-3). Off by default: it copies each weight before the step
    (memory) and learning-rate warmup or decay legitimately moves it."""

    name = "update_ratio"
    message = "the update/weight ratio of a layer is far from ~1e-3"
    hint = "too high: lower the learning rate; too low: raise it or check the schedule/weight decay"
    check_on = (BEFORE_STEP, OPTIMIZER)
    default_enabled = False

    def __init__(self, low=1e-5, high=1e-1, **kw):
        super().__init__(**kw)
        self.low, self.high = low, high
        self._before = _PerParam()

    def check(self, name, param, grad) -> bool:
        if param.dim() < 2 or not param.is_floating_point():
            return True
        if self.stage == BEFORE_STEP:
            self._before.set(param, param.detach().clone() if grad is not None else None)
            return True
        before = self._before.get(param)
        self._before.set(param, None)
        if before is None:
            return True
        with torch.no_grad():
            w = float(torch.linalg.vector_norm(before, dtype=torch.float32))
            u = float(torch.linalg.vector_norm(param.detach() - before, dtype=torch.float32))
        if w == 0 or not math.isfinite(u):
            return True
        ratio = u / w
        if ratio < self.low or ratio > self.high:
            self.detail = f"{name}: {ratio:.2g}"
            return False
        return True


class Saturated(ModuleAssertion):
    """Share of outputs of a Sigmoid/Tanh module in the flat tails (|tanh| > 0.99, sigmoid
    outside [0.01, 0.99]) above `threshold`. Off by default: a trained classifier's
    output sigmoid is confidently saturated by design."""

    name = "saturated_activation"
    message = "a sigmoid/tanh is saturated: its gradient is nearly zero for most inputs"
    hint = "normalise the inputs to the activation, lower the learning rate, or check the initialisation"
    check_on = (FORWARD,)
    targets = (nn.Sigmoid, nn.Tanh)
    default_enabled = False

    def __init__(self, threshold=0.5, **kw):
        super().__init__(**kw)
        self.threshold = threshold

    def check(self, module, output, inputs, grads) -> bool:
        out = _first_tensor(output)
        if out is None or not out.is_floating_point() or out.numel() == 0:
            return True
        with torch.no_grad():
            o = out.detach()
            if isinstance(module, nn.Tanh):
                sat = float((o.abs() > 0.99).float().mean())
            else:
                sat = float(((o < 0.01) | (o > 0.99)).float().mean())
        if sat > self.threshold:
            self.detail = f"{sat:.0%} of outputs saturated"
            return False
        return True


_INDEXED = re.compile(r"^(.*?)(\d+)$")


class ActivationScale(TensorNodeAssertion):
    """RMS of the outputs of a stack of same-type layers (`layers.0`, `layers.1`, ... ≥ 4)
    grows or shrinks more than `factor` from the first to the last layer, step after
    step. Off by default: one reduction per layer output, and pre-norm residual streams
    legitimately grow."""

    name = "activation_scale"
    message = "activation scale grows or shrinks layer after layer"
    hint = "check the initialisation (fan-in scaling), residual scaling and normalisation layers"
    check_on = (FORWARD,)
    default_enabled = False

    def __init__(self, factor=100.0, min_layers=4, **kw):
        super().__init__(**kw)
        self.factor, self.min_layers = factor, min_layers
        self._rms = {}          # (prefix, type) -> {index: rms}
        self.where = ""

    def check(self, node_id, tensor, grad) -> bool:
        path = node_id.rsplit("#", 1)[0]
        m = _INDEXED.match(path)
        if tensor is None or m is None or not tensor.is_floating_point() or tensor.numel() == 0:
            return True
        with torch.no_grad():
            rms = float(tensor.detach().float().pow(2).mean().sqrt())
        self._rms.setdefault(m.group(1), {})[int(m.group(2))] = rms
        return True

    def finish(self) -> bool:
        bad = ""
        for prefix, by_index in self._rms.items():
            if len(by_index) < self.min_layers:
                continue
            values = [by_index[i] for i in sorted(by_index)]
            first, last = values[0], values[-1]
            if first > 0 and math.isfinite(last) and (
                    last / first > self.factor or last / first < 1 / self.factor):
                self.where = f"{prefix}{sorted(by_index)[-1]}"
                bad = (f"RMS {first:.3g} at {prefix}{sorted(by_index)[0]} → {last:.3g} at "
                       f"{self.where} over {len(values)} layers")
                break
        self._rms = {}
        if bad:
            self.detail = bad
            return False
        return True


def default_assertions() -> list:
    """Fresh instances of the library, in the order `assertions` lists them."""
    return [
        NonFinite(name="nan", message="NaN in a tensor (found by the watch)", check_on=()),
        NonFinite(name="inf", message="Inf made from finite values (found by the watch)",
                  check_on=()),
        GradNotZeroed(), LossNotScalar(), LossNoGrad(), ExplodingGradients(), NoGradient(),
        DeadReLU(),
        VanishingGradients(), NotUpdated(), UpdateRatio(), Saturated(), ActivationScale(),
    ]


LIBRARY = (GradNotZeroed, LossNotScalar, LossNoGrad, ExplodingGradients, NoGradient,
           DeadReLU, VanishingGradients, NotUpdated, UpdateRatio, Saturated, ActivationScale)
