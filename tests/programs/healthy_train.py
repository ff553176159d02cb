"""Healthy: a few steps of training an MLP and a small causal attention block with
AdamW, cross entropy, dropout and a -inf causal mask. Must never stop, and the weights
must come out bitwise identical with and without the watch (`model`, `opt` are read by
the tests).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
T, D, V = 8, 16, 11


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.qkv = nn.Linear(D, 3 * D)
        self.norm = nn.LayerNorm(D)
        self.mlp = nn.Sequential(nn.Linear(D, 4 * D), nn.GELU(), nn.Dropout(0.1), nn.Linear(4 * D, D))
        self.head = nn.Linear(D, V)

    def forward(self, idx):
        x = self.emb(idx)
        q, k, v = self.qkv(self.norm(x)).chunk(3, dim=-1)
        scores = (q @ k.transpose(-2, -1)) / D ** 0.5
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
        x = x + torch.softmax(scores.masked_fill(mask, float("-inf")), -1) @ v
        x = x + self.mlp(x)
        return self.head(x)


model = Block()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
for step in range(4):
    idx = torch.randint(0, V, (4, T))
    logits = model(idx)
    loss = F.cross_entropy(logits.flatten(0, 1), idx.roll(-1, 1).flatten())
    opt.zero_grad()
    loss.backward()
    opt.step()
print("loss", loss.item())
