"""A classifier whose hand-written cross-entropy turns into NaN.

The bug: `torch.log(torch.softmax(logits))` instead of `log_softmax`. When the logits
grow, softmax underflows to exactly 0 for the losing classes, log(0) = -inf, and
`0 * -inf` in the loss is NaN. Plain PyTorch trains on with a NaN loss; mldebug stops at
the `torch.log` line, the op that made the -Inf from finite inputs.

    python -m mldebug examples/nan_loss.py
"""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
inputs = torch.randn(256, 20) * 8          # badly scaled features: logits grow fast
targets = torch.randint(0, 5, (256,))


def cross_entropy(logits, target):
    probs = torch.softmax(logits, dim=1)
    log_probs = torch.log(probs)           # the bug: underflows to log(0) = -inf
    one_hot = nn.functional.one_hot(target, 5).float()
    return -(one_hot * log_probs).sum(dim=1).mean()


for step in range(200):
    optimizer.zero_grad()
    loss = cross_entropy(model(inputs), targets)
    loss.backward()
    optimizer.step()
    if step % 20 == 0:
        print(f"step {step:3d}  loss {loss.item():.4f}")
print("final loss", loss.item())
