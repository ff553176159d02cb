"""Healthy: causal attention with -inf masks (masked_fill and an additive mask).

The -Inf values are written deliberately as constants and flow on into the scores; the
softmax turns them into exact zeros. Nothing here may stop under the default rule.
"""
import torch
import torch.nn as nn

torch.manual_seed(0)
T, D = 6, 8


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.register_buffer("causal", torch.triu(torch.ones(T, T, dtype=torch.bool), 1))
        additive = torch.full((T, T), float("-inf")).triu(1)
        self.register_buffer("additive", additive)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / D ** 0.5
        masked = scores.masked_fill(self.causal, float("-inf"))
        a = torch.softmax(masked, dim=-1)
        b = torch.softmax(scores + self.additive, dim=-1)
        c = torch.softmax(torch.where(self.causal, float("-inf"), scores), dim=-1)
        return self.proj((a + b + c) @ v)


model = CausalSelfAttention()
x = torch.randn(2, T, D)
loss = model(x).pow(2).mean()
loss.backward()
print("loss", loss.item())
