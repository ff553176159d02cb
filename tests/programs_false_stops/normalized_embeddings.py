"""Contrastive embeddings with a padded sample: its embedding is all zero, and
F.normalize (inside the model and again in the loss) and a norm penalty meet that zero
row. torch's derivative of the norm there is 0/0, which its own backward formula masks
(`(grad / norm).masked_fill_(norm == 0, 0)`): every gradient stays finite."""
import hashlib

import torch
import torch.nn.functional as F
from torch import nn


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 16)

    def forward(self, x, keep):
        h = self.proj(x) * keep[:, None]           # padded rows: all zero
        return F.normalize(h, dim=1)               # the zero row stays zero


torch.manual_seed(0)
model = Encoder()
head = nn.Linear(16, 16)
opt = torch.optim.SGD([*model.parameters(), *head.parameters()], lr=0.1)
keep = (torch.arange(6) != 2).float()               # sample 2 is padding
for step in range(5):
    x = torch.randn(6, 8)
    z = F.normalize(head(model(x, keep)) * keep[:, None], dim=1)
    similarity = z @ z.T / 0.5
    loss = F.cross_entropy(similarity, torch.arange(6)) + 1e-3 * (z * keep[:, None]).norm()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 6))
weights = torch.cat([p.detach().flatten() for p in opt.param_groups[0]["params"]])
print("weights", hashlib.sha256(weights.numpy().tobytes()).hexdigest())
