"""Cause: float16 overflow. A feed-forward block run in float16 produces values past
65,504, float16's largest, in its output projection: +Inf from finite inputs (the marked
line). Remedy: run it in bfloat16 (or float32). `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
DTYPE = torch.bfloat16 if FIXED else torch.float16


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.wi = nn.Linear(16, 64)
        self.wo = nn.Linear(64, 16)

    def forward(self, x):
        return self.wo(torch.relu(self.wi(x)))  # here


ff = FeedForward()
with torch.no_grad():
    ff.wo.weight.fill_(1000.0)                     # large activations, as in T5's last layers
ff = ff.to(DTYPE)
x = (torch.rand(2, 16) * 10).to(DTYPE)
y = ff(x)
print("max", float(y.float().abs().max()))
