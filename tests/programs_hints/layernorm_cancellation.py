"""Cause: a variance computed as E[x^2] - E[x]^2. For activations far from zero the two
terms cancel and rounding leaves it negative; sqrt of it is NaN (the marked line).
Remedy: torch.var (a two-pass form). `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class HandLayerNorm(nn.Module):
    def __init__(self, n, eps=1e-5):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        if FIXED:
            var = x.var(-1, keepdim=True, correction=0)
        else:
            var = (x * x).mean(-1, keepdim=True) - mu * mu
        return self.gain * (x - mu) / torch.sqrt(var + self.eps)  # here


model = nn.Sequential(nn.Linear(16, 64), HandLayerNorm(64))
with torch.no_grad():
    model[0].bias.fill_(3000.0)                  # activations around 3000, spread ~1
x = torch.randn(8, 16)
y = model(x)
y.sum().backward()
print("out", float(y.abs().max()))
