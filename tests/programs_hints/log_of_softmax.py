"""Cause: log of a softmax output that underflowed to 0. With logits in the hundreds the
unlikely classes' probabilities are exactly 0.0 in float32 and log(0) = -Inf (the marked
line). Remedy: torch.log_softmax, which never forms the probabilities.
`--fixed` applies it."""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
model = nn.Linear(8, 10)
with torch.no_grad():
    model.weight.mul_(200.0)               # a badly scaled layer: logits in the hundreds
x = torch.randn(4, 8)
target = torch.tensor([1, 2, 3, 4])
logits = model(x)
if FIXED:
    logp = torch.log_softmax(logits, dim=-1)
else:
    logp = torch.log(torch.softmax(logits, dim=-1))  # here
loss = nn.functional.nll_loss(logp, target)
loss.backward()
print("loss", float(loss))
