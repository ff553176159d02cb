"""Losses whose gradients torch's own backward formulas compute through an Inf or a NaN
they then discard themselves (`torch.where`): a Cox partial likelihood with censored
samples (logcumsumexp's backward takes log|grad| of their zero gradients), a
cross-entropy against a prior that is 0 on masked actions (`torch.special.xlogy`), and
volume rendering with an opaque sample (cumprod's backward meets its exact 0). Every
gradient stays finite."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
risk_net, policy, density = nn.Linear(4, 1), nn.Linear(4, 3), nn.Linear(4, 4)
params = [*risk_net.parameters(), *policy.parameters(), *density.parameters()]
opt = torch.optim.Adam(params, lr=1e-2)
legal = torch.tensor([[True, True, False], [True, True, True]])
prior = torch.tensor([[0.5, 0.5, 0.0], [0.2, 0.3, 0.5]])
colors = torch.tensor([0.1, 0.9, 0.3, 0.2])
for step in range(4):
    x, time = torch.randn(8, 4), torch.rand(8)
    event = (torch.rand(8) > 0.4).float()                  # 0: censored
    order = torch.argsort(time, descending=True)
    risk, happened = risk_net(x[order]).squeeze(-1), event[order]
    cox = -((risk - torch.logcumsumexp(risk, dim=0)) * happened).sum() / happened.sum().clamp(min=1)

    p = policy(torch.randn(2, 4)).masked_fill(~legal, float("-inf")).softmax(-1)
    cross_entropy = -torch.special.xlogy(p, prior).sum(-1).mean()

    sigma = density(torch.randn(1, 4)).exp() * torch.tensor([1.0, 1e3, 1.0, 1.0])
    alpha = 1 - torch.exp(-sigma)                          # the opaque sample: exactly 1
    transmittance = torch.cumprod(1 - alpha, dim=-1)
    weights = alpha * torch.cat([torch.ones(1, 1), transmittance[:, :-1]], -1)
    rendering = ((weights * colors).sum() - 0.5) ** 2

    loss = cox + cross_entropy + rendering
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", repr(loss.item()))
data = b"".join(p.detach().numpy().tobytes() for p in params)
print("weights", hashlib.sha256(data).hexdigest())
