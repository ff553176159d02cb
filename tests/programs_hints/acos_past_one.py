"""Cause: acos at the edge of its domain. The cosine of two equal vectors, computed by hand,
comes out a hair above 1.0 by rounding, and acos of it is NaN (the marked line).
Remedy: clamp the input inside the domain by an eps. `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
a = torch.randn(6, 16, requires_grad=True)
b = torch.cat([a[:3].detach(), torch.randn(3, 16)])     # rows 0-2 point the same way
cos = (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))
if FIXED:
    angle = torch.acos(cos.clamp(-1 + 1e-6, 1 - 1e-6))
else:
    angle = torch.acos(cos)  # here
angle.sum().backward()
print("angles", angle.tolist())
