"""Trips exploding_gradients: at step 6 the loss is (by a bug) scaled by 1e6."""
import torch
import torch.nn as nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 8), torch.randn(32, 1)
for step in range(8):
    opt.zero_grad()
    scale = 1e6 if step == 6 else 1.0   # the bug: a sum where a mean was meant, say
    loss = (model(x) - y).pow(2).mean() * scale
    loss.backward()  # here
    opt.step()
