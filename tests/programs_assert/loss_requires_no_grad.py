"""Trips loss_requires_no_grad: the loss was computed under torch.no_grad()."""
import torch
import torch.nn as nn

model = nn.Linear(4, 1)
x = torch.randn(8, 4)
with torch.no_grad():
    loss = model(x).pow(2).mean()
try:
    loss.backward()  # here
except RuntimeError:
    pass    # torch refuses too: "element 0 of tensors does not require grad"
