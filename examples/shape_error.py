"""A model whose layer sizes don't match: a RuntimeError deep inside torch.

mldebug opens a post-mortem prompt at *your* frame (`forward`, the line that calls the
mismatched layer), not inside torch; `inspect h` shows the shape that went in.

    python -m mldebug examples/shape_error.py
"""
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 8, 3)
        self.head = nn.Linear(8 * 28 * 28, 10)   # the bug: a 3x3 conv makes 26x26, not 28x28

    def forward(self, x):
        h = torch.relu(self.conv(x)).flatten(1)
        return self.head(h)


model = Net()
images = torch.randn(4, 1, 28, 28)
print(model(images).shape)
