"""The watch's tiers (mldebug/watch/tiers.py): sentinels inside module calls and backward,
replays that pin the op, and what a replay must never change.

Each test states the stop the exact per-op check would make and asserts the tiered watch
makes the same one (or, where a replay cannot pin the op, a stop that says so).
"""
from __future__ import annotations

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


class Block(nn.Module):
    """A residual block whose own forward code (not a child) overflows: `out + x * big`."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.lin(x)
        out = out + x * 1e38 * 1e1  # here
        return self.act(out)


def test_value_made_by_the_parents_code_is_pinned_there_not_in_the_child(device):
    """The in-place ReLU's output is the first bad module output, but its input was
    already Inf: the flag goes up to Block, whose replay stops at the multiplication."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block()).to(device)
    got, w = collect()
    with w:
        model(torch.ones(2, 4, device=device))
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.op, v.module, v.module_type, v.stage, v.created) == (
        "inf", "aten.mul.Tensor", "1", "Block", "forward", True)
    assert v.line == lineno(Block.forward)
    assert v.frame is not None and v.frame.f_code is Block.forward.__code__


class DropThenLog(nn.Module):
    def forward(self, x):
        x = F.dropout(x, 0.5, training=True)
        return torch.log(x)  # here


def test_replay_draws_the_same_random_numbers_and_leaves_the_rng_as_it_was(device):
    rng = torch.cuda.get_rng_state if device == "cuda" else torch.get_rng_state
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), DropThenLog()).to(device)
    x = torch.randn(16, 8, device=device)
    torch.manual_seed(1)
    expected = model(x)
    after_plain = rng()
    got, w = collect()
    torch.manual_seed(1)
    with w:
        out = model(x)
    assert torch.equal(rng(), after_plain)
    assert torch.equal(out.isnan(), expected.isnan())
    assert len(got) == 1
    v = got[0]
    assert (v.op, v.module, v.line) == ("aten.log.default", "2", lineno(DropThenLog.forward))
    # the counts are those of the original call: the replay drew the same dropout mask
    assert v.nan == int(expected.isnan().sum()) and v.neginf == int(expected.isneginf().sum())


class MaskedNet(nn.Module):
    """BatchNorm and dropout, then a deliberate -inf mask written as a constant in its own
    forward: its output flags, the whole call is replayed and judged: not a stop."""

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
    """Steps flag (the mask); a replay re-runs BatchNorm (which updates its running
    stats) and dropout (which draws random numbers): the running stats, the weights and
    the RNG after training stay bitwise those of a run without mldebug."""
    def train(watched):
        torch.manual_seed(0)
        model = MaskedNet().to(device)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        got, w = collect()
        if not watched:
            w.close()
        with w:
            for _ in range(3):
                opt.zero_grad()
                out = model(torch.randn(8, 4).to(device))
                loss = out.softmax(-1).nan_to_num().pow(2).sum()
                loss.backward()
                opt.step()
            replays = len(w._t.fruitless) if watched else 0
        rng = torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()
        return model.state_dict(), rng, got, replays

    plain_state, plain_rng, _, _ = train(False)
    state, rng, got, replays = train(True)
    assert got == [] and replays == 1     # judged once, then known
    assert torch.equal(rng, plain_rng)
    assert int(state["bn.num_batches_tracked"]) == 3
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
        pred = model(x)
        loss = torch.sqrt(F.mse_loss(pred, pred.detach()))  # here
        loss.backward()
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.node, v.torch_op) == ("backward", "SqrtBackward0", "torch.sqrt")
    assert v.line == lineno(test_loss_code_outside_the_model_is_checked_op_by_op_in_backward)


class Counter(nn.Module):
    """Not repeatable: a NaN on its first call only (state it changes itself)."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls == 1 else x


def test_a_call_that_cannot_be_replayed_still_stops_and_says_why(device):
    # (device: its sentinels are read after the outermost call, which is re-run: the
    # stop still names the call whose output was not finite)
    model = nn.Sequential(nn.Linear(2, 2), Counter())
    got, w = collect()
    with w:
        model(torch.ones(1, 2))
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.stage, v.module, v.op) == ("nan", "forward", "1", "")
    assert "not pinned" in v.text and "output of 1" in v.text


def test_a_gradient_made_outside_the_model_names_the_parameter(device):
    """An L2-like term over a parameter, written in the training loop: its backward is
    outside the model's calls and outside the loss's path to the model output, so the
    real backward (without the per-op check) makes it; the stop names the parameter and
    says the op was not pinned."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 1)).to(device)
    with torch.no_grad():
        model[2].weight[0, 0] = 0.0     # d/dw |w|**0.5 is infinite at 0
    got, w = collect()
    with w:
        loss = model(torch.randn(4, 3, device=device)).sum() + model[2].weight.abs().pow(0.5).sum()
        loss.backward()  # here
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.param, v.module, v.kind) == ("backward", "2.weight", "2", "nan")
    assert "gradient of 2.weight" in v.text and "not pinned" in v.text
    assert v.line == lineno(test_a_gradient_made_outside_the_model_names_the_parameter)


def test_exact_mode_makes_the_same_stops():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Block())
    got, w = collect(exact=True)
    with w:
        model(torch.ones(2, 4))
    assert [(v.op, v.module, v.line) for v in got] == [
        ("aten.mul.Tensor", "1", lineno(Block.forward))]


def test_everything_installed_is_removed_also_for_the_backward_wrapper():
    before = torch.autograd.backward
    with watch(on_violation=lambda v: None):
        assert torch.autograd.backward is not before
        nn.Linear(2, 1)(torch.randn(3, 2)).sum().backward()
    assert torch.autograd.backward is before
    assert torch._C._len_torch_dispatch_stack() == 0


def test_the_mode_is_back_on_the_stack_after_a_call_that_raised():
    class Raises(nn.Module):
        def forward(self, x):
            raise ValueError("bad shape")

    got, w = collect()
    with w:
        try:
            nn.Sequential(nn.Linear(2, 2), Raises())(torch.ones(1, 2))
        except ValueError:
            pass
        torch.log(torch.zeros(1))   # outside modules: the exact check must see it
    assert [v.op for v in got] == ["aten.log.default"]


def test_mldebug_watch_accepts_exact_and_rejects_nonsense():
    import pytest
    from mldebug.core.errors import UsageError
    with pytest.raises(UsageError, match="exact"):
        mldebug.watch(exact="yes")


class LogOf(nn.Module):
    def forward(self, x):
        return torch.log(x) * 2


def test_a_compiled_module_is_checked_at_its_boundary_and_says_so():
    import pytest
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
        loss = torch.log(model(torch.randn(4, 3, device=device)) - 100).sum()  # NaN: stop 1
        loss.backward()
        opt.step()       # NaN gradients -> NaN parameters: flows on, no stop
        model(torch.randn(4, 3, device=device)).sum().backward()
        opt.step()
    assert [(v.stage, v.op) for v in got] == [("forward", "aten.log.default")]


def test_an_optimizer_with_a_closure_keeps_the_per_op_check():
    """LBFGS runs the model inside step(closure): the step keeps the exact check, so a
    NaN made in the closure's forward is pinned to its op."""
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
        opt.step(closure)
    assert got and got[0].op == "aten.sqrt.default" and got[0].created
    assert got[0].line == lineno(test_an_optimizer_with_a_closure_keeps_the_per_op_check)


def test_after_a_stop_in_the_loss_backward_the_optimizer_step_is_not_a_new_stop():
    """examples/nan_loss.py's bug: log(softmax) written by hand in the training loop, finite
    forward, -inf in LogBackward0 (the dry run of the loss's backward stops there); the
    NaN gradients it leads to are not a second stop at optimizer.step()."""
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


def test_a_safe_loss_region_skips_the_dry_run_and_the_models_backward_is_still_pinned(
        monkeypatch, device):
    """cross_entropy and x**2 have backward nodes that cannot make a NaN/Inf from finite
    values: no dry run; the output's gradient is kept by its node's pre-hook, and the
    replay of the model's backward from it still stops at the sqrt."""
    dry = count_dry_runs(monkeypatch)
    for make_loss in (lambda out: F.cross_entropy(out, torch.tensor([0, 1] * 4, device=device)),
                      lambda out: out.pow(2).mean()):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), RootFeature(), nn.Linear(6, 2))
        model = model.to(device)
        got, w = collect()
        with w:
            make_loss(model(torch.randn(8, 4, device=device))).backward()
        assert dry == []
        assert len(got) == 1
        v = got[0]
        assert (v.stage, v.node, v.module, v.module_type, v.torch_op) == (
            "backward", "SqrtBackward0", "2", "RootFeature", "torch.sqrt")
        assert v.line == lineno(RootFeature.forward)
    # a loss whose own backward can blow up (x ** 0.5) still gets its dry run
    model = nn.Linear(4, 1).to(device)
    with collect()[1]:
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


class Overflow(nn.Module):
    def forward(self, x):
        return x * 1e38 * 1e1  # here


def test_an_output_whose_check_a_sequential_leaves_to_the_next_child_is_still_pinned(device):
    """In Sequential(Linear, Overflow, Linear, ReLU) the Inf leaving Overflow is not
    summed (the Linear after it shows any NaN/Inf); the flag on that Linear defers to the
    Sequential, whose exact re-run stops at the multiplication in Overflow."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Overflow(), nn.Linear(4, 4), nn.ReLU()).to(device)
    got, w = collect()
    with w:
        model(torch.ones(2, 4, device=device))
    assert [(v.kind, v.op, v.module, v.module_type, v.stage, v.created) for v in got] == [
        ("inf", "aten.mul.Tensor", "1", "Overflow", "forward", True)]
    assert got[0].line == lineno(Overflow.forward)
    # the plan follows the Sequential: a ReLU put after Overflow absorbs -Inf, so
    # Overflow's own output is checked again (and the stop is the same)
    model[2] = nn.ReLU()
    got, w = collect()
    with w:
        model(-torch.ones(2, 4, device=device))
    assert [(v.op, v.module) for v in got] == [("aten.mul.Tensor", "1")]
    from mldebug.watch import safe
    plan = safe.sequential_plan(model)
    assert plan[id(model[1])] == safe.NO_GRAD_CHECK           # next is a ReLU now
    assert plan[id(model[0])] == 0                             # next is custom code


def test_an_overflow_in_the_backward_of_plain_layers_is_caught_at_the_step(device):
    """Sequential(Linear, Linear): no user code in the model, so its parameters'
    gradients are not summed after backward (they follow from the checked gradient of
    its output). An overflow in the second Linear's backward (1e39 in float32) is then
    seen by the step's check: a stop at opt.step() that says the gradient was made
    non-finite in backward; the exact mode pins the op."""
    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        with torch.no_grad():
            model[0].weight.fill_(1e-31)
            model[0].bias.zero_()
            model[1].weight.fill_(1e38)
            model[1].bias.zero_()
        model = model.to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.1)

    x = torch.ones(2, 4, device=device)
    model, opt = build()
    got, w = collect()
    with w:
        (model(x).sum() * 10).backward()
        assert got == []
        opt.step()  # here
    assert len(got) == 1
    v = got[0]
    assert (v.stage, v.param, v.culprit, v.torch_op) == (
        "optimizer", "0.weight", "its gradient", "SGD.step")
    assert "already non-finite" in v.text and "overflow" in v.text
    assert v.line == lineno(test_an_overflow_in_the_backward_of_plain_layers_is_caught_at_the_step)
    model, opt = build()
    got, w = collect(exact=True)
    with w:
        (model(x).sum() * 10).backward()
    assert [(v.stage, v.created, v.kind) for v in got] == [("backward", True, "inf")]


class SqrtOfLayer(nn.Module):
    """A Linear at zero, then the user's sqrt of its output: the sqrt's backward is
    infinite at 0, and that gradient goes only into the layer (its output's gradient,
    then its weight's and bias's). OWNED: the layer is a child; else the model only keeps
    it in a list, so `model.parameters()` does not list its parameters. KIND: the
    layer's class (GPT-2's Conv1D is a Linear too)."""

    def __init__(self, device, owned=True, kind=nn.Linear):
        super().__init__()
        layer = kind(4, 4).to(device)
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.zero_()
        if owned:
            self.layer = layer
        else:
            self.kept = [layer]

    def forward(self, x):
        layer = self.layer if "layer" in self._modules else self.kept[0]
        return torch.sqrt(layer(x))  # here


def test_a_layers_output_gradient_is_checked_in_its_parameters_gradients(monkeypatch, device):
    """Each value of a Linear's output gradient enters its weight's and bias's gradients
    (g^T x, sum(g)), so a NaN/Inf there leaves one there: the watch puts no pre-hook on
    such a layer's output and checks those parameter gradients after backward instead --
    also for a layer the model calls but does not own. The stop is the exact check's."""
    from mldebug.watch import module_tier
    hooked = []

    class Counted(module_tier._GradSentinel):
        __slots__ = ()

        def __init__(self, watch, record, index):
            super().__init__(watch, record, index)
            hooked.append(record[0])

    monkeypatch.setattr(module_tier, "_GradSentinel", Counted)
    from transformers.pytorch_utils import Conv1D
    x = torch.randn(2, 4, device=device)
    for owned, kind in ((True, nn.Linear), (False, nn.Linear), (True, Conv1D)):
        stops = {}
        for exact in (False, True):
            torch.manual_seed(0)
            model = SqrtOfLayer(device, owned, kind)
            hooked.clear()
            got, w = collect(exact=exact)
            with w:
                model(x).sum().backward()
            stops[exact] = [(v.stage, v.kind, v.node, v.torch_op, v.line) for v in got]
            if not exact:   # only the model's output has a pre-hook (kept for a replay)
                assert hooked == [model], (owned, hooked)
        assert stops[False] == stops[True] == [
            ("backward", "inf", "SqrtBackward0", "torch.sqrt", lineno(SqrtOfLayer.forward))
        ], owned


def test_which_layers_leave_their_output_gradient_to_their_parameters():
    """Not a layer whose parameters get no gradient (frozen, none), one with a hook that
    may change its gradients, an embedding that drops a row's gradient (padding_idx), a
    transposed convolution (an output no input reaches adds only to the bias), a layer
    without parameters; and not under DDP/FSDP (safe.grads_local), where the gradients
    after backward are averaged or sharded."""
    from mldebug.watch.safe import grads_local, params_show_grad
    assert all(params_show_grad(m) for m in (
        nn.Linear(2, 2), nn.Conv2d(1, 1, 3), nn.LayerNorm(2), nn.BatchNorm1d(2),
        nn.Embedding(3, 2), nn.Linear(2, 2, bias=False)))
    from transformers.pytorch_utils import Conv1D     # GPT-2's Linear: addmm(b, x, W)
    assert params_show_grad(Conv1D(3, 2))
    hooked = nn.Linear(2, 2)
    hooked.register_full_backward_hook(lambda m, gi, go: None)
    assert not any(params_show_grad(m) for m in (
        nn.Linear(2, 2).requires_grad_(False), hooked, nn.LayerNorm(2, elementwise_affine=False),
        nn.Embedding(3, 2, padding_idx=0), nn.ConvTranspose2d(1, 1, 3), nn.ReLU(),
        nn.Sequential(nn.Linear(2, 2))))
    assert grads_local()
    handle = nn.modules.module.register_module_full_backward_hook(lambda m, gi, go: None)
    try:
        assert not grads_local()
    finally:
        handle.remove()
    assert grads_local()


def test_a_mask_and_its_softmax_outside_modules_are_not_stops(device):
    """-inf made from a constant, then carried by temporaries: on a device the window is
    read after they are freed; what they held is taken to come from the judged mask."""
    got, w = collect()
    with w:
        mask = torch.full((4, 4), float("-inf"), device=device).triu(1)
        attn = torch.softmax(torch.randn(4, 4, device=device) + mask, dim=-1)
        nn.Linear(4, 4).to(device)(attn)       # a module call: the window is read
    assert got == [] and bool(attn.isfinite().all())


def test_a_forward_stop_in_a_module_is_the_only_stop_of_the_steps_that_follow(device):
    """The NaN made by a sqrt inside the model flows into the loss, the gradients, the
    parameters and every later step: none of that is a new stop (the backward replay
    would otherwise make the forward's stop again; on a device the loss ops outside
    modules are read after their inputs are freed)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), RootFeature(), nn.Linear(8, 1))
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    got, w = collect()
    with w:
        model[2].forward = lambda x: torch.sqrt(x - 10)   # negative: NaN
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(16, 4, device=device)).pow(2).mean().backward()
            opt.step()
    assert [(v.stage, v.op, v.module) for v in got] == [("forward", "aten.sqrt.default", "2")]
    assert bool(model[0].weight.isnan().all())


def test_the_rng_a_replay_restores_is_torchs_own_state(monkeypatch):
    """`tiers.rng_state()` (taken as every module call starts, for its replay) reads the
    generators in C: the CPU state is `torch.get_rng_state()`'s, and CUDA's is one state
    per device in the order `torch.cuda.set_rng_state_all` writes them back (stood in for
    here by two CPU generators where CUDA is missing; none before CUDA starts)."""
    from mldebug.watch import tiers
    torch.manual_seed(3)
    torch.rand(5)
    if torch.cuda.is_available():
        torch.rand(5, device="cuda")     # (CUDA started, its generators moved on)
    cpu, cuda = tiers.rng_state()
    assert torch.equal(cpu, torch.get_rng_state())
    if torch.cuda.is_available():
        expected = torch.cuda.get_rng_state_all()
        assert cuda is not None and len(cuda) == len(expected)
        assert all(torch.equal(a, b) for a, b in zip(cuda, expected))
    else:
        assert cuda is None
        gens = (torch.Generator().manual_seed(1), torch.Generator().manual_seed(2))
        monkeypatch.setattr(torch.cuda, "default_generators", gens)
        cpu, cuda = tiers.rng_state()
        assert [s.tolist() for s in cuda] == [g.get_state().tolist() for g in gens]
        assert cuda[0].tolist() != cuda[1].tolist()
    cpu[0] ^= 1                      # a copy: the generator's own state is untouched
    assert not torch.equal(cpu, torch.get_rng_state())
