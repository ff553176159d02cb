"""A dataset with one corrupt record, read through a shuffling DataLoader with workers.

    python -m mldebug examples/corrupt_record.py

Plain PyTorch trains on with `loss nan` from the batch that holds record 77. mldebug
stops at the line where that batch enters the model and names the sample:
`...; in the data: x row 11 (dataset index 77)`.
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class Records(Dataset):
    def __init__(self, n=200):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = self.x.sum(1, keepdim=True)
        self.x[77, 3] = float("nan")          # one corrupt record, as from a bad file

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Records(), batch_size=16, shuffle=True, num_workers=2)
    for epoch in range(2):
        for step, (x, y) in enumerate(loader):
            pred = model(x)  # the batch enters the model here
            loss = nn.functional.mse_loss(pred, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print(f"epoch {epoch}  loss {loss.item():.4f}")


if __name__ == "__main__":   # DataLoader workers import this file: guard the training
    main()
