"""Planted bug: a learning rate off by many orders of magnitude.

Forward and backward are finite; SGD's update `p.add_(grad, alpha=-lr)` overflows
float32 inside optimizer.step() (`# here`): stage 'optimizer', parameter '0.weight'.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)

model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e36)   # meant 1e-3
x = torch.randn(16, 4)
y = torch.full((16, 1), 1000.0)
for step in range(2):
    opt.zero_grad()
    loss = (model(x) - y).pow(2).sum()
    loss.backward()
    opt.step()  # here
print("weight", model[0].weight.flatten()[:4].tolist())
