"""Cause: normalising an all-zero embedding. A nearest-neighbour search written as
e / e.norm() divides 0 by 0 for the padding row, which is all zeros (the marked line).
Remedy: F.normalize, which clamps the norm by an eps. `--fixed` applies it."""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
emb = nn.Embedding(6, 8, padding_idx=0)         # the padding row is all zeros
tokens = torch.tensor([3, 0, 5, 1])
with torch.no_grad():
    e = emb(tokens)
    if FIXED:
        unit = F.normalize(e, dim=-1)
    else:
        unit = e / e.norm(dim=-1, keepdim=True)  # here
    nearest = (unit @ unit.t()).fill_diagonal_(-2).argmax(-1)
print("nearest", nearest.tolist())
