"""nn.TransformerEncoder with the causal mask torch makes for it
(generate_square_subsequent_mask: -inf above the diagonal), passed into the model call."""
import hashlib

import torch
from torch import nn

torch.manual_seed(0)
layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, dropout=0.0,
                                   batch_first=True)
model = nn.TransformerEncoder(layer, num_layers=2, enable_nested_tensor=False)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(4, 7, 16)
mask = nn.Transformer.generate_square_subsequent_mask(7)
for step in range(4):
    out = model(x, mask=mask, is_causal=True)
    loss = out.pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    print("loss", round(loss.item(), 6))
data = b"".join(p.detach().numpy().tobytes() for p in model.parameters())
print("weights", hashlib.sha256(data).hexdigest())
