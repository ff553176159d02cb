"""torch.func in training: per-sample gradients (vmap of grad over functional_call, as
DP-SGD computes them), a Jacobian (jacrev) and a gradient penalty (autograd.grad with
create_graph, as WGAN-GP): the model runs inside functorch's transforms, on its wrapped
tensors, and outside them."""
import hashlib

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x, y = torch.randn(16, 3), torch.randn(16, 1)


def sample_loss(params, xi, yi):
    out = functional_call(model, params, (xi.unsqueeze(0),))
    return ((out - yi) ** 2).mean()


for step in range(3):
    params = {k: v.detach() for k, v in model.named_parameters()}
    per_sample = vmap(grad(sample_loss), in_dims=(None, 0, 0))(params, x, y)
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample.values()]).norm(dim=0)
    jac = jacrev(lambda inp: model(inp).sum())(x[:2])
    xi = x.clone().requires_grad_(True)
    g, = torch.autograd.grad(model(xi).sum(), xi, create_graph=True)
    penalty = ((g.norm(dim=1) - 1) ** 2).mean()
    loss = nn.functional.mse_loss(model(x), y) + 0.1 * penalty
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("step", step, round(loss.item(), 6), round(norms.max().item(), 6),
          round(jac.abs().sum().item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
