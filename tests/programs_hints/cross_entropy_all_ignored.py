"""Cause: cross-entropy where every target is ignore_index (a batch of padding only): the
mean over zero counted targets is 0 / 0 (the marked line).
Remedy: sum the loss and divide by the count clamped to 1. `--fixed` applies it."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
logits = torch.randn(4, 5, requires_grad=True)
target = torch.full((4,), -100)                  # every position is padding
if FIXED:
    counted = (target != -100).sum().clamp(min=1)
    loss = F.cross_entropy(logits, target, reduction="sum") / counted
else:
    loss = F.cross_entropy(logits, target)  # here
loss.backward()
print("loss", float(loss))
