"""Trips param_not_updated (opt-in): the head is replaced after the optimizer was built."""
import torch
import torch.nn as nn

import mldebug

mldebug.assertions.set_enabled("param_not_updated", True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
model[2] = nn.Linear(8, 2)          # the bug: opt still holds the old head's parameters
x = torch.randn(16, 8)
opt.zero_grad()
loss = model(x).pow(2).mean()
loss.backward()
opt.step()  # here
