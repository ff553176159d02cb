"""Cause: mixed precision with GradScaler, stepped with `optimizer.step()`. The scaled
float16 gradients overflow while the scaler calibrates its scale; `scaler.unscale_` finds
the Inf and `clip_grad_norm_` turns it into NaN (inf * 0), which is fine: `scaler.step`
would skip this step. `optimizer.step()` does not, and writes the NaN into the
parameters (the marked line). Remedy: `scaler.step(optimizer)`. `--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
for step in range(4):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    if FIXED:
        scaler.step(opt)
    else:
        opt.step()  # here
    scaler.update()
print("loss", loss.item(), "scale", scaler.get_scale())
