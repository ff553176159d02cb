"""Cause: Adam with eps=0. A parameter whose gradient is 0 (an embedding row no batch has
used) has a zero second moment, and Adam's update divides 0 by sqrt(0) + eps = 0: the
parameter turns NaN in optimizer.step() (the marked line). Remedy: eps > 0 (1e-8).
`--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
emb = nn.Embedding(10, 4)
head = nn.Linear(4, 1)
params = list(emb.parameters()) + list(head.parameters())
opt = torch.optim.Adam(params, lr=1e-3, eps=1e-8 if FIXED else 0.0)
tokens = torch.tensor([1, 2, 3])                 # rows 0 and 4-9 get no gradient
for step in range(3):
    opt.zero_grad()
    loss = head(emb(tokens)).pow(2).mean()
    loss.backward()
    opt.step()  # here
print("loss", float(loss))
