"""Mixed precision with a loss scale that overflows: float16 autocast and
`GradScaler(init_scale=2**40)` on a small causal transformer block (LayerNorm, a -inf
causal mask, scaled-dot-product attention). The float16 gradients overflow to Inf, and
the float32 backward of LayerNorm and of the attention make NaN from those Infs; the
scaler skips each such step and halves its scale, as it is meant to, until it fits."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)


class Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.head = nn.Linear(d, 50)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads) \
            .permute(2, 0, 3, 1, 4)
        mask = torch.full((t, t), float("-inf")).triu(1)
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(q.dtype))
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


model = Block()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)
x, y = torch.randn(4, 12, 32), torch.randint(0, 50, (4, 12))
for step in range(30):
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten())
    opt.zero_grad()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    if step % 5 == 4:
        print("step", step, round(loss.item(), 4), "scale", scaler.get_scale())
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
