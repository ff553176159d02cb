"""Planted bug: sampling at temperature 0. `logits / 0` is +-Inf (the marked line), softmax of
it NaN, and `torch.multinomial` raises "probability tensor contains either inf, nan or
element < 0" on the next line: on a GPU the usual face of a NaN in generation code. The
first stop is the Inf at the division, on every path."""
import torch

torch.manual_seed(0)
logits = torch.randn(2, 5)
temperature = 0.0
probs = torch.softmax(logits / temperature, dim=-1)  # here
token = torch.multinomial(probs, num_samples=1)     # raises RuntimeError
print("tokens", token.tolist())
