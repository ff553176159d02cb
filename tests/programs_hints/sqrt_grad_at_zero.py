"""Cause: the derivative of sqrt at 0. A Euclidean distance written as
sqrt(sum((a - b)**2)) is fine forward for equal points (sqrt(0) = 0), but its gradient
1 / (2 sqrt(0)) is Inf in backward (stop at the marked line, stage backward).
Remedy: add an eps inside the sqrt. `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
a = torch.randn(5, 3, requires_grad=True)
b = a.detach().clone()
b[1:] += torch.randn(4, 3)            # point 0 coincides with its pair
sq = ((a - b) ** 2).sum(-1)
if FIXED:
    dist = torch.sqrt(sq + 1e-12)
else:
    dist = torch.sqrt(sq)  # here
dist.mean().backward()
print("grad norm", float(a.grad.norm()))
