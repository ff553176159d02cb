"""Planted bug: a padding mask combined with the causal mask masks out a whole row.

Query 0 of the second sequence may only attend to key 0, which is padding: its row of
scores is all -inf and softmax of it is 0/0 = NaN. The -Inf is a deliberate constant
(no stop), the NaN is created by the softmax (`# here`) in module 'attn'.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
T, D = 5, 8


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)

    def forward(self, x, pad):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / D ** 0.5
        causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        mask = causal | pad[:, None, :]           # (B, T, T): padded keys are masked
        scores = scores.masked_fill(mask, float("-inf"))
        weights = torch.softmax(scores, dim=-1)  # here
        return weights @ v


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, pad):
        return self.attn(x, pad)


x = torch.randn(2, T, D)
pad = torch.zeros(2, T, dtype=torch.bool)
pad[1, 0] = True                     # left padding in sequence 1: key 0 is padding
out = Model()(x, pad)
print("nan in output:", bool(out.isnan().any()))
