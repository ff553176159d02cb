"""A classifier whose hand-written cross-entropy turns into NaN.

The bug: `torch.log(torch.softmax(logits))` instead of `log_softmax`. When the logits
grow, softmax underflows for the losing classes: at first to a denormal (~2e-42), whose
log is still finite but whose derivative 1/p overflows. The first Inf of the run is made
in *backward*, by `LogBackward0`, in step 1; a few steps later the forward pass makes
log(0) = -inf too and the loss turns NaN. Plain PyTorch trains on with a NaN loss;
`torch.autograd.detect_anomaly` raises one node later, once the Inf has become a NaN.
mldebug stops at the first one: the backward Inf, reported against the forward
`torch.log` line that built the node, while paused at the backward call.

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
