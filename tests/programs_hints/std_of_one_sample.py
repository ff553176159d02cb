"""Cause: a standard deviation of one sample. std with the default correction=1 over one
element is 0 / 0 (the marked line): the last batch of an epoch held a single sample.
Remedy: correction=0 (or skip batches of one). `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
data = torch.randn(9, 3)
for start in range(0, 9, 4):                     # batches of 4, 4 and 1
    batch = data[start:start + 4]
    if FIXED:
        spread = batch.std(0, correction=0)
    else:
        spread = batch.std(0)  # here
    print("spread", spread.tolist())
