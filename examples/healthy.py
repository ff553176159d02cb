"""A healthy run: an MLP learns a small regression task. mldebug must not stop here,
and the trained weights are bitwise the same with and without it.

    python -m mldebug examples/healthy.py
"""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 1))
optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
x = torch.randn(512, 16)
y = (x[:, :4].sum(dim=1, keepdim=True)).sin()

for step in range(100):
    optimizer.zero_grad()
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
print(f"final loss {loss.item():.4f}")
