"""Cause: AdamW on float16 parameters. Its eps=1e-8 is 0 in float16 (the smallest
float16 is 6e-8), so a parameter whose gradient is 0 (an embedding row no batch has
used) has a zero second moment, and the update divides 0 by sqrt(0) + 0: the parameter
turns NaN in optimizer.step() (the marked line). Remedy: keep the parameters in float32
and run the forward in float16 under torch.autocast. `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
emb = nn.Embedding(10, 4)
if not FIXED:
    emb = emb.half()
opt = torch.optim.AdamW(emb.parameters(), lr=1e-3)
tokens = torch.tensor([1, 2, 3])                 # rows 0 and 4-9 get no gradient
for step in range(3):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16, enabled=FIXED):
        loss = emb(tokens).float().pow(2).mean()
    loss.backward()
    opt.step()  # here
print("loss", loss.item())
