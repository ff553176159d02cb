"""The watch under mixed precision: GradScaler's overflows are its business (it skips the
step and lowers the scale), a real NaN is still a stop (mldebug/watch/amp.py)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn

from conftest import marker_line
from mldebug.watch import watch

pytestmark = pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])


class RootAtZero(nn.Module):
    """sqrt(x - min(x)): finite forward, an infinite gradient at the minimum, at any
    scale."""

    def forward(self, x):
        return torch.sqrt(x - x.detach().amin())  # here


def train(device, steps, init_scale, model=None, watched=True, exact=False, clip=False,
          scaler_steps=True):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    x = torch.randn(32, 8, device=device) * 10
    y = torch.randint(0, 4, (32,), device=device)
    got, scales = [], []
    w = watch(on_violation=got.append, exact=exact) if watched else \
        contextlib.nullcontext()
    with w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(device.split(":")[0], dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            if clip:       # the recipe: unscale_, then clip the true gradients
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            if scaler_steps:
                scaler.step(opt)
            else:          # a mistake: the step the scaler would skip runs
                opt.step()
            if scaler_steps or clip:     # (update needs the check step or unscale_ made)
                scaler.update()
            scales.append(scaler.get_scale())
    return model, got, scales


@pytest.mark.parametrize("init_scale, steps, skips", [(2.0 ** 24, 12, 8), (2.0 ** 32, 24, 16),
                                                      (2.0 ** 48, 40, 32)],
                         ids=["2^24", "2^32", "2^48"])
def test_the_scalers_overflows_while_it_calibrates_are_not_stops(device, exact, init_scale,
                                                                  steps, skips):
    """A scale of 2^24, 2^32 (Megatron's default) or 2^48 overflows float16 gradients for
    many steps in a row (from 2^48 about 33), each skipped by the scaler while it halves
    the scale; then training goes on. No stop, and bitwise the unwatched run."""
    plain, _, plain_scales = train(device, steps, init_scale, watched=False)
    model, got, scales = train(device, steps, init_scale, exact=exact)
    assert got == []
    assert scales == plain_scales and scales[0] < init_scale and scales[-1] == scales[-2]
    assert scales.index(scales[-1]) + 1 == skips      # steps skipped in a row, halving
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_an_infinite_derivative_is_a_stop_at_the_first_backward_at_any_scale(device, exact):
    """sqrt at 0: its derivative is infinite at any scale. Run again in float64 and
    divided by the scale it stays non-finite: a stop at the first backward, not after a
    count of skipped steps, saying so (and again at each step, a new one each time).
    (Where the scale overflows the gradient before it reaches the sqrt, nothing tells
    the two apart: the stop comes once the scaler has lowered the scale below that.)"""
    model = nn.Sequential(nn.Linear(8, 64), RootAtZero(), nn.Linear(64, 4))
    _, got, scales = train(device, 3, 2.0 ** 16, model=model, exact=exact)
    assert len(got) == 3
    v = got[0]
    assert (v.stage, v.torch_op) == ("backward", "torch.sqrt")
    assert "stays non-finite unscaled" in v.text and "scale 2^16" in v.text
    assert scales == [2.0 ** 15, 2.0 ** 14, 2.0 ** 13]     # the scaler still skips


def test_a_gradient_that_overflows_at_scale_one_is_a_stop(device, exact):
    """At a scale of 1 nothing is enlarged: float16 cannot hold the model's own gradient,
    a stop that says so (an overflow, finite in float64: no bug in an op, but no scale
    to blame either)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 64), nn.Linear(64, 4)).to(device)
    scaler = torch.amp.GradScaler(device.split(":")[0], init_scale=1.0)
    got = []
    with watch(on_violation=got.append, exact=exact):
        with torch.autocast(device.split(":")[0], dtype=torch.float16):
            out = model(torch.randn(32, 8, device=device))
        loss = out.float().sum() * 3e4     # d loss / d out = 30000, finite in float16
        scaler.scale(loss).backward()
    assert got and got[0].stage == "backward"
    assert "GradScaler's scale is 1: the gradient is non-finite at any scale" in got[0].text


def test_a_nan_in_the_forward_under_autocast_is_still_a_stop(device, exact):
    class LogHead(nn.Module):
        def forward(self, x):
            return torch.log(x - 100)  # here

    model = nn.Sequential(nn.Linear(8, 4), LogHead())
    _, got, _ = train(device, 2, 2.0 ** 16, model=model, exact=exact)
    assert [(g.stage, g.op) for g in got][:1] == [("forward", "aten.log.default")]


def test_a_disabled_scaler_excuses_nothing(device, exact):
    """GradScaler(enabled=use_amp) with use_amp False: nothing checks the gradients, so
    an infinite one is a stop as without a scaler."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), RootAtZero(), nn.Linear(16, 4)).to(device)
    scaler = torch.amp.GradScaler(device, enabled=False)
    got = []
    with watch(on_violation=got.append, exact=exact):
        loss = model(torch.randn(4, 8, device=device)).sum()
        scaler.scale(loss).backward()
    assert [v.stage for v in got] == ["backward"] and got[0].torch_op == "torch.sqrt"


def test_clipping_the_unscaled_overflow_is_not_a_stop(device, exact):
    """`unscale_` then `clip_grad_norm_` (the documented recipe, Lightning's and the
    Trainer's): on an overflowing step the gradients hold Inf, the clip multiplies them
    by max_norm / inf = 0, NaN, and `scaler.step()` skips the step. No stop, and bitwise
    the unwatched run."""
    plain, _, plain_scales = train(device, 12, 2.0 ** 24, watched=False, clip=True)
    model, got, scales = train(device, 12, 2.0 ** 24, exact=exact, clip=True)
    assert got == []
    assert scales == plain_scales and scales[0] < 2.0 ** 24
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("clip", [False, True], ids=["", "clipped"])
def test_stepping_on_the_overflow_without_the_scaler_is_a_stop(device, exact, clip):
    """`optimizer.step()` where `scaler.step(optimizer)` belongs: the step the scaler
    would skip writes the overflow into the parameters. A stop at the step, the first,
    whose hint says what to call."""
    _, got, _ = train(device, 2, 2.0 ** 24, exact=exact, clip=clip, scaler_steps=False)
    assert got, "no stop"
    v = got[0]
    assert v.stage == "optimizer" and v.step == 0
    assert v.cause == "loss_scaler_overflow_stepped"
    assert "step with scaler.step(optimizer), then scaler.update()" in v.hint
    assert "made by the loss scale's overflow, which GradScaler found" in v.headline()
    assert v.line == marker_line(__file__, "opt.step()")
