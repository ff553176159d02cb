"""Cause: a mean over an empty selection, as a sum divided by a count. A batch with no
positive sample makes mask.sum() = 0, and the loss 0 / 0 (the marked line).
Remedy: clamp the count to at least 1. `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
scores = torch.randn(8, requires_grad=True)
labels = torch.zeros(8)                          # no positive in this batch
positive = (labels == 1).float()
per_sample = torch.nn.functional.softplus(-scores)
if FIXED:
    loss = (per_sample * positive).sum() / positive.sum().clamp(min=1)
else:
    loss = (per_sample * positive).sum() / positive.sum()  # here
loss.backward()
print("loss", float(loss))
