"""Trips saturated_activation (opt-in): unnormalised inputs x100 into a tanh."""
import torch
import torch.nn as nn

import mldebug

mldebug.assertions.set_enabled("saturated_activation", True)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1))
x = torch.randn(64, 8) * 100
out = model(x)  # here
out.mean().backward()
