"""Mixed precision (float16 autocast) with GradScaler from a large initial scale (2^32 is
Megatron's default; 2^48 legal too): the scaled gradients overflow for many steps in a
row while the scaler halves its scale and skips those steps."""
import hashlib
import sys

import torch
from torch import nn

init_scale = 2.0 ** int(sys.argv[1]) if len(sys.argv) > 1 else 2.0 ** 32
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
x = torch.randn(32, 8) * 10
y = torch.randint(0, 4, (32,))
skipped = 0
for step in range(40):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    before = scaler.get_scale()
    scaler.step(opt)
    scaler.update()
    skipped += scaler.get_scale() < before
print("skipped", skipped, "scale", scaler.get_scale(), "loss", round(loss.item(), 4))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
