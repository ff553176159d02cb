"""Cause: softmax over a row that is all -inf. The attention mask of a sample whose keys
are all padding masks its whole row with -inf, and softmax of it is 0 / 0 (the marked
line). Remedy: mask with torch.finfo(dtype).min instead of -inf. `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
B, T, D = 2, 4, 8
proj = nn.Linear(D, 2 * D)
x = torch.randn(B, T, D)
pad = torch.zeros(B, T, dtype=torch.bool)
pad[1] = True                                    # sample 1 is all padding
q, k = proj(x).chunk(2, dim=-1)
scores = q @ k.transpose(-2, -1) / D ** 0.5
fill = torch.finfo(scores.dtype).min if FIXED else float("-inf")
scores = scores.masked_fill(pad[:, None, :], fill)  # the mask
weights = torch.softmax(scores, dim=-1)  # here
weights.sum().backward()
print("weights", weights.sum().item())
