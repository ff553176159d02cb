"""A program that makes its own checks: a table with Inf and NaN entries (a literal),
rows with any of them dropped by torch.isfinite, a loss checked with torch.isnan /
torch.isinf before each step, and clip_grad_norm_'s total norm checked too."""
import hashlib

import torch
from torch import nn

table = torch.tensor([[0.5, 1.0, 2.0],
                      [float("inf"), 1.0, 0.0],
                      [1.5, float("nan"), 2.5],
                      [0.1, 0.2, 0.3],
                      [-1.0, 0.0, float("-inf")],
                      [2.0, 2.0, 1.0]])
good = torch.isfinite(table).all(1)
print("bad rows", (~good).nonzero().flatten().tolist(),
      "inf", int(torch.isinf(table).sum()), "nan", int(torch.isnan(table).sum()))
x = table[good]
y = x.sum(1, keepdim=True)
torch.manual_seed(0)
model = nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
for step in range(6):
    loss = nn.functional.mse_loss(model(x), y)
    if torch.isnan(loss) or torch.isinf(loss):
        print("skipped a step")
        continue
    opt.zero_grad()
    loss.backward()
    norm = nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    assert torch.isfinite(norm)
    opt.step()
    print("loss", round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
