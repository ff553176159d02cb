"""Missing values marked with NaN on purpose (x[mask] = nan), then cleaned before the
model: nan_to_num for one block of features, torch.where(isnan) for another, and the
column means by nanmean as the fill of a third."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
x = torch.randn(64, 9)
x[torch.rand(64, 9) < 0.2] = float("nan")              # missing: marked on purpose
print("missing", int(torch.isnan(x).sum()))
means = x[:, 6:].nanmean(0)                             # column means without the gaps
clean = torch.cat([
    torch.nan_to_num(x[:, :3], nan=0.0),
    torch.where(torch.isnan(x[:, 3:6]), torch.zeros_like(x[:, 3:6]), x[:, 3:6]),
    torch.where(torch.isnan(x[:, 6:]), means.expand(64, 3), x[:, 6:]),
], 1)
y = clean.sum(1, keepdim=True)
model = nn.Sequential(nn.Linear(9, 16), nn.ReLU(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(6):
    loss = nn.functional.mse_loss(model(clean), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
