"""Trips vanishing_gradients (opt-in): a deep sigmoid stack without normalisation."""
import torch
import torch.nn as nn

import mldebug

mldebug.assertions.set_enabled("vanishing_gradients", True)
torch.manual_seed(0)
layers = []
for _ in range(24):
    layers += [nn.Linear(16, 16), nn.Sigmoid()]
model = nn.Sequential(*layers, nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 16)
opt.zero_grad()
loss = model(x).pow(2).mean()
loss.backward()  # here
opt.step()
