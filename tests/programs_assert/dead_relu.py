"""Trips dead_relu: a bias initialised far negative kills most ReLU units."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1))
with torch.no_grad():
    model[0].bias.fill_(-5.0)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 16), torch.randn(64, 1)
for step in range(2):
    opt.zero_grad()
    loss = F.mse_loss(model(x), y)  # here
    loss.backward()
    opt.step()
