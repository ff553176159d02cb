"""Planted bug: attention scores in float16 without the 1/sqrt(d) scale.

q @ k^T sums 64 products of values around 40: far beyond float16's max (65504), so the
matmul CREATES +-Inf from finite inputs (`# here`), in module 'attn' (Scores).
"""
import torch
import torch.nn as nn

torch.manual_seed(0)


class Scores(nn.Module):
    def forward(self, q, k):
        return q @ k.t()  # here


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Scores()

    def forward(self, q, k):
        return torch.softmax(self.attn(q, k).float(), dim=-1)


q = (torch.rand(8, 64) * 40 + 20).half()
k = (torch.rand(8, 64) * 40 + 20).half()
p = Net()(q, k)
print("attention row sums", p.sum(-1).tolist())
