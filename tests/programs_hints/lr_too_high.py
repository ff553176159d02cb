"""Cause: a learning rate too high. Plain SGD at lr=0.5 on badly scaled inputs diverges:
the weight's norm grows many-fold each step until the forward overflows (the marked
line). Remedy: a lower learning rate (or clip_grad_norm_, warm-up). `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
model = nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=1e-4 if FIXED else 0.5)
x = torch.randn(64, 8) * 10
y = x.sum(-1, keepdim=True)
for step in range(60):
    opt.zero_grad()
    loss = (model(x) - y).pow(2).mean()  # here
    loss.backward()
    opt.step()
print("loss", float(loss))
