"""Trips update_ratio (opt-in): a learning rate far too high moves weights by ~their size."""
import torch
import torch.nn as nn

import mldebug

mldebug.assertions.set_enabled("update_ratio", True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=50.0)
x, y = torch.randn(16, 8), torch.randn(16, 1)
opt.zero_grad()
loss = (model(x) - y).pow(2).mean()
loss.backward()
opt.step()  # here
