"""The device ledger (mldebug/watch/step_ledger.py): on a device every check of a training
step waits for one read at `optimizer.step()`, and what that read finds is judged as the
window that made it would have judged it at once.

Each test trains a few healthy steps first (from the second step on, the checks wait for
the step's read), makes a NaN/Inf at a later step, and asserts the stop the host path makes
at once: the same op, module, line, stage and step, and no second stop after it. The
`device` fixture runs each on the CPU (host path: no ledger), on the CPU taking the device
path (what CI can run of it) and on CUDA where there is one.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from mldebug.core.errors import NonFiniteError
from mldebug.watch import watch

from test_rerun import lineno

BAD_STEP = 3


class Gate(nn.Module):
    """Its own forward code makes a NaN at step BAD_STEP (sqrt of a negative), else
    nothing: a forward stop inside the model."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def forward(self, x):
        if self.step == BAD_STEP:
            x = torch.sqrt(x - 1e6)  # here
        return x


class RootAtMin(nn.Module):
    """sqrt(x - min(x)) at step BAD_STEP: finite forward, an infinite derivative at the
    minimum: a backward stop."""

    def __init__(self):
        super().__init__()
        self.step = 0

    def forward(self, x):
        if self.step == BAD_STEP:
            return torch.sqrt(x - x.detach().amin())  # here
        return x


def train(device, model, make_loss=None, opt_cls=torch.optim.SGD, steps=5, action="break",
          hook=None, **opt_kwargs):
    torch.manual_seed(0)
    model = model.to(device)
    opt = opt_cls(model.parameters(), **(opt_kwargs or {"lr": 0.01}))
    x = torch.randn(16, 8, device=device)
    y = torch.randint(0, 4, (16,), device=device)
    make_loss = make_loss or (lambda out, step: F.cross_entropy(out, y))
    got = []
    with watch(on_violation=got.append, action=action) as w:
        for step in range(steps):
            for m in model.modules():
                if hasattr(m, "step"):
                    m.step = step
            opt.zero_grad()
            loss = make_loss(model(x), step)
            loss.backward()
            if hook is not None:
                hook(step, model)
            opt.step()  # step
    return got, model, w


def on_host(device) -> bool:
    from mldebug.watch import checks
    return device == "cpu" and checks.HOST_READS


def mlp(*middle):
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), *middle, nn.Linear(16, 4))


def setup(device, model):
    """MODEL on DEVICE, seeded, with SGD and a batch of 16."""
    torch.manual_seed(0)
    model = model.to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.01), torch.randn(16, 8, device=device)


def stops(got):
    return [(v.stage, v.op, v.module, v.line, v.step) for v in got]


def test_a_forward_nan_at_a_later_step_is_pinned_to_its_op(device):
    got, model, _ = train(device, mlp(Gate()))
    assert stops(got) == [("forward", "aten.sqrt.default", "2", lineno(Gate.forward),
                           BAD_STEP)]
    assert got[0].frame.f_code is Gate.forward.__code__     # paused in the replay, there
    assert bool(model[0].weight.isnan().any())              # (`c`: the step went on)


def test_a_nan_in_the_loss_region_at_a_later_step_is_pinned_to_its_op(device):
    def loss(out, step):
        return torch.log(out.pow(2).mean() - (1e6 if step == BAD_STEP else 0))  # here

    got, _, _ = train(device, mlp(), make_loss=loss)
    assert stops(got) == [("forward", "aten.log.default", "", lineno(
        test_a_nan_in_the_loss_region_at_a_later_step_is_pinned_to_its_op), BAD_STEP)]


def test_an_infinite_derivative_at_a_later_step_is_pinned_to_its_backward_op(device):
    got, _, _ = train(device, mlp(RootAtMin()))
    assert [(v.stage, v.node, v.module, v.line, v.step) for v in got] == [
        ("backward", "SqrtBackward0", "2", lineno(RootAtMin.forward), BAD_STEP)]


def test_an_optimizer_state_that_overflows_at_a_later_step_names_its_step_and_line(device):
    """Adam's exp_avg_sq overflows at step BAD_STEP (a gradient of 1e25): on a device
    the update is read with the next step's read; the stop still names that step and the
    `opt.step()` line, and the gradient as it was before the update (finite)."""
    def scale(step, model):
        if step == BAD_STEP:
            with torch.no_grad():
                model[0].weight.grad.fill_(1e25)

    got, _, _ = train(device, mlp(), opt_cls=torch.optim.Adam, hook=scale, lr=0.1)
    assert [(v.stage, v.torch_op, v.param, v.created, v.step, v.line) for v in got] == [
        ("optimizer", "Adam.step", "0.weight", True, BAD_STEP, lineno(train, "# step"))]
    assert "exp_avg_sq" in got[0].text


class NewBufferEachStep(torch.optim.Optimizer):
    """Momentum written out of place: each step puts a new tensor in its state (its
    update clamped, so that only the state goes non-finite)."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    state = self.state[p]
                    state["buf"] = 0.9 * state.get("buf", torch.zeros_like(p)) + 10 * p.grad
                    p.add_(state["buf"].clamp(-1, 1), alpha=-group["lr"])


@pytest.mark.parametrize("change", ["new state tensor", "load_state_dict", "added group"])
def test_the_tensors_a_step_writes_are_found_again_when_the_optimizer_changes(device,
                                                                          change):
    """The watch keeps the list of what an optimizer's step writes from one step to the
    next (update.StepTensors): a state tensor replaced, a state loaded, a parameter
    group added are checked all the same. At BAD_STEP a finite gradient of 1e37 to 1e38
    makes the optimizer's state infinite while the parameter stays finite, so only the
    state's check can stop there."""
    extra = nn.Linear(8, 4)                     # (in the optimizer from step 2 on)

    def model_and_extra():
        return nn.ModuleDict({"body": mlp(), "extra": extra})

    class Both(nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model_and_extra()

        def forward(self, x):
            return self.m["body"](x) + self.m["extra"](x)

    opts = {"new state tensor": (NewBufferEachStep, {}),
            "load_state_dict": (torch.optim.Adam, {"lr": 0.1}),
            "added group": (NewBufferEachStep, {})}
    opt_cls, kwargs = opts[change]
    torch.manual_seed(0)
    model = Both().to(device)
    params = list(model.m["body"].parameters())
    if change != "added group":
        params += list(model.m["extra"].parameters())
    opt = opt_cls(params, **kwargs)
    x = torch.randn(16, 8, device=device)
    got = []
    with watch(on_violation=got.append):
        for step in range(5):
            opt.zero_grad()
            model(x).pow(2).mean().backward()
            if step == 2 and change == "load_state_dict":
                opt.load_state_dict(copy.deepcopy(opt.state_dict()))   # (new tensors)
            if step == 2 and change == "added group":
                opt.add_param_group({"params": list(model.m["extra"].parameters())})
            if step == BAD_STEP:
                with torch.no_grad():
                    model.m["extra"].weight.grad.fill_(1e37 if change == "load_state_dict"
                                                       else 1e38)
            opt.step()  # step
    assert [(v.stage, v.param, v.step, v.line) for v in got] == [
        ("optimizer", "m.extra.weight", BAD_STEP,
         lineno(test_the_tensors_a_step_writes_are_found_again_when_the_optimizer_changes,
                "# step"))]
    assert ("exp_avg_sq" if change == "load_state_dict" else "'buf'") in got[0].text
    assert all(bool(p.isfinite().all()) for p in model.parameters())


class RootWhen(nn.Module):
    """Linear, tanh, then sqrt(x - min(x)) when called with bad=True (an infinite
    derivative at the minimum), then Linear: the bad call is told by its arguments, so a
    re-run of it at a later read is bad again."""

    def __init__(self):
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x, bad=False):
        h = torch.tanh(self.lin1(x))
        if bad:
            h = torch.sqrt(h - h.detach().amin())  # here
        return self.lin2(h)


@pytest.mark.parametrize("bad_micro", [0, 1])
def test_accumulated_backwards_are_read_before_the_next_and_pinned(device, bad_micro):
    """Two backwards a step (gradient accumulation): the first one's judge is read
    when the second starts (it keeps its gradients), and its stop is pinned, naming
    the micro-batch (the first or the second: what flows into the step from the
    first is not a new stop)."""
    model, opt, x = setup(device, RootWhen())
    got = []
    with watch(on_violation=got.append) as w:
        for step in range(5):
            for micro in range(2):
                model(x, bad=(step, micro) == (BAD_STEP, bad_micro)).pow(2).mean().backward()
                if step == 1 and micro == 0:     # (the host path holds nothing)
                    assert w._ledger.backwards == (0 if on_host(device) else 1)
            opt.step()
            opt.zero_grad()
    assert [(v.stage, v.node, v.line, v.step, v.micro_batch) for v in got] == [
        ("backward", "SqrtBackward0", lineno(RootWhen.forward), BAD_STEP, bad_micro + 1)]
    assert f"[backward, step {BAD_STEP}, micro-batch {bad_micro + 1}]" in got[0].headline()


@pytest.mark.parametrize("bad_step", [1, BAD_STEP])
@pytest.mark.parametrize("bad_micro", [0, 1])
@pytest.mark.parametrize("stage", ["forward", "backward"])
@pytest.mark.parametrize("exact", [True, False], ids=["exact", "roots"])
def test_a_stop_at_the_op_names_the_micro_batch(device, exact, stage, bad_micro, bad_step):
    """A stop made at the op itself (`exact=True`; the data handling's per-op check)
    names the micro-batch under gradient accumulation as a re-run's stop does; a NaN
    made before a model call belongs to the next backward's micro-batch. At step 1 the
    accumulation is known from step 0, whose backwards ran op by op (the roots were
    being learned)."""
    model, opt, x = setup(device, RootWhen())
    got = []
    with watch(on_violation=got.append, exact=exact):
        for step in range(5):
            for micro in range(2):
                bad = (step, micro) == (bad_step, bad_micro)
                if stage == "forward" and bad:
                    x_in = torch.log(x - 100.0)   # NaN made by the data handling
                else:
                    x_in = x
                model(x_in, bad=bad and stage == "backward").pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    # (one stop: what the first micro-batch's NaN adds to the second's gradients
    # descends from it)
    assert [(v.stage, v.step, v.micro_batch) for v in got] == [
        (stage, bad_step, bad_micro + 1)]
    assert f"[{stage}, step {bad_step}, micro-batch {bad_micro + 1}]" in got[0].headline()


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "roots"])
def test_backwards_without_an_optimizer_name_no_micro_batch(device, exact):
    """No optimizer step, no step to count micro-batches in (tests, a hand-written
    update): a stop after several backwards names neither."""
    model, _, x = setup(device, RootWhen())
    got = []
    with watch(on_violation=got.append, exact=exact):
        for i in range(4):
            model(x, bad=i == 3).pow(2).mean().backward()
    assert [(v.stage, v.step, v.micro_batch) for v in got] == [("backward", None, None)]


def test_a_gradient_repaired_in_place_is_judged_afresh(device):
    """After a stop in backward the program repairs the gradient in place (its
    non-finite values set to the largest float) and accumulates the next backward into
    it: a NaN/Inf that backward makes again is a new stop, not taken for the one judged
    before (the gradient is asked exactly whether it still holds one: a sum of the
    largest floats overflows)."""
    model, _, x = setup(device, RootWhen())
    model.lin1.bias = None               # (the Inf gradient: lin1.weight's alone)
    got = []
    with watch(on_violation=got.append):
        for i in range(5):
            model(x, bad=i >= 3).pow(2).mean().backward()
            if i == 3:
                g = model.lin1.weight.grad
                g[~torch.isfinite(g)] = torch.finfo(g.dtype).max
    assert [(v.stage, v.node, v.line) for v in got] == [
        ("backward", "SqrtBackward0", lineno(RootWhen.forward))] * 2


def test_an_eval_forward_between_steps_is_read_at_its_end(device):
    """A forward under no_grad (evaluation) has no step read to wait for: read when it
    returns, after what the training step left waiting."""
    model, opt, x = setup(device, mlp())
    got = []
    with watch(on_violation=got.append):
        for step in range(3):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        with torch.no_grad():
            model(x * float("nan"))
            assert [(v.stage, v.op) for v in got] == [("forward", "aten.mul.Tensor")]


def test_raise_at_the_step_read_leaves_the_parameters_as_they_were(device):
    """action='raise': the stop is raised from `opt.step()` before the update, so the
    bad gradients never reach the parameters."""
    before = {}

    def keep(step, model):
        if step == BAD_STEP:
            before.update({k: v.detach().clone() for k, v in model.state_dict().items()})

    with pytest.raises(NonFiniteError) as err:
        train(device, mlp(RootAtMin()), action="raise", hook=keep)
    assert err.value.violation.node == "SqrtBackward0"
    assert err.value.violation.step == BAD_STEP


def test_a_healthy_run_trains_bitwise_the_same(device):
    torch.manual_seed(0)
    plain = mlp(nn.Dropout(0.2), nn.LayerNorm(16)).to(device)
    watched = mlp(nn.Dropout(0.2), nn.LayerNorm(16)).to(device)
    watched.load_state_dict(plain.state_dict())
    x = torch.randn(16, 8, device=device)
    for model, on in ((plain, False), (watched, True)):
        torch.manual_seed(1)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        w = watch(action="raise") if on else contextlib.nullcontext()
        with w:
            for _ in range(4):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                opt.step()
    for a, b in zip(plain.parameters(), watched.parameters()):
        assert torch.equal(a, b)


def test_on_a_device_a_healthy_step_is_read_once():
    """The count that does not depend on the machine: on the device path (the CPU
    standing in), a healthy training step reads the host once, at `opt.step()`."""
    from mldebug.watch import core, step_ledger
    reads = []
    real = step_ledger.StepLedger.take

    def take(self):
        reads.append(bool(self.holds_tensors()))
        return real(self)

    core.simulate_device(True)
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(step_ledger.StepLedger, "take", take)
            torch.manual_seed(0)
            model = mlp(nn.LayerNorm(16))
            opt = torch.optim.AdamW(model.parameters(), lr=0.01)
            x = torch.randn(16, 8)
            with watch(action="raise"):
                for step in range(4):
                    opt.zero_grad()
                    F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long)).backward()
                    if step == 3:
                        reads.clear()
                    opt.step()
                reads_at_step = list(reads)
    finally:
        core.simulate_device(False)
    assert reads_at_step == [True]


def test_forwards_with_no_step_after_them_are_read_every_few_calls(device):
    """Forwards with gradients but no backward nor step (a gradient-enabled evaluation
    after training): each waiting call keeps its arguments, so at most MAX_CALLS wait,
    and a NaN among them is found before the loop ends."""
    from mldebug.watch import step
    model, opt, x = setup(device, mlp())
    got = []
    with watch(on_violation=got.append) as w:
        for _ in range(2):
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        waiting = []
        for i in range(12):
            model(x * float("nan") if i == 6 else x)
            waiting.append(w._ledger.calls)
        found = [(v.stage, v.op) for v in got]
    assert max(waiting) <= step.MAX_CALLS
    assert found == [("forward", "aten.mul.Tensor")]


class ExpHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 1)

    def forward(self, x):
        return self.lin(x).exp()  # here


def test_a_weight_written_between_backward_and_step_is_read_before_the_write(device):
    """Weight clipping after backward, outside the optimizer: at step BAD_STEP the head's
    weight is large and exp overflows; the clip then makes it small again. On a device
    the clip comes before the step's read, so the watch reads first: the re-run computes
    what the call computed (with the large weight) and pins the exp, as on the host."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), ExpHead()).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(32, 8, device=device)
    got = []
    with watch(on_violation=got.append):
        for step in range(6):
            opt.zero_grad()
            if step == BAD_STEP:
                with torch.no_grad():
                    model[2].lin.weight.fill_(1e3)
            model(x).mean().backward()
            with torch.no_grad():
                model[2].lin.weight.clamp_(-1.0, 1.0)
            opt.step()
    assert [(v.op, v.module, v.line, v.step) for v in got] == [
        ("aten.exp.default", "2", lineno(ExpHead.forward), BAD_STEP)]


def test_a_lightning_step_with_its_closure_is_read_after_the_closure(device):
    """Lightning runs forward and backward inside `optimizer.step(closure)`: the read
    comes when the closure returns, before the update, and the stop is the host path's."""
    import warnings
    L = pytest.importorskip("lightning")

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = mlp(Gate())

        def training_step(self, batch, i):
            self.net[2].step = self.global_step
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(96, 8), torch.randint(0, 4, (96,)))
    got = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with watch(on_violation=got.append):
            L.Trainer(max_steps=6, accelerator="gpu" if device == "cuda" else "cpu",
                      devices=1, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False).fit(
                Model(), torch.utils.data.DataLoader(data, batch_size=16))
    assert stops(got) == [("forward", "aten.sqrt.default", "2", lineno(Gate.forward),
                           BAD_STEP)]


def test_a_checkpointed_forwards_nan_is_one_stop_through_backward_and_after(device):
    # the loss's dry run in backward reads at once: the forward waiting for the step's
    # read is judged first, so what flows from its NaN (the loss's backward, the update,
    # a view of a parameter read after the step) is known, not a new stop
    from torch.utils.checkpoint import checkpoint

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return torch.log(self.fc(x) - 100.0).relu()  # here

    torch.manual_seed(0)
    blocks = nn.ModuleList([Block() for _ in range(3)]).to(device)
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    with watch(on_violation=lambda v: None) as w:
        h = torch.randn(4, 8, device=device)
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16):
            for b in blocks:
                h = checkpoint(b, h, use_reentrant=False)
            loss = h.float().pow(2).mean()
        loss.backward()
        opt.step()
        weights = [p.detach().double().sum() for p in blocks.parameters()]
    assert [(v.stage, v.op, v.line) for v in w.violations] == [
        ("forward", "aten.log.default", lineno(Block.forward))], w.violations
    assert all(bool(x.isnan()) for x in weights)


def test_the_device_path_variable_reaches_a_child_process():
    # (what `pytest --device-path` sets, so that the CLI's tests take that path too)
    import subprocess
    import sys

    from conftest import clean_env
    probe = ("from mldebug.watch import dispatch; from mldebug.record import stats; "
             "print(dispatch._HOST_READS, stats._HOST[0])")
    for value, expected in (("1", "False False"), ("0", "True True")):
        out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                             env=clean_env(MLDEBUG_SIMULATE_DEVICE=value), timeout=120)
        assert out.stdout.split() == expected.split(), out.stderr
