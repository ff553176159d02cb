"""Healthy: a CNN with ReLU and an MLP with tanh, trained a few steps with SGD and Adam.
Must not trip any default assertion."""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
cnn = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                    nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                    nn.Flatten(), nn.Linear(8, 10))
mlp = nn.Sequential(nn.Linear(10, 32), nn.Tanh(), nn.Linear(32, 1))
opt1 = torch.optim.SGD(cnn.parameters(), lr=0.05, momentum=0.9)
opt2 = torch.optim.Adam(mlp.parameters(), lr=1e-3)
for step in range(12):
    x = torch.randn(16, 3, 8, 8)
    y = torch.randint(0, 10, (16,))
    opt1.zero_grad()
    loss = F.cross_entropy(cnn(x), y)
    loss.backward()
    opt1.step()
    z = torch.randn(32, 10)
    opt2.zero_grad(set_to_none=False)
    loss2 = F.mse_loss(mlp(z), z.sum(1, keepdim=True))
    loss2.backward()
    opt2.step()
print("healthy done", round(loss.item(), 3))
