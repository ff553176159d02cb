"""The watch under mixed precision: GradScaler's overflows are its business (it skips the
step and lowers the scale), a real NaN is still a stop (mldebug/watch/amp.py)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from mldebug.watch import watch

pytestmark = pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])


class RootAtZero(nn.Module):
    """sqrt(x - min(x)): finite forward, an infinite gradient at the minimum, at any
    scale."""

    def forward(self, x):
        return torch.sqrt(x - x.detach().amin())  # here


def train(device, steps, init_scale, model=None, watched=True, exact=False):
    torch.manual_seed(0)
    model = model or nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device, init_scale=init_scale)
    x = torch.randn(32, 8, device=device) * 10
    y = torch.randint(0, 4, (32,), device=device)
    got, scales = [], []
    w = watch(on_violation=got.append, exact=exact)
    if not watched:
        w.close()
    with w:
        for _ in range(steps):
            opt.zero_grad()
            with torch.autocast(device.split(":")[0], dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    return model, got, scales


def test_the_scalers_overflows_while_it_calibrates_are_not_stops(device, exact):
    """A scale of 2^24 overflows float16 gradients for several steps, each skipped by the
    scaler; then training goes on. No stop, and bitwise the unwatched run."""
    plain, _, plain_scales = train(device, 12, 2.0 ** 24, watched=False)
    model, got, scales = train(device, 12, 2.0 ** 24, exact=exact)
    assert got == []
    assert scales == plain_scales and scales[0] < 2.0 ** 24 and scales[-1] == scales[-2]
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_a_gradient_non_finite_at_any_scale_is_a_stop_once_the_scaler_gives_up(device, exact):
    """An infinite derivative (sqrt at 0) overflows every scaled backward: the scaler skips
    every step; after 16 in a row the watch stops and says why."""
    model = nn.Sequential(nn.Linear(8, 64), RootAtZero(), nn.Linear(64, 4))
    _, got, scales = train(device, 18, 2.0 ** 16, model=model, exact=exact)
    assert len(got) == 1
    v = got[0]
    assert v.stage == "backward" and "non-finite at any scale" in v.text
    assert len(scales) == 18 and scales[15] == 1.0


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
