"""A correct loop with torch's multi-tensor (foreach) kernels on the CPU, as a GPU's
optimizer uses them by default: Adam(foreach=True), gradients zeroed in place
(`zero_grad(set_to_none=False)`: `_foreach_zero_`) and clipped (`clip_grad_norm_`:
`_foreach_mul_`). Nothing here accumulates gradients across steps."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.01, foreach=True)
x, y = torch.randn(32, 6), torch.randn(32, 1)
for step in range(5):
    opt.zero_grad(set_to_none=False)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)
    opt.step()
    print("step", step, "loss", round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
