"""TorchScript: a scripted module, then a model traced with `torch.jit.trace` (the tracer
runs it twice and compares the graphs) and trained through the trace."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
scripted = torch.jit.script(nn.Linear(8, 8))
net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))
traced = torch.jit.trace(net, torch.randn(2, 4))
opt = torch.optim.SGD(traced.parameters(), lr=0.1)
x, y = torch.randn(32, 4), torch.randn(32, 1)
for step in range(4):
    loss = (traced(x) - y).pow(2).mean() + scripted(torch.ones(1, 8)).pow(2).mean() * 0
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in net.parameters())
print("weights", hashlib.sha256(data).hexdigest())
