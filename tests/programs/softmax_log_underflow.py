"""Planted bug: log(softmax(x)) computed in two steps.

With large logits the softmax underflows to exactly 0.0 for the unlikely classes, and
log(0) = -Inf. The log CREATES the -Inf from finite inputs (a stop at the `# here` line;
the fix is torch.log_softmax). Runs to the end without the watch (the loss is Inf).
"""
import torch
import torch.nn as nn

torch.manual_seed(0)


class NaiveLogSoftmax(nn.Module):
    def forward(self, logits):
        probs = torch.softmax(logits, dim=-1)
        return torch.log(probs)  # here


model = nn.Sequential(nn.Linear(8, 10), NaiveLogSoftmax())
with torch.no_grad():
    model[0].weight.mul_(200.0)          # a badly scaled layer: logits in the hundreds
x = torch.randn(4, 8)
target = torch.tensor([1, 2, 3, 4])
logp = model(x)
loss = nn.functional.nll_loss(logp, target)
print("loss", loss.item())
