"""Cause: a division by a standard deviation that is 0. Standardising features with
(x - mean) / std when one column is constant divides 0 by 0 (the marked line).
Remedy: add an eps to the divisor. `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
x = torch.randn(32, 4)
x[:, 2] = 5.0                                   # a feature that never changes
mean, std = x.mean(0), x.std(0)
if FIXED:
    z = (x - mean) / (std + 1e-8)
else:
    z = (x - mean) / std  # here
print("standardised", z.abs().max().item())
