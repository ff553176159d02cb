# A NaN made inside a module's forward (head: log of negative values, from the third call
# on): the watch stops on the marked line, and the graph of the pass marks head#0.
import torch
from torch import nn


class Head(nn.Module):
    shift = -10.0

    def forward(self, h):
        return torch.log(h - self.shift)  # here


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 3)
        self.act = nn.ReLU()
        self.head = Head()

    def forward(self, x):
        return self.head(self.act(self.fc(x)))


torch.manual_seed(0)
model = Net()
x = torch.randn(2, 4)
model(x)            # two healthy calls: the watch knows the model's calls by now
model(x)
Head.shift = 10.0   # log of values below 0 from here
out = model(x)
print("finished", "nan" if torch.isnan(out).any() else "ok")
