"""Planted bug: forward finite, backward infinite.

sqrt(x) of a ReLU output is fine in forward (sqrt(0) = 0), but its derivative
1 / (2 sqrt(x)) is infinite at 0: SqrtBackward0 divides by zero. The stop is in backward
(node SqrtBackward0), reported against the forward line that built the node (`# here`),
in module '2' (RootFeature).
"""
import torch
import torch.nn as nn

torch.manual_seed(0)


class RootFeature(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # here


model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), RootFeature(), nn.Linear(6, 1))
x = torch.randn(8, 4)
loss = model(x).pow(2).mean()
loss.backward()
print("grad norm", model[0].weight.grad.norm().item())
