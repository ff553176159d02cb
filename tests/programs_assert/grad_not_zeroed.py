"""Trips grad_not_zeroed: optimizer.zero_grad() is missing."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(32, 10)
for step in range(3):
    loss = (model(x) - 1).pow(2).mean()
    loss.backward()
    opt.step()  # here
