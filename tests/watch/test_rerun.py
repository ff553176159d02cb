"""The cheap check at the roots and the re-run that pins the op (mldebug/watch/step.py,
rerun.py): a root call whose check finds a NaN/Inf runs again under the full watch, which
stops where the full watch stops; what a re-run restores so that it computes what the
call computed (buffers, RNG, arguments as passed, the root's own hooks), and what it must
never change.

Each test lets the watch learn its roots first (`learned`: two healthy calls, or a
training step): from then on a root's call takes the cheap path, and a stop inside it
comes from a re-run. Each asserts the stop the full watch (`exact=True`) makes, or,
where a re-run cannot pin the op, a stop that says so and names what the check saw.
"""
from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import mldebug
from mldebug.watch import watch

from conftest import REPO


def lineno(fn, marker="# here") -> int:
    import inspect
    lines, start = inspect.getsourcelines(fn)
    for offset, text in enumerate(lines):
        if marker in text:
            return start + offset
    raise AssertionError(f"no {marker!r} in {fn.__name__}")


def collect(**kwargs):
    got = []
    return got, watch(on_violation=got.append, **kwargs)


def learned(w, model, *args):
    """Two healthy calls of MODEL under W (no gradient): the watch knows its roots, and
    the next call takes the cheap path."""
    with torch.no_grad():
        model(*args)
        model(*args)
    assert not w._learning and w._roots


class Block(nn.Module):
    """A residual block whose own forward code (not a child) overflows: `out + x * big`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)
        self.big = 1.0

    def forward(self, x):
        out = self.lin(x)
        out = out + x * 1e38 * self.big  # here
        return self.act(out)


def test_value_made_by_the_parents_code_is_pinned_there_not_in_the_child(device):
    """The re-run of the root (a Sequential) stops at the multiplication in Block's own
    forward, with that frame alive: the full watch's stop."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block()).to(device)
    x = torch.ones(2, 4, device=device)
    got, w = collect()
    with w:
        learned(w, model, x)
        model[1].big = 10.0
        model(x)
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.op, v.module, v.module_type, v.stage, v.created) == (
        "inf", "aten.mul.Tensor", "1", "Block", "forward", True)
    assert v.line == lineno(Block.forward)
    assert v.frame is not None and v.frame.f_code is Block.forward.__code__


class DropThenLog(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0

    def forward(self, x):
        x = F.dropout(x, 0.5, training=True)
        return torch.log(x - self.shift)  # here


def test_replay_draws_the_same_random_numbers_and_leaves_the_rng_as_it_was(device):
    rng = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), DropThenLog()).to(device)
    x = torch.randn(16, 8, device=device)
    torch.manual_seed(1)
    expected = model(x)
    after_plain = rng()
    got, w = collect()
    with w:
        model[2].shift = -10.0
        learned(w, model, x)
        model[2].shift = 0.0
        torch.manual_seed(1)
        out = model(x)
        after = rng()
    assert torch.equal(after, after_plain)
    assert torch.equal(out.isnan(), expected.isnan())
    assert len(got) == 1
    v = got[0]
    assert (v.op, v.module, v.line) == ("aten.log.default", "2", lineno(DropThenLog.forward))
    # the counts are those of the original call: the re-run drew the same dropout mask
    assert v.nan == int(expected.isnan().sum()) and v.neginf == int(expected.isneginf().sum())


class MaskedNet(nn.Module):
    """BatchNorm and dropout, then a deliberate -inf mask written as a constant in its own
    forward: its output is not finite, the whole call is re-run and judged: not a stop."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x):
        h = self.drop(self.bn(self.lin(x)))
        scores = h.unsqueeze(-1) * h.unsqueeze(-2)
        mask = torch.triu(torch.ones(4, 4, dtype=torch.bool, device=x.device), 1)
        return scores.masked_fill(mask, float("-inf"))


def test_a_replay_never_changes_buffers_or_results_bitwise(device):
    """Steps with a constant -inf in the output: a re-run re-runs BatchNorm (which updates
    its running stats) and dropout (which draws random numbers): the running stats, the
    weights and the RNG after training stay bitwise those of a run without mldebug."""
    def train(watched):
        torch.manual_seed(0)
        model = MaskedNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        got, w = collect() if watched else ([], contextlib.nullcontext())
        with w:
            for _ in range(4):
                opt.zero_grad()
                out = model(torch.randn(8, 4).to(device))
                loss = out.softmax(-1).nan_to_num().pow(2).sum()
                loss.backward()
                opt.step()
            judged = len(w._fruitless) if watched else 0
        rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
        return model.state_dict(), rng, got, judged

    plain_state, plain_rng, _, _ = train(False)
    state, rng, got, judged = train(True)
    assert got == [] and judged == 1     # re-run and judged once, then known
    assert torch.equal(rng, plain_rng)
    assert int(state["bn.num_batches_tracked"]) == 4
    for key in plain_state:
        assert torch.equal(state[key], plain_state[key]), key


def test_loss_code_outside_the_model_is_checked_op_by_op_in_backward(device):
    """sqrt of a zero loss: finite forward, infinite derivative in the loss's own
    backward (outside every module): the dry run of the loss region stops there."""
    torch.manual_seed(0)
    model = nn.Linear(3, 1).to(device)
    x = torch.randn(5, 3, device=device)
    got, w = collect()
    with w:
        learned(w, model, x)
        pred = model(x)
        loss = torch.sqrt(F.mse_loss(pred, pred.detach()))  # here
        loss.backward()
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.node, v.torch_op) == ("backward", "SqrtBackward0", "torch.sqrt")
    assert v.line == lineno(test_loss_code_outside_the_model_is_checked_op_by_op_in_backward)


class Counter(nn.Module):
    """Not repeatable: a NaN on its third call only (state it changes itself)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == 3 else x


def test_a_call_the_re_run_cannot_repeat_still_stops_and_names_what_the_check_saw(device):
    model = nn.Sequential(nn.Linear(2, 2), Counter()).to(device)
    x = torch.ones(1, 2, device=device)
    got, w = collect()
    with w:
        learned(w, model, x)
        model(x)  # here
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.stage, v.module, v.module_type, v.op) == (
        "nan", "forward", "", "Sequential", "")
    assert "output of Sequential" in v.text and "not pinned" in v.text
    assert "not repeatable" in v.text
    assert v.line == lineno(
        test_a_call_the_re_run_cannot_repeat_still_stops_and_names_what_the_check_saw)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.by = 1.0

    def forward(self, x):
        return x * self.by  # here


def test_a_root_whose_forward_runs_collectives_is_not_re_run_and_says_so(device):
    """A SyncBatchNorm in training reduces its statistics over every rank in its forward
    (as FSDP2 gathers its parameters): re-run on one rank alone it would wait for the
    others. The call is not re-run; the stop names the root's output and says why.
    (Without a process group SyncBatchNorm computes as BatchNorm.)"""
    model = nn.Sequential(nn.Linear(2, 2), nn.SyncBatchNorm(2), Scale()).to(device)
    x = torch.randn(4, 2, device=device)
    got, w = collect()
    with w:
        learned(w, model, x)
        model[2].by = float("nan")
        model(x)  # call
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.stage, v.module_type, v.op) == ("nan", "forward", "Sequential", "")
    assert "not re-run: SyncBatchNorm reduces its statistics over every rank" in v.text
    assert v.line == lineno(
        test_a_root_whose_forward_runs_collectives_is_not_re_run_and_says_so, "# call")


class NanGradOnce(torch.autograd.Function):
    """Identity whose backward makes a NaN the first time it runs after `armed` is set."""

    armed = False

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if NanGradOnce.armed:
            NanGradOnce.armed = False
            return g * float("nan")
        return g


class OnceBad(nn.Module):
    def forward(self, x):
        return NanGradOnce.apply(x)


def test_a_backward_the_re_run_cannot_repeat_names_the_parameter_step_and_stage(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), OnceBad(), nn.Linear(4, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 4, device=device)
    got, w = collect()
    with w:
        for step in range(3):
            NanGradOnce.armed = step == 2
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            opt.step()
    v = got[0]
    assert (v.stage, v.kind, v.param, v.module, v.step, v.op) == (
        "backward", "nan", "0.weight", "0", 2, "")
    assert "gradient of 0.weight" in v.text and "not pinned" in v.text


def test_a_gradient_made_outside_the_model_names_the_parameter(device):
    """An L2-like term over a parameter, written in the training loop: its backward is
    outside the model's calls and outside the loss's path to the model output, so the
    real backward (without the per-op check) makes it; the stop names the parameter and
    says the op was not pinned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).to(device)
    x = torch.randn(4, 3, device=device)
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0     # d/dw |w|**0.5 is infinite at 0
    got, w = collect()
    with w:
        learned(w, model, x)
        loss = model(x).sum() + model[2].weight.abs().pow(0.5).sum()
        loss.backward()  # here
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.param, v.module, v.kind) == ("backward", "2.weight", "2", "nan")
    assert "gradient of 2.weight" in v.text and "not pinned" in v.text
    assert v.line == lineno(test_a_gradient_made_outside_the_model_names_the_parameter)


def test_exact_mode_makes_the_same_stops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block())
    model[1].big = 10.0
    got, w = collect(exact=True)
    with w:
        model(torch.ones(2, 4))
    assert [(v.op, v.module, v.line) for v in got] == [
        ("aten.mul.Tensor", "1", lineno(Block.forward))]


def test_everything_installed_is_removed_also_the_roots_own_hooks():
    before = torch.autograd.backward
    model = nn.Linear(2, 1)
    with watch(on_violation=lambda v: None) as w:
        assert torch.autograd.backward is not before
        learned(w, model, torch.randn(3, 2))
        assert model._forward_pre_hooks and model._forward_hooks
        model(torch.randn(3, 2)).sum().backward()
    assert torch.autograd.backward is before
    assert torch._C._len_torch_dispatch_stack() == 0
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not nn.modules.module._global_forward_pre_hooks


def test_a_model_copied_under_the_watch_is_a_plain_model():
    """copy.deepcopy of a root (an EMA copy) keeps the root's hooks as they are: the copy
    is no root of the watch's, and its calls are checked op by op; pickling the whole
    model leaves inert hooks."""
    import copy
    import pickle
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    got, w = collect()
    with w:
        learned(w, model, torch.randn(3, 2))
        ema = copy.deepcopy(model)
        with w.suspended(), torch.no_grad():
            ema[0].weight.fill_(float("nan"))
        ema(torch.randn(3, 2))  # here
        restored = pickle.loads(pickle.dumps(model))
    assert [(v.op, v.module_type, v.line) for v in got] == [
        ("aten.addmm.default", "Linear",
         lineno(test_a_model_copied_under_the_watch_is_a_plain_model))]
    assert restored(torch.randn(3, 2)).shape == (3, 2)


def test_the_mode_is_back_on_the_stack_after_a_call_that_raised():
    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            self.fail = False

        def forward(self, x):
            if self.fail:
                raise ValueError("bad shape")
            return x

    model = nn.Sequential(nn.Linear(2, 2), Raises())
    got, w = collect()
    with w:
        learned(w, model, torch.ones(1, 2))
        model[1].fail = True
        try:
            model(torch.ones(1, 2))
        except ValueError:
            pass
        torch.log(torch.zeros(1))   # outside modules: the per-op check must see it
    assert [v.op for v in got] == ["aten.log.default"]


def test_mldebug_watch_accepts_exact_and_rejects_nonsense():
    from mldebug.core.errors import UsageError
    with pytest.raises(UsageError, match="exact"):
        mldebug.watch(exact="yes")


class LogOf(nn.Module):
    def forward(self, x):
        return torch.log(x) * 2


def test_a_compiled_module_is_checked_at_its_boundary_and_says_so():
    import warnings
    model = LogOf()
    try:
        compiled = torch.compile(model, backend="eager")
        compiled(torch.ones(2))
    except Exception as exc:  # noqa: BLE001 - no compiler here
        pytest.skip(f"torch.compile unavailable: {exc}")
    got, w = collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with w:
            out = compiled(torch.zeros(2))
            compiled(torch.ones(2))
    notes = [str(c.message) for c in caught if str(c.message).startswith("mldebug:")]
    assert len(notes) == 1 and "LogOf" in notes[0] and "compiled boundary" in notes[0]
    assert torch.isinf(out).all()
    assert [(v.kind, v.op, v.created) for v in got] == [("inf", "aten.log.default", True)]


def test_an_optimizer_state_that_overflows_is_a_stop_though_the_parameter_is_finite(device):
    """Adam with a gradient of 1e25: exp_avg_sq = 0.001 * 1e50 is +Inf in float32, the
    update is exp_avg / inf = 0, the parameter stays finite -- and silently never moves
    again. The step's check reads the state too and names it."""
    p = nn.Parameter(torch.ones(3, device=device))
    opt = torch.optim.Adam([p], lr=0.1)
    got, w = collect()
    with w:
        p.grad = torch.full((3,), 1e25, device=device)
        opt.step()  # here
    assert bool(p.isfinite().all())
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.kind, v.torch_op, v.created, v.posinf) == (
        "optimizer", "inf", "Adam.step", True, 3)
    assert "optimizer state 'exp_avg_sq'" in v.text and "lr=0.1" in v.text
    assert v.line == lineno(test_an_optimizer_state_that_overflows_is_a_stop_though_the_parameter_is_finite)


def test_a_step_on_gradients_already_reported_is_not_a_new_stop(device):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(), nn.Linear(3, 1)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got, w = collect()
    with w:
        learned(w, model, torch.randn(4, 3, device=device))
        loss = torch.log(model(torch.randn(4, 3, device=device)) - 100).sum()  # NaN: stop 1
        loss.backward()
        opt.step()       # NaN gradients -> NaN parameters: flows on, no stop
        model(torch.randn(4, 3, device=device)).sum().backward()
        opt.step()
    assert [(v.stage, v.op) for v in got] == [("forward", "aten.log.default")]


def test_an_optimizer_with_a_closure_keeps_the_per_op_check():
    """LBFGS runs the model inside step(closure): the step keeps the per-op check, so a
    NaN made in the closure's loss is pinned to its op."""
    model = nn.Linear(2, 1)
    opt = torch.optim.LBFGS(model.parameters(), max_iter=1)
    x = torch.randn(4, 2)

    def closure():
        opt.zero_grad()
        loss = torch.sqrt(model(x) - 1e3).sum()  # here
        loss.backward()
        return loss

    got, w = collect()
    with w:
        learned(w, model, x)
        opt.step(closure)
    assert got and got[0].op == "aten.sqrt.default" and got[0].created
    assert got[0].line == lineno(test_an_optimizer_with_a_closure_keeps_the_per_op_check)


def test_after_a_stop_in_the_loss_backward_the_optimizer_step_is_not_a_new_stop():
    """examples/nan_loss.py's bug: log(softmax) written by hand in the training loop, finite
    forward, -inf in LogBackward0 at its second step (the dry run of the loss's backward
    stops there); the NaN gradients it leads to are not a second stop at
    optimizer.step()."""
    import os
    import runpy
    example = os.path.join(str(REPO), "examples", "nan_loss.py")
    got, w = collect()
    with w:
        runpy.run_path(example, run_name="__main__")
    assert [(v.stage, v.node) for v in got] == [("backward", "LogBackward0")]


class RootFeature(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # here


def count_dry_runs(monkeypatch):
    """Calls of torch.autograd.grad with retain_graph=True: the watch's dry runs."""
    calls = []
    real = torch.autograd.grad

    def spy(*args, **kwargs):
        if kwargs.get("retain_graph"):
            calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", spy)
    return calls


class SqrtAtMin(nn.Module):
    """sqrt(x - min(x)) when armed: finite forward, an infinite derivative at the minimum,
    which reaches the parameters' gradients."""

    def __init__(self):
        super().__init__()
        self.armed = False

    def forward(self, x):
        if self.armed:
            return torch.sqrt(x - x.detach().amin())  # here
        return x


def test_a_safe_loss_region_skips_the_dry_run_and_the_models_backward_is_still_pinned(
        monkeypatch, device):
    """cross_entropy and x**2 have backward nodes that cannot make a NaN/Inf from finite
    values: no dry run; the output's gradient is kept by its node's pre-hook, and the
    re-run of the model's backward from it still stops at the sqrt."""
    dry = count_dry_runs(monkeypatch)
    for make_loss in (lambda out: F.cross_entropy(out, torch.tensor([0, 1] * 4, device=device)),
                      lambda out: out.pow(2).mean()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), SqrtAtMin(), nn.Linear(6, 2))
        model = model.to(device)
        x = torch.randn(8, 4, device=device)
        got, w = collect()
        with w:
            learned(w, model, x)
            model[2].armed = True
            make_loss(model(x)).backward()
        assert dry == []
        assert len(got) == 1
        v = got[0]
        assert (v.stage, v.node, v.module, v.module_type, v.torch_op) == (
            "backward", "SqrtBackward0", "2", "SqrtAtMin", "torch.sqrt")
        assert v.line == lineno(SqrtAtMin.forward)
    # a loss whose own backward can blow up (x ** 0.5) gets its dry run
    model = nn.Linear(4, 1).to(device)
    got, w = collect()
    with w:
        learned(w, model, torch.randn(8, 4, device=device))
        model(torch.randn(8, 4, device=device)).abs().pow(0.5).mean().backward()
    assert len(dry) == 1


def test_an_overflow_in_the_unchecked_loss_region_is_still_a_stop_that_says_where(device):
    """A float16 model and a loss in float32 scaled by 1e5: the gradient cast back to
    float16 overflows in ToCopyBackward0, a node of the loss region that has no dry run
    (only an overflow can make it non-finite). The output's gradient is checked: a stop
    at loss.backward() naming the region's nodes; `--watch exact` pins the op."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half().to(device)
    x = torch.randn(3, 4).half().to(device)
    got, w = collect()
    with w:
        learned(w, model, x)
        loss = (model(x).float() * 1e5).sum()
        loss.backward()  # here
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.kind, v.op, v.module_type) == ("backward", "inf", "", "Linear")
    assert "gradient of output 0 of Linear" in v.text
    assert "ToCopyBackward0" in v.text and "--watch exact" in v.text
    assert v.line == lineno(
        test_an_overflow_in_the_unchecked_loss_region_is_still_a_stop_that_says_where)
    # the optimizer must not stop again on the gradients that descend from it
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with w:
        opt.step()
    assert len(got) == 1
    torch.manual_seed(0)
    model = nn.Linear(4, 2).half().to(device)
    got, w = collect(exact=True)
    with w:
        (model(x).float() * 1e5).sum().backward()
    assert [(v.stage, v.node) for v in got] == [("backward", "ToCopyBackward0")]


def test_an_overflow_in_the_backward_of_plain_layers_is_pinned_as_the_full_watch_pins_it(
        device):
    """Sequential(Linear, Linear) with a huge second weight: the gradient of the first
    layer's output overflows (1e39 in float32) in the second's backward. Every parameter
    gradient is checked after backward: the re-run of the call's backward stops at the
    op, as `exact` does."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        with torch.no_grad():
            model[0].weight.fill_(1e-31)
            model[0].bias.zero_()
            model[1].weight.fill_(1e38)
            model[1].bias.zero_()
        return model.to(device)

    x = torch.ones(2, 4, device=device)
    stops = {}
    for exact in (False, True):
        model = build()
        got, w = collect(exact=exact)
        with w:
            if not exact:
                learned(w, model, x)
            (model(x).sum() * 10).backward()
        stops[exact] = [(v.stage, v.created, v.kind, v.op, v.node) for v in got]
    assert stops[False] == stops[True] and stops[True][0][:3] == ("backward", True, "inf")


def test_only_the_roots_outputs_get_a_gradient_hook():
    """The healthy step's Python does not grow with the model: a pre-hook on the autograd
    node of each root output (to keep its gradient for a re-run), none on the outputs of
    the modules inside, however many."""
    from mldebug.watch import roots
    made = []
    real = roots._KeepGrad.__init__

    def counted(self, *args):
        made.append(args)
        real(self, *args)

    for depth in (2, 12):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh())
                                for _ in range(depth)])
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(4, 8)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(roots._KeepGrad, "__init__", counted)
            with watch(action="raise"):
                for _ in range(3):
                    opt.zero_grad()
                    model(x).pow(2).mean().backward()
                    opt.step()
                made.clear()
                model(x).pow(2).mean().backward()
        assert len(made) == 1, (depth, len(made))


def test_a_mask_and_its_softmax_outside_modules_are_not_stops(device):
    """-inf made from a constant, then carried by temporaries: on a device the window is
    read after they are freed; what they held is taken to come from the judged mask."""
    got, w = collect()
    with w:
        mask = torch.full((4, 4), float("-inf"), device=device).triu(1)
        attn = torch.softmax(torch.randn(4, 4, device=device) + mask, dim=-1)
        nn.Linear(4, 4).to(device)(attn)       # a module call: the window is read
    assert got == [] and bool(attn.isfinite().all())


class SqrtBelow(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = 0.0

    def forward(self, x):
        return torch.sqrt(x - self.shift)  # here


def test_a_forward_stop_in_a_module_is_the_only_stop_of_the_steps_that_follow(device):
    """The NaN made by a sqrt inside the model at step 1 flows into the loss, the
    gradients, the parameters and every later step: none of that is a new stop (the
    re-run of the call's backward would otherwise make the forward's stop again; on a
    device the loss ops outside modules are read after their inputs are freed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Sigmoid(), SqrtBelow(), nn.Linear(8, 1))
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got, w = collect()
    with w:
        for step in range(4):
            model[2].shift = 10.0 if step == 1 else 0.0    # sqrt of a negative: NaN
            opt.zero_grad()
            model(torch.randn(16, 4, device=device)).pow(2).mean().backward()
            opt.step()
    assert [(v.stage, v.op, v.module, v.step, v.line) for v in got] == [
        ("forward", "aten.sqrt.default", "2", 1, lineno(SqrtBelow.forward))]
    assert bool(model[0].weight.isnan().all())


def test_the_rng_a_replay_restores_is_torchs_own_state(monkeypatch):
    """`roots.rng_state()` (taken as every root call starts, for its re-run) reads the
    generators in C: the CPU state is `torch.get_rng_state()`'s, and CUDA's is one state
    per device in the order `torch.cuda.set_rng_state_all` writes them back (stood in for
    here by two CPU generators where CUDA is missing; none before CUDA starts)."""
    from mldebug.watch import roots
    torch.manual_seed(3)
    torch.rand(5)
    if torch.cuda.is_available():
        torch.rand(5, device="cuda")     # (CUDA started, its generators moved on)
    cpu, cuda = roots.rng_state()
    assert torch.equal(cpu, torch.get_rng_state())
    if torch.cuda.is_available():
        expected = torch.cuda.get_rng_state_all()
        assert cuda is not None and len(cuda) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(cuda, expected))
    else:
        assert cuda is None
        gens = (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
        monkeypatch.setattr(torch.cuda, "default_generators", gens)
        cpu, cuda = roots.rng_state()
        assert [s.tolist() for s in cuda] == [g.get_state().tolist() for g in gens]
        assert cuda[0].tolist() != cuda[1].tolist()
    cpu[0] ^= 1                      # a copy: the generator's own state is untouched
    assert not torch.equal(cpu, torch.get_rng_state())


# -- what a re-run restores ------------------------------------------------------------
class Probe(nn.Module):
    """Keeps a copy of what it is given, call by call (a re-run's calls too: kept outside
    the module, whose own attributes a re-run puts back)."""

    def __init__(self):
        super().__init__()
        self.seen = lambda: SEEN[id(self)]
        SEEN[id(self)] = []

    def forward(self, x):
        SEEN[id(self)].append(x.detach().clone())
        return x


SEEN: dict = {}


class LogBelow(nn.Module):
    def __init__(self):
        super().__init__()
        self.shift = -100.0

    def forward(self, x):
        return torch.log(x - self.shift)  # here


def test_a_re_run_starts_from_the_buffers_as_the_call_started(device):
    """spectral_norm's u is updated in place by each call (a power iteration) and the
    layer's output depends on it: the re-run computes what the call computed only from u
    as the call started, not as it left it. BatchNorm's running statistics are updated
    by each call: the re-run updates copies, so after the run every buffer is bitwise a
    plain run's."""
    def run(watched):
        torch.manual_seed(0)
        model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(8, 8)), nn.BatchNorm1d(8),
                              Probe(), LogBelow()).to(device)
        x = torch.randn(16, 8, device=device)
        got, w = collect() if watched else ([], contextlib.nullcontext())
        with w:
            for call in range(4):
                model[3].shift = 0.5 if call == 2 else -100.0
                model(x)
        return model, got

    plain, _ = run(False)
    model, got = run(True)
    assert [(v.op, v.module, v.line) for v in got] == [
        ("aten.log.default", "3", lineno(LogBelow.forward))]
    seen = model[2].seen()
    assert len(seen) == 5                      # 4 calls and the re-run of the third
    assert torch.equal(seen[3], seen[2])       # the re-run computed what the call did
    assert not torch.equal(seen[3], seen[1])   # (u moves from call to call)
    for (name, a), (_, b) in zip(plain.state_dict().items(), model.state_dict().items()):
        assert torch.equal(a, b), name


class UsesALayerItDoesNotOwn(nn.Module):
    """Calls a BatchNorm kept in a plain list: `model.modules()` does not list it."""

    def __init__(self, norm):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.kept = [norm]
        self.shift = -100.0

    def forward(self, x):
        return torch.log(self.kept[0](self.lin(x)) - self.shift)  # here


def test_a_layer_the_root_uses_but_does_not_own_is_not_updated_twice(device):
    def run(watched):
        torch.manual_seed(0)
        norm = nn.BatchNorm1d(8).to(device)
        model = UsesALayerItDoesNotOwn(norm).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 8, device=device)
        got, w = collect() if watched else ([], contextlib.nullcontext())
        with w:
            for step in range(4):
                model.shift = 0.0 if step == 2 else -100.0
                opt.zero_grad()
                model(x).nan_to_num().sum().backward()
                opt.step()
        return norm, got

    plain, _ = run(False)
    norm, got = run(True)
    assert [(v.op, v.step) for v in got] == [("aten.log.default", 2)]
    for key, value in plain.state_dict().items():
        assert torch.equal(norm.state_dict()[key], value), key


def test_the_roots_own_hooks_run_in_the_re_run(device):
    """A forward pre-hook on the root changes its input: the re-run calls the module (its
    hooks run), not its `forward`, with the arguments as they were passed."""
    model = LogOf().to(device)
    flip = [False]
    model.register_forward_pre_hook(lambda m, args: (-args[0],) if flip[0] else None)
    x = torch.rand(4, device=device) + 1
    got, w = collect()
    with w:
        learned(w, model, x)
        flip[0] = True
        model(x)
    assert [(v.kind, v.op, v.nan) for v in got] == [("nan", "aten.log.default", 4)]


class SubOneInPlace(nn.Module):
    def forward(self, x):
        return x.sub_(1)


def test_a_root_that_writes_its_argument_in_place_is_re_run_from_the_argument_as_passed(
        device):
    """The first layer writes the input in place (x - 1), then log: an input of exactly
    1 makes log(0) = -inf. A re-run from the argument as the call left it would compute
    log(-1) = NaN; the first call (while the watch learns) showed that the root writes
    its argument, so from the first cheap call on each call keeps a copy of it as passed,
    and the stop is the -inf."""
    model = nn.Sequential(SubOneInPlace(), LogOf()).to(device)
    got, w = collect()
    with w:
        for call in range(4):
            x = torch.full((3,), 2.0, device=device)
            if call == 2:       # (calls 0 and 1: the roots are learned)
                x[1] = 1.0
            model(x)
    assert [(v.kind, v.op, v.neginf, v.nan, v.created) for v in got] == [
        ("inf", "aten.log.default", 1, 0, True)]


class CheckpointedBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.armed = False

    def forward(self, x):
        h = torch.tanh(self.lin(x))
        if self.armed:
            h = torch.sqrt(h - h.detach().amin())  # here
        return h


class Checkpointed(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = CheckpointedBlock()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        return self.head(checkpoint(self.block, x, use_reentrant=False))


def test_a_checkpointed_blocks_backward_is_pinned_by_the_re_run(device):
    """Activation checkpointing recomputes the block inside backward: the re-run's
    backward recomputes it under the full watch and stops at the sqrt's infinite
    derivative, at the block's line, as the full watch does."""
    stops = {}
    for exact in (False, True):
        torch.manual_seed(0)
        model = Checkpointed().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x = torch.randn(16, 8, device=device)
        got, w = collect(exact=exact)
        with w:
            for step in range(3):
                model.block.armed = step == 2
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
        stops[exact] = [(v.stage, v.node, v.line, v.step) for v in got]
    assert stops[False] == stops[True] == [
        ("backward", "SqrtBackward0", lineno(CheckpointedBlock.forward), 2)]


class Annealed(nn.Module):
    """A policy whose forward keeps state of its own: a call counter that anneals its
    temperature, a list of the temperatures, a draw from Python's random, noise from a
    generator of its own, a running mean kept as a plain tensor, a count in a numpy array,
    and a momentum copy of its layer updated in place (MoCo's target encoder). It
    returns masked logits: -inf on illegal actions, on purpose (its first cheap check
    finds them and re-runs the call to judge them)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.target = nn.Linear(4, 3).requires_grad_(False)
        self.calls = 0
        self.temperatures = []
        self.noise = torch.Generator().manual_seed(1)
        self.mean = torch.zeros(4)
        self.seen = np.zeros(1)

    def forward(self, obs, legal):
        self.calls += 1
        self.seen += len(obs)
        tau = max(0.5, 1.0 - 0.1 * self.calls) * (1 + random.random() / 100)
        self.temperatures.append(tau)
        with torch.no_grad():
            self.mean.mul_(0.9).add_(obs.mean(0), alpha=0.1)
            for t, p in zip(self.target.parameters(), self.fc.parameters()):
                t.mul_(0.9).add_(p, alpha=0.1)
        x = obs - self.mean + torch.randn(obs.shape, generator=self.noise) / 10
        return ((self.fc(x) + self.target(x)) / tau).masked_fill(~legal, float("-inf"))


def test_a_re_run_puts_back_the_state_the_call_changed(device):
    def run(watched):
        random.seed(0)
        torch.manual_seed(0)
        policy = Annealed()
        opt = torch.optim.SGD(policy.fc.parameters(), lr=0.1)
        legal = torch.tensor([[True, True, False]] * 4)
        got, w = collect() if watched else ([], contextlib.nullcontext())
        with w:
            for step in range(4):
                logits = policy(torch.randn(4, 4), legal)
                loss = -torch.log_softmax(logits, -1)[:, 0].mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        return policy, got, random.random()

    plain, _, plain_draw = run(False)
    policy, got, draw = run(True)
    assert got == []
    assert (policy.calls, policy.temperatures, policy.seen.tolist(), draw) == (
        plain.calls, plain.temperatures, plain.seen.tolist(), plain_draw)
    assert torch.equal(policy.noise.get_state(), plain.noise.get_state())
    assert torch.equal(policy.mean, plain.mean)
    for a, b in zip(plain.state_dict().values(), policy.state_dict().values()):
        assert torch.equal(a, b)
