"""bfloat16 autocast on the CPU: matmuls in bfloat16, the loss in float32."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 5))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
x = torch.randn(64, 16)
y = torch.randint(0, 5, (64,))
for step in range(8):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 5))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
