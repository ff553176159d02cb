"""Trips loss_not_scalar: reduction='none' leaves a loss per element."""
import torch
import torch.nn as nn
import torch.nn.functional as F

model = nn.Linear(4, 1)
x, y = torch.randn(8, 4), torch.randn(8, 1)
loss = F.mse_loss(model(x), y, reduction="none")
try:
    loss.backward()  # here
except RuntimeError:
    pass    # torch refuses too: "grad can be implicitly created only for scalar outputs"
