"""Cause: an all-padded sample in nn.MultiheadAttention. key_padding_mask masks every key
of sample 1, and the attention's softmax of an all -inf row is NaN (the marked line).
Remedy: leave samples with no real token out of the batch. `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
mha = nn.MultiheadAttention(8, 2, batch_first=True)
x = torch.randn(3, 4, 8)
pad = torch.zeros(3, 4, dtype=torch.bool)
pad[1] = True                                    # sample 1 is all padding
if FIXED:
    keep = ~pad.all(dim=1)
    x, pad = x[keep], pad[keep]
out, weights = mha(x, x, x, key_padding_mask=pad)  # here
out.sum().backward()
print("out", out.shape)
