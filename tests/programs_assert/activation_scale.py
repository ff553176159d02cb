"""Trips activation_scale (opt-in): weights initialised 5x too large, no normalisation."""
import torch
import torch.nn as nn

import mldebug

mldebug.assertions.set_enabled("activation_scale", True)
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(8)])
with torch.no_grad():
    for layer in model:
        layer.weight.mul_(5.0)
x = torch.randn(16, 32)
out = model(x)  # here
