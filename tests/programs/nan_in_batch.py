"""Planted bug: a NaN read with the data (a sample of the data set, through a
DataLoader) reaches the model. The stop names the model call (the marked line) and the sample
(its dataset index) on the CPU; on a device, where the model's outputs are read at
`opt.step()`, it names the same line and says where it was found."""
import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

table = np.random.default_rng(0).standard_normal((32, 5)).astype(np.float32)
table[13, 2] = np.nan                     # a missing value, as read from a file
features, targets = torch.from_numpy(table[:, :4]), torch.from_numpy(table[:, 4:])
data = TensorDataset(features, targets)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in DataLoader(data, batch_size=8):
    out = model(x)  # here
    loss = ((out - y) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print("trained")
