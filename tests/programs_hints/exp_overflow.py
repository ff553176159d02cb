"""Cause: exp overflowing float32. A softplus written as torch.where(x < 20, log1p(exp(x)), x)
still evaluates exp over every x, and exp(x) is Inf past x = 88.7 (the marked line);
the where throws that branch away, but its gradient would still be NaN.
Remedy: compute the branch on safe inputs (here F.softplus). `--fixed` applies it."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
x = (torch.randn(8) * 60).requires_grad_()
if FIXED:
    y = F.softplus(x)
else:
    y = torch.where(x < 20, torch.log1p(torch.exp(x)), x)  # here
y.sum().backward()
print("grad", x.grad.tolist())
