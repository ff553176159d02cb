"""Trips param_no_grad: a layer built and handed to the optimizer but never used."""
import torch
import torch.nn as nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.extra = nn.Linear(8, 8)     # never called in forward
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(torch.relu(self.body(x)))


torch.manual_seed(0)
model = Net()
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
x = torch.randn(16, 8)
for step in range(12):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()  # here
