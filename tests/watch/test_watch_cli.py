"""The NaN/Inf watch driven through the real CLI: stops, reports, exit status, and the
promise that a watched run computes bitwise what an unwatched one does."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from conftest import PROGRAMS, clean_env, marker_line, read_report, run_cli

TRAIN_AND_SAVE = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 8 * 8, 10))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scores = torch.full((4, 4), float("-inf")).triu(1)     # a causal mask, as attention uses
    for step in range(5):
        x = torch.randn(16, 3, 8, 8)
        y = torch.randint(0, 10, (16,))
        opt.zero_grad()
        attn = torch.softmax(torch.randn(4, 4) + scores, dim=-1)   # -inf flows, no NaN
        loss = nn.functional.cross_entropy(model(x), y) + attn.sum() * 0
        loss.backward()
        opt.step()
    torch.save({"state": model.state_dict(), "rng": torch.get_rng_state()}, sys.argv[1])
    print("trained", loss.item())
"""


def test_watched_training_is_bitwise_identical_to_plain(write_program, tmp_path):
    prog = write_program(TRAIN_AND_SAVE)
    plain = subprocess.run([sys.executable, str(prog), str(tmp_path / "plain.pt")],
                           capture_output=True, text=True, env=clean_env())
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "r.jsonl"
    watched = run_cli(["--batch", "--report", str(report), str(prog), str(tmp_path / "w.pt")])
    assert watched.returncode == 0, watched.stderr
    assert read_report(report) == []
    assert watched.stdout == plain.stdout
    a = torch.load(tmp_path / "plain.pt")
    b = torch.load(tmp_path / "w.pt")
    assert torch.equal(a["rng"], b["rng"])
    for name, tensor in a["state"].items():
        assert torch.equal(tensor, b["state"][name]), name


NAN_AND_GO_ON = """
    import torch
    x = torch.tensor([1.0, 0.0, 4.0])
    y = torch.log(x)  # here
    z = y * 2        # propagation of the same -inf: not a new stop
    w = torch.sqrt(torch.tensor([-1.0]))  # a new creation: a new stop
    print("finished", z.tolist(), w.tolist())
"""


def _batch_run(prog, tmp_path, path):
    """`python -m mldebug --batch --report R PROG` on the host or the device PATH."""
    report = tmp_path / "r.jsonl"
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1") if path == "device" else clean_env()
    if path == "host":
        env.pop("MLDEBUG_SIMULATE_DEVICE", None)
    return run_cli(["--batch", "--report", str(report), str(prog)], env=env), report


def _ran_as_plain(prog, result, report):
    """RESULT, PROG under the watch, ran as plain python does: exit 0, its output, no stop."""
    plain = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                           env=clean_env(), timeout=120)
    assert (result.returncode, result.stdout) == (0, plain.stdout), result.stderr
    assert not report.exists() or not read_report(report)


UPDATE_BETWEEN_BACKWARDS = """
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
    params = list(model.parameters())
    for step in range(3):
        out = model(torch.randn(8, 4))
        out.pow(2).mean().backward(retain_graph=True)
        with torch.no_grad():   # the bug: the weights change before the second backward
            torch._foreach_add_(params, [p.grad for p in params], alpha=-0.1)
        out.sum().backward()  # here
        print("step", step, "computed")
"""


@pytest.mark.parametrize("mode", ["on-cpu", "on-device", "exact"])
def test_a_weight_written_before_the_backward_that_needs_it_raises_as_without_mldebug(
        write_program, mode):
    # (a foreach update under the watch's dispatch mode once moved no version counter:
    # the program went on with wrong gradients where torch raises)
    prog = write_program(UPDATE_BETWEEN_BACKWARDS)
    plain = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                           env=clean_env())
    assert plain.returncode == 1 and "modified by an inplace operation" in plain.stderr
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1") if mode == "on-device" else clean_env()
    watched = run_cli(["--batch", "--watch", "exact" if mode == "exact" else "on",
                       str(prog)], env=env)
    assert "computed" not in watched.stdout, watched.stdout
    assert watched.returncode == 1, watched.stderr
    assert "modified by an inplace operation" in watched.stderr
    assert "stop: uncaught RuntimeError" in watched.stderr
    assert f"at {prog.name}:{marker_line(prog)}" in watched.stderr


PER_SAMPLE_NAN = """
    import torch
    from torch import nn
    from torch.func import functional_call, grad, vmap

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(16, 3), torch.randn(16, 1)

    def sample_loss(params, xi, yi):
        out = functional_call(model, params, (xi.unsqueeze(0),))
        return torch.log(out - yi).mean()     # here: a negative difference for some

    for step in range(3):
        params = {k: v.detach() for k, v in model.named_parameters()}
        per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
        for p, g in zip(model.parameters(), per_sample.values()):
            p.grad = g.mean(0)
        opt.step()
        print("stepped", step)
"""


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_nan_inside_torch_func_vmap_stops_at_its_line(write_program, tmp_path, path):
    # (the model's call inside vmap once had its wrapped outputs read with .item(): the
    # host path ended in vmap's RuntimeError)
    prog = write_program(PER_SAMPLE_NAN)
    result, report = _batch_run(prog, tmp_path, path)
    assert result.returncode == 3, result.stderr
    assert "vmap" not in result.stderr, result.stderr
    (stop,) = read_report(report)
    assert stop["op"] == "aten.log.default" and stop["stage"] == "forward", stop
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog)), stop


LOG_PRIOR = """
    import torch
    from torch import nn

    class LogPrior(nn.Module):
        def forward(self, counts):
            return torch.log(counts / counts.sum())   # here: a class never seen, log(0)

    class Buckets(nn.Module):   # T5's relative positions: log(0) cast to an integer
        def forward(self, n):
            d = torch.arange(n)[None, :] - torch.arange(n)[:, None]
            far = (torch.log(d.abs().float() / 4) * 3).to(torch.long)
            return torch.where(d.abs() < 4, d.abs(), 4 + far.clamp(min=0))

    torch.manual_seed(0)
    model, prior, buckets = nn.Linear(4, 3), LogPrior(), Buckets()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        y = torch.randint(0, 2, (8,))                       # class 2 never occurs
        bias = buckets(6).float().mean()
        logits = model(torch.randn(8, 4)) + prior(torch.bincount(y, minlength=3).float())
        loss = nn.functional.cross_entropy(logits + bias, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("stepped", step)
"""


@pytest.mark.parametrize("path", ["host", "device"])
def test_log_of_zero_inside_a_model_stops_where_the_model_returns_it(
        write_program, tmp_path, path):
    # log(0) = -inf inside a model where no gradient flows is a value while it stays
    # there (T5's buckets: no stop), a stop once the model returns it, at the log
    prog = write_program(LOG_PRIOR)
    result, report = _batch_run(prog, tmp_path, path)
    assert result.returncode == 3, result.stderr
    assert "stepped" not in result.stdout
    (stop,) = read_report(report)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog)), stop
    assert (stop["op"], stop["created"]) == ("aten.log.default", True), stop
    assert stop["reached"].startswith("the output of the model call LogPrior"), stop
    assert "made there by torch.log of 0" in stop["message"], stop["message"]
    assert "clamp the input by an eps" in stop["hint"], stop


MANY_OUTPUTS = """
    import torch

    class Many(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return [y * i for i in range(70)]   # more than the ledger holds at a time

    torch.manual_seed(0)
    model = Many()
    for call in range(3):      # the first learns the root; the next are checked at it
        outs = model(torch.randn(2, 4))
    print("done", len(outs))
"""


def test_a_root_returning_more_than_the_ledger_holds_runs_through_on_the_device_path(
        write_program, tmp_path):
    # (the ledger reduced them under the watch's own mode, whose window waited on the
    # ledger's lock: the program hung)
    result, report = _batch_run(write_program(MANY_OUTPUTS), tmp_path, "device")
    assert (result.returncode, result.stdout) == (0, "done 70\n"), result.stderr


ENTROPY = """
    import copy
    import torch
    from torch import nn

    class Policy(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(4, 5)

        def forward(self, x, legal):
            logp = self.head(x).masked_fill(~legal, float("-inf")).log_softmax(-1)
            plogp = logp.exp() * logp   # here: 0 * -inf = NaN at each illegal action
            return -{entropy}.sum(-1)

    torch.manual_seed(0)
    policy = Policy()
    legal = torch.rand(8, 5) > 0.3
    legal[:, 0] = True
    if {copied}:      # learned as the root, then a copy evaluated: a module outside it
        policy(torch.randn(8, 4), legal).sum().backward()
        policy = copy.deepcopy(policy)
    with torch.{grad}():
        for step in range(3):
            print("entropy", step, policy(torch.randn(8, 4), legal).tolist())
"""


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", ["masked", "returned", "with gradient", "a copy"])
def test_zero_times_a_masked_inf_is_a_value_until_the_model_returns_it(
        write_program, tmp_path, path, case):
    # p * log p of a masked action is 0 * -inf = NaN: where no gradient flows a value
    # made on purpose (transformers' typical sampling sums it with nansum), a stop once
    # the model returns it; where a gradient flows (its derivative is NaN), and in a
    # module whose return the watch does not see (a copy of the model), where made
    entropy = "torch.where(legal, plogp, 0)" if case == "masked" else "plogp"
    grad = "enable_grad" if case == "with gradient" else "no_grad"
    prog = write_program(ENTROPY.format(entropy=entropy, grad=grad, copied=case == "a copy"))
    result, report = _batch_run(prog, tmp_path, path)
    if case == "masked":
        _ran_as_plain(prog, result, report)
        return
    assert result.returncode == 3, result.stderr
    assert "entropy" not in result.stdout
    (stop,) = read_report(report)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog)), stop
    assert (stop["op"], stop["created"], stop["kind"] if "kind" in stop else "nan") == (
        "aten.mul.Tensor", True, "nan"), stop
    if case == "returned":
        assert stop["reached"].startswith("the output of the model call Policy"), stop
        assert "0 * -Inf is NaN; fix at" in stop["hint"], stop
    else:
        assert stop["reached"] == "" and stop["stage"] == "forward", stop


RELATIVE_GAP = """
    import torch
    from torch import nn

    class Router(nn.Module):   # PhiMoE's sparsemixer: a relative gap to the top score
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(4, 3, bias=False)

        def forward(self, x):
            scores = self.gate(x)
            with torch.{grad}():
                top = scores.max(-1, keepdim=True).values
                gap = (top - scores) / scores.abs().clamp(min=top)   # here: 0/0 on a zero row
                {use}
            return scores.masked_fill(mask, float("-inf")).softmax(-1){returned}

    torch.manual_seed(0)
    router = Router()
    opt = torch.optim.SGD(router.parameters(), lr=0.1)
    x = torch.randn(6, 4)
    x[2] = 0.0                                 # a padding token's hidden state
    for step in range(3):
        loss = (router(x) * torch.arange(3.0)).sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        print("loss", step, loss.item())
"""


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", ["compared", "returned", "with gradient"])
def test_zero_by_zero_where_no_gradient_flows_inside_a_model_is_a_value_until_returned(
        write_program, tmp_path, path, case):
    # 0/0 = NaN inside a model where no gradient flows, only compared with a threshold
    # (NaN > eps is False): a value made there (PhiMoE in bfloat16, a zero padding row);
    # a stop at the division once the model returns it, and where a gradient flows
    use = "mask = gap > 0.02" if case != "with gradient" else "mask = gap.exp() > 1.02"
    prog = write_program(RELATIVE_GAP.format(
        grad="enable_grad" if case == "with gradient" else "no_grad", use=use,
        returned=" + gap.nan_to_num(0) * 0 + gap.sum() * 0" if case == "returned" else ""))
    result, report = _batch_run(prog, tmp_path, path)
    if case == "compared":
        _ran_as_plain(prog, result, report)
        return
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog)), stop
    assert (stop["op"], stop["created"], stop["reason"]) == ("aten.div.Tensor", True, "nan")
    if case == "returned":
        assert stop["reached"].startswith("the output of the model call Router"), stop
        assert "made there by torch.div of 0 by 0 where no gradient flows" in stop["message"]
        assert stop["hint"].startswith(f"0 / 0 is NaN; fix at {prog.name}:"), stop["hint"]
    else:
        assert stop["reached"] == "" and stop["stage"] == "forward", stop


SUMMED_MASKS = """
    import torch
    from torch import nn

    MIN = torch.finfo(torch.float32).min

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4, 4)

        def forward(self, x, causal, padding):
            scores = self.q(x) @ x.transpose(1, 2) + causal
            scores = scores + padding          # here
            return scores.softmax(-1) @ x

    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 5, 4)
    causal = torch.zeros(5, 5).masked_fill(~torch.ones(5, 5, dtype=torch.bool).tril(), MIN)
    padding = torch.zeros(2, 1, 5)
    padding[1, :, 3:] = {pad}
    if {fully}:                      # every key of the first query masked twice
        causal[0, 0] = MIN
        padding[1] = MIN
    for step in range(2):
        loss = model(x, causal, padding).pow(2).mean()
        loss.backward()
        print("loss", step, round(loss.item(), 6))
"""


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", ["summed", "an overflow", "a fully masked row"])
def test_two_masks_at_the_lowest_value_summed_are_a_mask(write_program, tmp_path, path, case):
    # finfo.min + finfo.min = -inf (GPT-Neo adds its attention mask to a causal mask at
    # the minimum): a mask as either operand was, gradient flowing, no stop. An operand
    # that is no mask (-1e38 is not below half the minimum) makes an overflow, a stop at
    # the add; a row masked everywhere makes the softmax's NaN, a stop there, naming them
    pad = "-1e38" if case == "an overflow" else "MIN"
    prog = write_program(SUMMED_MASKS.format(pad=pad, fully=case == "a fully masked row"))
    result, report = _batch_run(prog, tmp_path, path)
    if case == "summed":
        _ran_as_plain(prog, result, report)
        return
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert stop["stage"] == "forward" and stop["created"], stop
    if case == "an overflow":
        assert (stop["op"], stop["line"]) == ("aten.add.Tensor", marker_line(prog)), stop
        assert stop["count"] == 7 and "7 -Inf" in stop["message"], stop
    else:
        assert stop["op"] == "aten._softmax.default" and stop["count"] == 5, stop
        assert "made by torch.add of two masks at the dtype's lowest value at " \
            f"{prog.name}:{marker_line(prog)}" in stop["culprit"], stop


MASK_CAST = """
    import torch
    from torch import nn

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q = nn.Linear(4, 4)

        def forward(self, x, keep):
            scores = self.q(x) @ x.transpose(1, 2) - {big} * (1.0 - keep[:, None, :])
            return scores.softmax(-1, dtype=torch.float16).float() @ x     # here

    torch.manual_seed(0)
    model = Attention()
    x = torch.randn(2, 5, 4)
    keep = torch.ones(2, 5)
    keep[1, 3:] = 0
    if {fully}:
        keep[1] = 0
    for step in range(2):
        loss = model(x, keep).pow(2).mean()
        loss.backward()
        print("loss", step, round(loss.item(), 4))
"""


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("case", ["cast", "an overflow", "a fully masked row"])
def test_a_mask_cast_to_a_dtype_that_cannot_hold_it_is_a_mask(write_program, tmp_path, path,
                                                                case):
    # Funnel writes -1e6 at padding in float32 and takes the softmax in float16: the cast
    # makes -inf, a mask as before, no stop. A value just past float16's range (-7e4) is
    # an overflow, a stop at the cast; a row masked everywhere stops at the softmax
    big = "7e4" if case == "an overflow" else "1e6"
    prog = write_program(MASK_CAST.format(big=big, fully=case == "a fully masked row"))
    result, report = _batch_run(prog, tmp_path, path)
    if case == "cast":
        _ran_as_plain(prog, result, report)
        return
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert stop["stage"] == "forward" and stop["created"], stop
    assert stop["line"] == marker_line(prog), stop
    if case == "an overflow":
        assert stop["op"] == "aten._to_copy.default" and "-Inf" in stop["message"], stop
    else:
        assert stop["op"] == "aten._softmax.default" and stop["count"] == 25, stop
        assert "made by the cast to float16 of a mask it cannot hold at " \
            f"{prog.name}:{marker_line(prog)}" in stop["culprit"], stop


CODE_IN_BACKWARD = {
    "tensor hook": """
        import torch
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        x, y = torch.randn(16, 4), torch.randn(16, 1)
        h = net[0](x)
        h.register_hook(lambda g: g * torch.sqrt(g.sum() - 1.0))  # here: sqrt of a negative
        loss = (net[2](net[1](h)) - y).pow(2).mean()
        loss.backward()
        print("backward done")
    """,
    "autograd.Function": """
        import torch

        class SafeNorm(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                n = x.norm(dim=1, keepdim=True)
                ctx.save_for_backward(x, n)
                return n

            @staticmethod
            def backward(ctx, g):
                x, n = ctx.saved_tensors
                return g * x / n                 # here: 0/0 for an all-zero row

        torch.manual_seed(0)
        lin = torch.nn.Linear(4, 8, bias=False)
        x = torch.randn(16, 4)
        x[:3] = 0.0
        loss = SafeNorm.apply(torch.tanh(lin(x))).mean()
        loss.backward()
        print("backward done")
    """,
}


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("code", list(CODE_IN_BACKWARD))
def test_a_nan_made_by_the_programs_code_in_backward_stops_at_that_line(
        write_program, tmp_path, code, path):
    # (a hook on a non-leaf tensor ran under its node, whose forward op the stop named;
    # on a device the stop named the backward() line)
    prog = write_program(CODE_IN_BACKWARD[code])
    result, report = _batch_run(prog, tmp_path, path)
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["file"], stop["line"], stop["stage"]) == (
        str(prog), marker_line(prog), "backward"), stop
    assert stop["op"] in ("aten.sqrt.default", "aten.div.Tensor"), stop
    assert "torch.safenorm" not in stop["message"]


def test_continue_resumes_and_the_next_root_cause_stops_again(write_program):
    prog = write_program(NAN_AND_GO_ON)
    result = run_cli([str(prog)], stdin="p x\nc\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"> {prog}({marker_line(prog)})<module>()" in out
    assert out.count("mldebug: ") == 2, out
    assert "NaN from aten.sqrt.default" in out
    assert "finished [0.0, -inf, 2.772588" in out


def test_watch_off_runs_without_stops(write_program):
    prog = write_program(NAN_AND_GO_ON)
    result = run_cli(["--watch", "off", "--batch", str(prog)])
    assert result.returncode == 0, result.stderr
    assert "finished" in result.stdout


def test_break_on_nan_ignores_a_created_inf(write_program):
    prog = write_program(NAN_AND_GO_ON)
    report = prog.parent / "r.jsonl"
    result = run_cli(["--break-on", "nan", "--batch", "--report", str(report), str(prog)])
    assert result.returncode == 3
    (stop,) = read_report(report)
    assert stop["reason"] == "nan" and stop["op"] == "aten.sqrt.default"


def test_prompt_commands_watch_and_breakon(write_program):
    prog = write_program("""
        import torch
        breakpoint()
        a = torch.log(torch.zeros(1))
        b = torch.sqrt(torch.tensor([-1.0]))
        print("done", a.item(), b.item())
    """)
    result = run_cli([str(prog)], stdin="watch\nbreakon nan\nbreakon nan,bogus\nc\n"
                                        "watch off\nwatch\nc\n")
    out = result.stdout
    assert result.returncode == 0, result.stderr
    assert "watch is on; break on: assert,exception,inf,nan" in out
    assert "break on: nan" in out
    assert "*** breakon: unknown break-on kind 'bogus'" in out
    assert "NaN from aten.sqrt.default" in out      # the -inf of log no longer stops
    assert "-Inf" not in out
    assert "watch is off" in out
    assert "done -inf nan" in out


def test_why_without_a_stop_says_so(write_program):
    prog = write_program("breakpoint()\n")
    result = run_cli([str(prog)], stdin="why\nc\n")
    assert "breakpoint at prog.py:1" in result.stdout


INSIDE_A_MODEL = """
    import torch
    from torch import nn

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

        def forward(self, h):
            scale = h.abs().amax()
            z = self.proj(h) / (scale - scale)  # here
            return z.tanh()

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), Head())
    x = torch.randn(2, 4)
    out = model(x)              # tanh absorbs the Inf: every module output is finite
    out.sum().backward()        # but 0 * (1/0) in DivBackward0 is NaN
    print("finished", bool(out.isfinite().all()), bool(model[0].weight.grad.isnan().any()))
"""


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_a_stop_inside_a_model_pauses_in_its_forward_with_its_locals(write_program, mode):
    """An Inf made inside a model and absorbed before any module's output (tanh) shows up
    as a NaN gradient: with the tiers (the default), the backward's check re-runs the
    model call under the per-op check, which stops at the division in Head.forward, with
    its locals; the infinite derivative of the division is the next stop (a new
    creation, found by re-running the call's backward), and `c` ends the program as it would have ended: the same stops as
    `--watch exact` (which makes the first during the forward pass)."""
    prog = write_program(INSIDE_A_MODEL)
    result = run_cli(["--watch", mode, str(prog)],
                     stdin="p tuple(h.shape), float(scale)\nwhy\nc\nc\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"> {prog}({marker_line(prog)})forward()" in out
    assert "from aten.div.Tensor (torch.div) in module 2 (Head) at prog.py:12 [forward]" in out
    assert "((2, 4), 1.358" in out
    assert ("from aten.div.Tensor (torch.div) in DivBackward0 in module 2 (Head) at "
            "prog.py:12 [backward]") in out
    # (and a third: -g*p/d**2 in the same backward is 0/0, another creation)
    assert out.count("mldebug: ") == 3, out
    assert "finished True True" in out


@pytest.mark.parametrize("mode", ["on", "exact"])
def test_quit_at_a_stop_inside_a_model_ends_the_program(write_program, mode):
    """`q` at a stop that a re-run of the call made (the tiers) ends the program as it
    does at any stop: the re-run does not swallow the debugger's quit."""
    prog = write_program(INSIDE_A_MODEL)
    result = run_cli(["--watch", mode, str(prog)], stdin="q\n")
    assert result.returncode == 0, result.stderr
    assert "mldebug: " in result.stdout
    assert "finished" not in result.stdout


def test_on_a_device_a_stop_read_at_the_programs_end_opens_over_its_globals(write_program):
    """On a GPU (the device path, simulated) an op outside any model is judged at the next
    read; when that read is the program's end, the prompt opens in a frame over the
    program's globals, after its last line, not in mldebug's own frame: its names can be
    read, the report still names the op's line, and stepping or `c` ends the program."""
    prog = write_program("""
        import torch
        x = torch.zeros(3)
        y = torch.log(x) * 0  # here
        print("after", x.tolist())
    """)
    last = len(prog.read_text().splitlines())
    result = run_cli(["--break-on", "nan", str(prog)], stdin="p x + 1\nwhere\nn\nn\n",
                     env=clean_env(MLDEBUG_SIMULATE_DEVICE="1"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"from aten.mul.Tensor (torch.mul) at prog.py:{marker_line(prog)} [forward]" in out
    assert "paused after the last line of prog.py, over its globals" in out
    assert f"> {prog}({last + 1})<end of program>()" in out
    assert "tensor([1., 1., 1.])" in out
    assert "mldebug/" not in out.split("(mldebug)", 1)[1]       # `where`: no frame of ours
    assert out.index("after [0.0, 0.0, 0.0]") < out.index("mldebug: ")


def test_on_a_device_watch_exact_pauses_at_the_op_itself_and_the_default_says_so(write_program):
    """On a GPU the default watch judges an op outside model calls at the next read, by
    which time the function that ran it may have returned: the stop names the op's line,
    pauses later, and says how to pause at the op. `--watch exact` reads each op as it
    runs (a sync per op) and pauses in the op's frame, its locals alive."""
    prog = write_program("""
        import torch

        def step(x, w):
            h = x @ w
            out = torch.log(h)  # here
            return out.sum()

        torch.manual_seed(0)
        loss = step(torch.randn(4, 3), torch.randn(3, 2))
        print("finished")
    """)
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1")
    at = f"from aten.log.default (torch.log) at prog.py:{marker_line(prog)} [forward]"
    default = run_cli([str(prog)], stdin="p h.shape\nc\n", env=env)
    assert default.returncode == 0, default.stderr
    assert at in default.stdout
    assert "`--watch exact` pauses at the op (a sync per op)" in default.stdout
    assert "NameError: name 'h' is not defined" in default.stdout
    exact = run_cli(["--watch", "exact", str(prog)], stdin="p h.shape\nc\n", env=env)
    assert exact.returncode == 0, exact.stderr
    assert at in exact.stdout
    assert f"> {prog}({marker_line(prog)})step()" in exact.stdout
    assert "torch.Size([4, 2])" in exact.stdout
    assert "--watch exact" not in exact.stdout
    assert exact.stdout.index("mldebug: ") < exact.stdout.index("finished")
