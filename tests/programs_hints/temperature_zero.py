"""Cause: sampling at temperature 0. logits / 0 is +-Inf (the marked line), and softmax of
it is NaN. Remedy: clamp the temperature away from 0 (or take the argmax for greedy
decoding). `--fixed` applies it."""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
logits = torch.randn(2, 5)
temperature = 0.0
if FIXED:
    temperature = max(temperature, 1e-5)
probs = torch.softmax(logits / temperature, dim=-1)  # here
token = torch.multinomial(probs, num_samples=1)
print("tokens", token.tolist())
