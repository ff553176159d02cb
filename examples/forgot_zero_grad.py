"""Training without `optimizer.zero_grad()`: gradients pile up step after step.

Nothing crashes and nothing is NaN; the loss just behaves oddly because every step
applies the sum of all earlier gradients. mldebug's `grad_not_zeroed` assertion stops at
the second step of the optimizer; `inspect model` there shows the piled-up grad norms.

    python -m mldebug examples/forgot_zero_grad.py
"""
import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(128, 10)
y = x.sum(dim=1, keepdim=True)

for step in range(30):
    # the bug: optimizer.zero_grad() is missing here
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    if step % 10 == 0:
        print(f"step {step:2d}  loss {loss.item():.4f}  "
              f"grad norm {model[0].weight.grad.norm().item():.2f}")
print("final loss", loss.item())
