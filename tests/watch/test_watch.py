"""Engine tests of mldebug.watch: the planted-bug programs in tests/programs/, the stop
rule, clean-up, and that watching never changes results."""
from __future__ import annotations

import math
import os
import runpy

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.modules.module as module_hooks
import torch.optim.optimizer as optim_hooks

import mldebug
from mldebug.core import records as records_mod
from mldebug.core import session as session_mod
from mldebug.core.errors import NonFiniteError, UsageError
from mldebug.watch import Watch, active_watch, allow, watch

from conftest import TESTS  # noqa: E402

PROGRAMS = str(TESTS / "programs")


def program(name: str) -> str:
    return os.path.join(PROGRAMS, name)


def marked_line(path: str, marker: str = "# here") -> int:
    with open(path, encoding="utf-8") as fh:
        for number, text in enumerate(fh, 1):
            if text.rstrip().endswith(marker):
                return number
    raise AssertionError(f"no {marker!r} line in {path}")


def line_of(path: str, text: str) -> int:
    with open(path, encoding="utf-8") as fh:
        for number, line in enumerate(fh, 1):
            if text in line:
                return number
    raise AssertionError(f"{text!r} not in {path}")


def run_watched(name, **kwargs):
    """Run a program under a watch; [(violation, line of the live frame at the stop)]."""
    got = []

    def collect(v):
        got.append((v, v.frame.f_lineno if v.frame is not None else 0))

    with watch(on_violation=collect, **kwargs):
        runpy.run_path(program(name), run_name="__main__")
    return got


def hook_state():
    return (
        torch._C._len_torch_dispatch_stack(),
        len(module_hooks._global_forward_pre_hooks),
        len(module_hooks._global_forward_hooks),
        len(module_hooks._global_forward_hooks_always_called),
        len(optim_hooks._global_optimizer_pre_hooks),
        len(optim_hooks._global_optimizer_post_hooks),
        active_watch(),
    )


@pytest.fixture(autouse=True)
def clean_state():
    before = hook_state()
    yield
    assert hook_state() == before


# -- the planted bugs ------------------------------------------------------------------
EXPECTED = {
    "softmax_log_underflow.py": dict(
        kind="inf", op="aten.log.default", torch_op="torch.log", module="1",
        module_type="NaiveLogSoftmax", stage="forward", created=True, culprit="",
        function="forward"),
    "corrupt_sample.py": dict(
        kind="nan", op="aten.addmm.default", module="0", module_type="Linear",
        stage="forward", created=False, culprit="input 1 (mat1)", function="main"),
    "backward_inf.py": dict(
        kind="inf", op="aten.div.Tensor", torch_op="torch.sqrt", node="SqrtBackward0",
        module="2", module_type="RootFeature", stage="backward", created=True,
        function="forward"),
    # the step runs without the per-op check; its result is checked (tiers.py)
    "optimizer_blowup.py": dict(
        kind="inf", op="", torch_op="SGD.step", stage="optimizer",
        param="0.weight", module="0", module_type="Linear", created=True, step=0),
    "fp16_overflow.py": dict(
        kind="inf", op="aten.mm.default", module="attn", module_type="Scores",
        stage="forward", created=True),
    "fully_masked_row.py": dict(
        kind="nan", op="aten._softmax.default", module="attn", module_type="Attention",
        stage="forward", created=True, culprit="input 0 (self)"),
    "gpt2_nan.py": dict(
        kind="nan", op="aten.embedding.default", module="transformer.wte",
        module_type="Embedding", stage="forward", created=False, culprit="input 0 (weight)"),
}


# --watch exact: the per-op check everywhere; the optimizer's stop names the aten op
EXPECTED_EXACT = dict(EXPECTED, **{"optimizer_blowup.py": dict(
    EXPECTED["optimizer_blowup.py"], op="aten.add_.Tensor", torch_op="Tensor.add_")})


@pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_planted_bug_stops_at_its_line(name, exact):
    if name == "gpt2_nan.py":
        pytest.importorskip("transformers")
    path = program(name)
    got = run_watched(name, exact=exact)
    assert got, f"{name}: no stop"
    v, pause_line = got[0]
    assert (v.file, v.line) == (path, marked_line(path)), v.headline()
    for field, value in (EXPECTED_EXACT if exact else EXPECTED)[name].items():
        assert getattr(v, field) == value, (field, v.headline())
    assert v.count > 0 and v.output is not None and v.inputs
    if name == "backward_inf.py":
        # reported against the sqrt line, paused in the live frame at loss.backward()
        assert pause_line == line_of(path, "loss.backward()")
        assert v.posinf + v.neginf == v.count
    else:
        assert v.frame is not None


@pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_planted_bug_stops_once(name, exact):
    """After the first stop, what flows on from it is not a new stop."""
    if name == "gpt2_nan.py":
        pytest.importorskip("transformers")
    assert len(run_watched(name, exact=exact)) == 1


@pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])
@pytest.mark.parametrize("name", ["causal_mask_ok.py", "healthy_train.py"])
def test_healthy_programs_never_stop(name, exact):
    assert run_watched(name, exact=exact) == []


def test_healthy_training_is_bitwise_identical_with_the_watch():
    path = program("healthy_train.py")
    plain = runpy.run_path(path)
    rng_plain = torch.get_rng_state()
    with watch(action="raise") as w:
        watched = runpy.run_path(path)
    rng_watched = torch.get_rng_state()
    assert w.violations == []
    assert torch.equal(rng_plain, rng_watched)
    p_plain = dict(plain["model"].named_parameters())
    p_watched = dict(watched["model"].named_parameters())
    assert p_plain.keys() == p_watched.keys()
    for key in p_plain:
        assert torch.equal(p_plain[key], p_watched[key]), key
        assert p_plain[key].requires_grad == p_watched[key].requires_grad
    for (k1, s1), (k2, s2) in zip(plain["opt"].state.items(), watched["opt"].state.items()):
        for name in s1:
            assert torch.equal(torch.as_tensor(s1[name]), torch.as_tensor(s2[name])), name
    assert plain["model"].training == watched["model"].training


FOREACH_WRITES = {
    "add_ (scalar)": lambda xs, ys: torch._foreach_add_(xs, 1.0),
    "add_ (list)": lambda xs, ys: torch._foreach_add_(xs, ys, alpha=-0.1),
    "mul_ (safe: |s| <= 1)": lambda xs, ys: torch._foreach_mul_(xs, 0.5),
    "zero_": lambda xs, ys: torch._foreach_zero_(xs),
    "copy_": lambda xs, ys: torch._foreach_copy_(xs, ys),
    "lerp_": lambda xs, ys: torch._foreach_lerp_(xs, ys, 0.5),
}


@pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])
@pytest.mark.parametrize("write", list(FOREACH_WRITES))
def test_an_in_place_foreach_op_moves_version_counters_as_without_the_watch(write, exact):
    # under any dispatch mode torch's CPU foreach kernels leave the counters where they
    # were: autograd then misses the write to a tensor saved for backward
    def versions_moved():
        xs = [torch.ones(3), torch.ones(2, 2), torch.ones(1)]
        ys = [torch.full_like(x, 2.0) for x in xs]
        before = [x._version for x in xs]
        FOREACH_WRITES[write](xs, ys)
        return [x._version - v for x, v in zip(xs, before)], xs

    plain, plain_values = versions_moved()
    with watch(action="raise", exact=exact) as w:
        watched, watched_values = versions_moved()
    assert w.violations == []
    assert plain == [1, 1, 1] and watched == plain
    assert all(torch.equal(a, b) for a, b in zip(plain_values, watched_values))


def test_an_optimizers_own_inf_in_a_temporary_is_judged_by_what_reaches_the_parameters():
    # RAdam (foreach) divides by a rectification term of exactly 0 for its first steps
    # and takes the reciprocal of the -inf: nothing non-finite reaches a parameter or the
    # state. Under the per-op check everywhere (exact) that is no stop, and the bits are
    # the plain run's
    def train(watched):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        opt = torch.optim.RAdam(model.parameters(), lr=1e-2, foreach=True)
        x, y = torch.randn(32, 8), torch.randint(0, 3, (32,))
        for _ in range(3):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    plain = train(False)
    with watch(action="raise", exact=True) as w:
        watched = train(True)
    assert w.violations == []
    assert all(torch.equal(a, b) for a, b in zip(plain, watched))


class _ScaledSGD(torch.optim.Optimizer):
    def __init__(self, params, lr, scale):
        super().__init__(params, {"lr": lr, "scale": scale})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                update = p.grad / group["scale"]   # here: a scale of 0
                p.add_(update, alpha=-group["lr"])


def test_an_inf_an_optimizer_makes_in_a_temporary_stops_where_it_reaches_a_parameter():
    model = nn.Linear(4, 2)
    opt = _ScaledSGD(model.parameters(), lr=0.1, scale=0.0)
    model(torch.randn(8, 4)).pow(2).mean().backward()
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise", exact=True):
            opt.step()
    v = info.value.violation
    assert v.stage == "optimizer" and v.line == _marker_line_of(_ScaledSGD.step), v.headline()
    assert v.reached, v.headline()


class _DataSGD(torch.optim.Optimizer):
    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.data.add_(p.grad, alpha=-group["lr"])   # here: the lr overflows


def test_an_optimizer_writing_a_parameter_through_data_is_judged_as_writing_the_parameter():
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = _DataSGD(model.parameters(), lr=3e38)
    (model(torch.randn(8, 4)).pow(2).mean() * 100).backward()
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise", exact=True):
            opt.step()
    v = info.value.violation
    assert (v.stage, v.line, v.created) == ("optimizer", _marker_line_of(_DataSGD.step),
                                            True), v.headline()


def test_under_a_loss_scaler_a_masked_rows_nan_in_float32_is_still_a_stop():
    # the scaler excuses a NaN that backward makes from the Infs of its own overflow
    # (float16); a float32 run's fully masked row makes its NaN with no overflow at all
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    x = torch.randn(3, 4)
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise"):
            for step in range(10):
                bias = torch.zeros(3, 4)
                if step == 5:
                    bias[2] = float("-inf")
                loss = torch.logsumexp(lin(x) + bias, -1).clamp_min(-10).sum()
                opt.zero_grad()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
    v = info.value.violation
    assert (v.kind, v.stage, v.step) == ("nan", "backward", 5), v.headline()


def _marker_line_of(fn) -> int:
    import inspect
    lines, start = inspect.getsourcelines(fn)
    return start + next(i for i, line in enumerate(lines) if "# here" in line)


# -- raising ---------------------------------------------------------------------------
def test_raise_reaches_user_code_in_forward_and_cleans_up():
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise"):
            runpy.run_path(program("softmax_log_underflow.py"))
    v = info.value.violation
    assert v.op == "aten.log.default" and v.module == "1"
    assert isinstance(info.value, FloatingPointError)


def test_raise_reaches_user_code_from_backward():
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise"):
            runpy.run_path(program("backward_inf.py"))
    assert info.value.violation.node == "SqrtBackward0"
    assert info.value.violation.stage == "backward"


def test_raise_from_optimizer_step_leaves_no_stage_behind():
    with watch(action="raise") as w:
        with pytest.raises(NonFiniteError):
            runpy.run_path(program("optimizer_blowup.py"))
        assert w._opt_depth == 0 and w._top is None
        with pytest.raises(NonFiniteError) as info:
            torch.log(torch.zeros(2))
        assert info.value.violation.stage == "forward"


def test_close_after_the_program_raises_something_else():
    model = nn.Sequential(nn.Linear(2, 2))

    def boom(module, args):
        raise KeyError("user bug")

    handle = model[0].register_forward_pre_hook(boom)
    try:
        with pytest.raises(KeyError):
            with watch(action="raise") as w:
                model(torch.ones(1, 2))
        assert not w.enabled
    finally:
        handle.remove()


def test_batch_session_stop_cleans_up():
    old = session_mod._current
    session_mod.install(session_mod.Session(batch=True, out=open(os.devnull, "w")))
    try:
        with pytest.raises(records_mod.BatchStop):
            with watch():        # on_violation=None: the session decides
                nn.Sequential(nn.Identity())(torch.log(torch.zeros(3)))
        assert session_mod.current().stops[0].op == "aten.log.default"
    finally:
        session_mod._current = old


# -- the rule --------------------------------------------------------------------------
def test_propagation_is_not_a_new_stop_but_a_new_creation_is(device):
    # (device: also through the device window, judged at its read)
    with watch(on_violation=lambda v: None) as w:
        a = torch.log(torch.zeros(4))          # -Inf created: stop 1
        b = a * 2 + 1                          # flows on
        c = torch.softmax(torch.stack([b, b]), -1)   # NaN made of those Infs: consequence
        d = c.sum() + torch.ones(1)            # flows on
        e = torch.exp(torch.full((3,), 100.0))  # new overflow: stop 2
        f = torch.zeros(2) / torch.zeros(2)     # new NaN: stop 3
        del b, d, e, f
    ops = [v.op for v in w.violations]
    assert ops == ["aten.log.default", "aten.exp.default", "aten.div.Tensor"]


def test_constant_infs_are_not_stops_but_inf_all_stops_on_them():
    def masked():
        x = torch.randn(3, 3)
        mask = torch.triu(torch.ones(3, 3, dtype=torch.bool), 1)
        y = x.masked_fill(mask, float("-inf"))
        z = torch.full((2,), float("inf"))
        w2 = torch.where(mask, float("-inf"), x)
        return torch.softmax(y, -1), z, w2

    with watch(on_violation=lambda v: None) as w:
        masked()
    assert w.violations == []
    with watch(on_violation=lambda v: None, break_on=("nan", "inf-all")) as w:
        masked()
    assert w.violations[0].op == "aten.masked_fill.Scalar"
    assert w.violations[0].created is False
    assert "value" in w.violations[0].culprit


def test_nan_from_outside_stops_once():
    data = torch.from_numpy(__import__("numpy").array([1.0, float("nan"), 3.0]))
    with watch(on_violation=lambda v: None) as w:
        y = data * 2                    # first op that sees it: stop
        z = data + y                    # the same NaN again: no stop
        del z
    assert len(w.violations) == 1
    v = w.violations[0]
    assert (v.kind, v.op, v.created, v.culprit) == ("nan", "aten.mul.Tensor", False,
                                                      "input 0 (self)")


def test_inf_from_outside_is_not_a_stop():
    data = torch.tensor([1.0, float("inf")])
    with watch(on_violation=lambda v: None) as w:
        _ = data * 2
    assert w.violations == []


def test_in_place_ops_are_judged_on_their_inputs_before_the_op(device):
    # (device: also through the device window, judged at its read)
    with watch(on_violation=lambda v: None) as w:
        x = torch.ones(3)
        x.div_(0.0)                       # created in place
        x.mul_(2.0)                       # flows on in place
        y = torch.zeros(3)
        y.log_()                          # a new one, in place
    assert [(v.op, v.created) for v in w.violations] == [
        ("aten.div_.Tensor", True), ("aten.log_.default", True)]


def test_a_written_value_is_not_blamed_on_the_op_that_made_the_tensor(device):
    # the device window reads what it holds later: a write since must not move the
    # blame to the op that made the tensor, nor hide what an op made
    with watch(on_violation=lambda v: None) as w:
        x = torch.randn(5, 4)
        x[3, 1] = torch.from_numpy(np.array(np.nan, np.float32))   # data: no op makes it
        y = x * 2                         # where it is first read
        a = torch.zeros(3)
        b = a / a                         # made here ...
        b.nan_to_num_()                   # ... and written over before any read
    assert [(v.op, v.created) for v in w.violations] == [
        ("aten.mul.Tensor", False), ("aten.div.Tensor", True)]
    del y


def test_an_input_written_after_the_op_is_judged_as_the_op_read_it(device):
    """The device window judges an op at a later read: an input written since holds
    other values. Where the window knows what it held (an earlier op of the window wrote
    it), that is what is judged (the NaN copied into x after full_like read it is not
    taken for full_like's input); where it does not (a mask made before the watch), the
    input is read as it is, and a write to another part of it changes nothing."""
    inf = float("inf")
    mask = torch.zeros(4, 4).masked_fill(torch.ones(4, 4, dtype=torch.bool).triu(1), -inf)
    with watch(on_violation=lambda v: None) as w:
        scores = torch.randn(4, 4) + mask      # -inf flows in from the mask: no stop
        mask[3, :] = 0.0                       # another row, written later
        p = scores.softmax(-1)
        x = torch.randn(8, 4)
        marker = torch.full_like(x, float("nan"))   # a NaN written on purpose ...
        x.copy_(marker)                             # ... into x, after full_like read it
        del marker
        kept = (p, x)
    assert w.violations == []
    del kept


def test_what_a_module_writes_over_in_place_is_judged_as_it_was_made(device):
    # the device window holds `h` for a read after the model call: the model writing over
    # its input in place (ReLU(inplace=True) turns -inf into 0) must not hide what made it
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 2))
    with watch(on_violation=lambda v: None) as w:
        h = torch.log(torch.tensor([[1.0, 0.0, 2.0]]))      # -inf made here ...
        out = model(h)                                      # ... and written over
    assert [(v.op, v.created, v.kind) for v in w.violations] == [
        ("aten.log.default", True, "inf")]
    assert torch.isfinite(out).all()

    class Masked(nn.Module):             # (a keyword argument, written over the same way)
        def forward(self, x, *, mask):
            return x * mask.nan_to_num_()

    x = torch.ones(2, requires_grad=True)
    with watch(on_violation=lambda v: None) as w:
        mask = torch.tensor([1.0, 0.0]) / torch.tensor([1.0, 0.0])    # NaN made here
        out = Masked()(x, mask=mask)
    assert [(v.op, v.created, v.kind) for v in w.violations] == [
        ("aten.div.Tensor", True, "nan")]


def test_break_on_nan_stops_at_a_new_nan_after_an_inf_went_by(device):
    with watch(on_violation=lambda v: None, break_on=("nan",)) as w:
        y = torch.log(torch.tensor([1.0, 0.0]))      # an Inf: no stop under break_on nan
        z = y * 2
        r = torch.sqrt(torch.tensor([-1.0]))        # from a temporary that held no Inf
    assert [v.op for v in w.violations] == ["aten.sqrt.default"]
    del z, r


def test_views_and_uninitialized_memory_are_not_checked():
    with watch(on_violation=lambda v: None) as w:
        for _ in range(20):
            e = torch.empty(1000)
            e2 = torch.empty_like(e)
            e3 = e.new_empty(100)
            v = e[10:20].view(2, 5).t()
            del e2, e3, v
    assert w.violations == []


def test_integer_outputs_are_not_checked():
    with watch(on_violation=lambda v: None) as w:
        _ = torch.arange(10) * 3 + torch.tensor([1]).expand(10)
    assert w.violations == []


@pytest.mark.parametrize("context", ["no_grad", "inference_mode", "autocast_bf16"])
def test_coverage_under_grad_modes_and_autocast(context):
    model = nn.Sequential(nn.Linear(4, 4))
    x = torch.randn(2, 4)
    ctx = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode,
           "autocast_bf16": lambda: torch.autocast("cpu", dtype=torch.bfloat16)}[context]
    with watch(on_violation=lambda v: None) as w:
        with ctx():
            y = model(x)
            z = torch.log(y - y)  # log(0): -Inf created
    assert len(w.violations) == 1
    assert w.violations[0].op == "aten.log.default"
    assert z.dtype == (torch.bfloat16 if context == "autocast_bf16" else torch.float32)


def test_allow_exempts_ops_and_modules():
    with allow("log"):
        assert run_watched("softmax_log_underflow.py") == []
    assert run_watched("softmax_log_underflow.py") != []
    assert run_watched("softmax_log_underflow.py", allow=("aten.log.*",)) == []
    assert run_watched("fully_masked_row.py", allow=["attn"]) == []
    assert run_watched("fully_masked_row.py", allow=["a*"]) == []
    with pytest.raises(UsageError):
        allow("")


def test_allowed_nan_flowing_on_is_not_reported_downstream():
    with watch(on_violation=lambda v: None, allow=("log",)) as w:
        a = torch.log(-torch.ones(2))      # NaN, allowed
        b = a * 3                          # not "from outside"
        del b
    assert w.violations == []


# -- the handle ------------------------------------------------------------------------
def test_suspended_and_enabled():
    w = watch(on_violation=lambda v: None)
    try:
        assert w.enabled and active_watch() is w
        with w.suspended():
            assert not w.enabled
            torch.log(torch.zeros(1))
        assert w.violations == []
        torch.log(torch.zeros(1))
        assert len(w.violations) == 1
    finally:
        w.close()
        w.close()                       # idempotent
    assert not w.enabled and active_watch() is None
    w.start()                           # on again
    try:
        assert w.enabled
    finally:
        w.close()


def test_one_watch_at_a_time():
    with watch():
        with pytest.raises(UsageError):
            watch()


def test_bad_arguments_name_the_value():
    with pytest.raises(UsageError, match="action='stop'"):
        Watch(action="stop")
    with pytest.raises(ValueError, match="bogus"):
        Watch(break_on=("nan", "bogus"))


def test_the_callback_runs_suspended_so_the_prompt_can_evaluate():
    seen = []

    def prompt(v):
        seen.append(active_watch().enabled)
        torch.log(torch.zeros(1))       # a user expression at the prompt: not checked

    with watch(on_violation=prompt) as w:
        torch.log(torch.zeros(2))
    assert seen == [False] and len(w.violations) == 1


def test_mldebug_watch_is_callable_in_any_import_order():
    import mldebug.watch as module
    vars(mldebug).pop("watch", None)   # forget what the lazy attribute cached
    with mldebug.watch(on_violation=lambda v: None) as w:
        assert module.active_watch() is w
    with module(on_violation=lambda v: None) as w:
        assert mldebug.watch.active_watch() is w


def test_torch_compile_region_degrades_gracefully():
    pytest.importorskip("torch._dynamo")
    if not hasattr(torch, "compile"):
        pytest.skip("no torch.compile")

    def f(x):
        return torch.log(x) * 2

    try:
        compiled = torch.compile(f, backend="eager")
        compiled(torch.ones(2))
    except Exception as exc:  # no compiler here
        pytest.skip(f"torch.compile unavailable: {exc}")
    with watch(on_violation=lambda v: None) as w:
        out = compiled(torch.zeros(2))
    assert torch.isinf(out).all()
    assert w.violations and w.violations[0].kind == "inf"


def test_sum_overflow_is_not_a_false_stop():
    big = torch.full((1000,), 3e38)
    with watch(on_violation=lambda v: None) as w:
        _ = big * 1.0                    # finite values whose sum overflows
        h = torch.full((100,), 60000.0, dtype=torch.float16)
        _ = h + 1                        # fp16 sum would overflow: summed in float32
    assert w.violations == []
    assert math.isinf(float(big.sum()))


# -- CUDA: device windows (skipped without a GPU) --------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


class _LogHead(nn.Module):
    def forward(self, x):
        return torch.log(x - x)  # cuda-here


@cuda
def test_cuda_forward_stop_names_the_op_and_pauses_in_the_re_run():
    """The module outputs' sums are read once, when the outermost call returns; the
    flagged call is then re-run op by op, and the pause is in its frame, as on the CPU."""
    model = nn.Sequential(nn.Linear(4, 4), _LogHead(), nn.Linear(4, 1)).cuda()
    got = []
    with watch(on_violation=lambda v: got.append((v, v.frame.f_lineno if v.frame else 0))):
        y = model(torch.randn(2, 4, device="cuda"))
    v, pause_line = got[0]
    here = os.path.abspath(__file__)
    assert (v.op, v.module, v.module_type, v.stage, v.created) == (
        "aten.log.default", "1", "_LogHead", "forward", True)
    assert (v.file, v.line) == (here, marked_line(here, "# cuda-here"))
    assert pause_line == marked_line(here, "# cuda-here")
    assert len(got) == 1 and y.isnan().any()


class _Root(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # cuda-sqrt


@cuda
@pytest.mark.parametrize("action", ["break", "raise"])
def test_cuda_backward_stop_is_delivered_on_the_user_thread(action):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), _Root(), nn.Linear(6, 1)).cuda()
    x = torch.randn(8, 4, device="cuda")
    got = []
    here = os.path.abspath(__file__)
    with watch(on_violation=got.append, action=action) as w:
        loss = model(x).pow(2).mean()
        if action == "raise":
            with pytest.raises(NonFiniteError) as info:
                loss.backward()
            got.append(info.value.violation)
        else:
            loss.backward()
            torch.zeros(1, device="cuda") + 1     # the next op on this thread delivers
    v = got[0]
    assert (v.stage, v.node, v.module, v.line) == (
        "backward", "SqrtBackward0", "2", marked_line(here, "# cuda-sqrt"))
    assert len(w.violations) == 1


@cuda
def test_cuda_optimizer_foreach_names_the_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e36, foreach=True)
    x = torch.randn(16, 4, device="cuda")
    with watch(on_violation=lambda v: None, exact=True) as w:
        (model(x) - 1000).pow(2).sum().backward()
        opt.step()
    v = w.violations[0]
    assert (v.stage, v.param, v.kind, v.created) == ("optimizer", "0.weight", "inf", True)
    assert v.op.startswith("aten._foreach_add")


@cuda
def test_cuda_healthy_step_does_not_sync_per_op():
    import warnings
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.LayerNorm(64))
                            for _ in range(8)]).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64, device="cuda")

    def step():
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    step()
    with watch(on_violation=lambda v: None) as w:
        step()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    syncs = [c for c in caught if "synchroniz" in str(c.message)]
    assert w.violations == []
    # windows: the outermost module, backward's end, before and after the step
    assert len(syncs) <= 6, [str(c.message) for c in syncs]


@pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])
def test_foreach_optimizer_on_cpu_names_the_parameter(exact):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e36, foreach=True)
    x = torch.randn(16, 4)
    with watch(on_violation=lambda v: None, exact=exact) as w:
        (model(x) - 1000).pow(2).sum().backward()
        opt.step()  # foreach-step
    assert len(w.violations) == 1
    v = w.violations[0]
    here = os.path.abspath(__file__)
    assert (v.stage, v.param, v.kind, v.created, v.op) == (
        "optimizer", "0.weight", "inf", True, "aten._foreach_add_.List" if exact else "")
    assert v.line == marked_line(here, "# foreach-step")
    if not exact:
        assert v.torch_op == "SGD.step" and "lr=1e+36" in v.text


# -- ops that cannot make a NaN/Inf are not checked while nothing was judged -----------
def test_nan_from_outside_through_unchecked_ops_stops_at_the_first_checked_op():
    data = torch.from_numpy(__import__("numpy").array([[1.0, float("nan"), -3.0, 4.0]],
                                                      dtype="float32"))
    lin = nn.Linear(8, 2)
    with watch(on_violation=lambda v: None) as w:
        h = torch.relu(data)                     # not checked: relu makes no NaN
        h = torch.cat([h, h.clone()], dim=1)     # not checked: copies
        out = lin(h)                             # checked: the NaN came in from outside
        del out
    assert len(w.violations) == 1
    v = w.violations[0]
    assert (v.kind, v.op, v.created, v.stage) == ("nan", "aten.addmm.default", False,
                                                    "forward")
    assert v.culprit.startswith("input 1")


def test_constants_and_casts_that_make_nan_or_inf_are_still_checked(device):
    # (device: also through the device window, judged at its read)
    with watch(on_violation=lambda v: None) as w:
        a = torch.zeros(3).fill_(float("nan"))           # NaN written on purpose: no stop
        data = torch.from_numpy(np.array([1.0, np.nan, 3.0]))
        e = a * data                                     # a NaN come in: a stop
    assert [(v.op, v.culprit) for v in w.violations] == [("aten.mul.Tensor", "input 1 (other)")]
    with watch(on_violation=lambda v: None) as w:
        b = torch.full((2,), 1e5).half()                # float16 downcast overflows
        c = torch.full((2,), 3.0).half().float()        # upcast: fine
        d = torch.zeros(2, dtype=torch.float16).copy_(torch.full((2,), 1e5))
    assert [(v.op, v.kind, v.created) for v in w.violations] == [
        ("aten._to_copy.default", "inf", True), ("aten.copy_.default", "inf", True)]
    del a, b, c, d, e


def test_unchecked_ops_are_checked_again_once_something_was_judged():
    with watch(on_violation=lambda v: None) as w:
        a = torch.log(torch.zeros(4))            # -Inf created: stop, remembered
        b = torch.stack([a, a])                  # checked now: the -Inf flows on
        c = torch.softmax(b, -1)                 # NaN made of those Infs: consequence
        del c
    assert [v.op for v in w.violations] == ["aten.log.default"]


def test_backward_provenance_survives_unchecked_in_place_ops():
    class Block(nn.Module):
        def forward(self, x):
            y = torch.sqrt(x)                    # grad of sqrt(0): Inf in backward
            return torch.relu_(y * 1.0)          # in place, not checked

    x = torch.zeros(3, requires_grad=True)
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise"):
            Block()(x).sum().backward()
    v = info.value.violation
    assert v.stage == "backward" and v.node == "SqrtBackward0"
    assert v.torch_op == "torch.sqrt" and v.function == "forward"


def test_scalar_updates_that_can_overflow_are_still_checked():
    big = torch.full((3,), 3e38)
    with watch(on_violation=lambda v: None) as w:
        a = big * 0.5                    # |s| <= 1: cannot overflow, not checked
        b = big / 4.0                    # |s| >= 1: not checked
        c = big.clone().add_(1e-8)       # |s| <= 1: rounds back, not checked
        d = big * 2.0                    # overflows: checked, a stop
    assert [(v.op, v.kind, v.created) for v in w.violations] == [
        ("aten.mul.Tensor", "inf", True)]
    assert torch.isfinite(a).all() and torch.isfinite(b).all() and torch.isfinite(c).all()
    del d
    with watch(on_violation=lambda v: None) as w:
        e = torch.ones(2).div_(0.5)      # |s| < 1: checked (finite here)
        f = torch.ones(2) * 0.0          # times 0: checked (inf * 0 is NaN)
        g = big.clone().add_(1.0, alpha=1e38)     # large alpha: checked, overflows
    assert [(v.op, v.kind, v.created) for v in w.violations] == [
        ("aten.add_.Tensor", "inf", True)]
    del e, f, g


def test_unchecked_upcast_keeps_its_line_for_a_backward_overflow():
    x = torch.ones(2, dtype=torch.float16, requires_grad=True)
    with pytest.raises(NonFiniteError) as info:
        with watch(action="raise"):
            y = x.float()                        # upcast: not checked, provenance kept
            (y * 1e5).sum().backward()           # grad 1e5 cast back to float16: Inf
    v = info.value.violation
    assert (v.stage, v.op, v.kind, v.created) == ("backward", "aten._to_copy.default",
                                                  "inf", True)
    assert v.node == "ToCopyBackward0"
    assert (v.file, v.line) == (os.path.abspath(__file__),
                                line_of(__file__, "y = x.float()  "))


def test_an_async_collectives_buffer_is_checked_after_its_wait_not_when_made():
    """A functional collective hands out a buffer the backend fills later (FSDP2's
    all_gather_into_tensor): read at once it held uninitialized NaN bits, a false stop in
    a 2-rank job. Its `wait_tensor` output is checked, as any op's."""
    from mldebug.watch.ops import OpInfo
    functional = torch.ops._c10d_functional
    assert OpInfo(functional.all_gather_into_tensor.default).skip
    assert OpInfo(functional.all_reduce.default).skip
    assert not OpInfo(functional.wait_tensor.default).skip
    assert not OpInfo(torch.ops.aten.add.Tensor).skip


def test_fsdp2s_all_gather_buffer_is_not_checked_when_made():
    """FSDP2's all_gather_copy_in copies this rank's shard into the all-gather's buffer,
    whose other parts hold uninitialized memory until the gather fills them: read as made
    it held NaN bits now and then (a false stop in the backward of a 2-rank job's first
    step, which the full watch runs op by op). What is copied out after the gather is
    checked (split_with_sizes_copy, as any op)."""
    pytest.importorskip("torch.distributed.fsdp")
    from mldebug.watch.ops import OpInfo
    assert OpInfo(torch.ops.fsdp.all_gather_copy_in.default).skip
    assert not OpInfo(torch.ops.fsdp.split_with_sizes_copy.default).skip
