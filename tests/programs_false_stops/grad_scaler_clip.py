"""Mixed precision with GradScaler and gradient clipping, the documented recipe:
`scaler.scale(loss).backward(); scaler.unscale_(opt); clip_grad_norm_(...);
scaler.step(opt); scaler.update()`. While the scaler calibrates, an overflowing step's
gradients hold Inf and the clip multiplies them by max_norm / inf = 0: NaN, in a step
`scaler.step` skips."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 24)
x, y = torch.randn(32, 8), torch.randint(0, 4, (32,))
for step in range(12):
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    scaler.scale(loss).backward()
    scaler.unscale_(opt)
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    scaler.step(opt)
    scaler.update()
    print(step, round(loss.item(), 5), float(norm), scaler.get_scale())
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
