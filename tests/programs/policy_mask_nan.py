"""Planted bug: an action mask leaves a state with no legal action; the renormalised
probabilities of that row are 0/0 = NaN (the marked line), and `Categorical(probs=...)` then
raises its Simplex ValueError on the next line. The first stop is the NaN at the
division, on the CPU and on a device (where it is read before the ValueError is
reported, which it names as what it led to)."""
import torch
from torch.distributions import Categorical

torch.manual_seed(0)
logits = torch.randn(4, 3)
mask = torch.ones(4, 3)
mask[2] = 0                                # a state with no legal action
probs = torch.softmax(logits, -1) * mask
probs = probs / probs.sum(-1, keepdim=True)  # here
policy = Categorical(probs=probs)          # raises ValueError (Simplex) on the NaN row
print("actions", policy.sample().tolist())
