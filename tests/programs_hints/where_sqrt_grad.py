"""Cause: torch.where discards a branch, but its gradient still flows through it.
where(d > 0, sqrt(d), 0) is finite forward, yet in backward sqrt's derivative at the
masked d = 0 is 0 / 0 = NaN (the marked line, stage backward).
Remedy: compute the branch on safe inputs (sqrt of where(d > 0, d, 1)). `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
d = torch.relu(torch.randn(6)).requires_grad_()   # some entries exactly 0
positive = d > 0
if FIXED:
    r = torch.where(positive, torch.sqrt(torch.where(positive, d, 1.0)), 0.0)
else:
    r = torch.where(positive, torch.sqrt(d), 0.0)  # here
r.sum().backward()
print("grad", d.grad.tolist())
