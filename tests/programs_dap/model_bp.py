# A breakpoint() after a clean forward pass of a small model: the graph capture that every
# mldebug launch runs has the pass, nothing marked.
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
out = model(torch.randn(3, 4))
breakpoint()  # here
print("finished", out.shape)
