"""Cause: a reduction over an empty tensor. Selecting the valid boxes of a batch that has
none leaves a [0, 4] tensor, and smooth_l1_loss's mean over it is 0 / 0 (the marked line).
Remedy: skip the loss when the selection is empty. `--fixed` applies it."""
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
pred = torch.randn(6, 4, requires_grad=True)
target = torch.randn(6, 4)
valid = torch.zeros(6, dtype=torch.bool)         # no valid box in this batch
if FIXED and not valid.any():
    loss = pred.sum() * 0.0
else:
    loss = F.smooth_l1_loss(pred[valid], target[valid])  # here
loss.backward()
print("loss", float(loss))
