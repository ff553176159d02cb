"""Planted bug: one sample of the data set holds a NaN (corrupt data).

The DataLoader runs with num_workers=2: the worker processes are not watched, the NaN
travels to the main process inside a batch, and the first watched op that reads it (the
first Linear's addmm, `# here`) stops: created=False, it came in through that op's input.
"""
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

torch.manual_seed(0)
BAD = 6


class Samples(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(16, 4, generator=g).numpy()
        self.x[BAD, 2] = float("nan")     # the corrupt record (a numpy array, no torch op)
        self.y = torch.randn(16, 1, generator=g).numpy()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i]), torch.from_numpy(self.y[i])


def main():
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    loader = DataLoader(Samples(), batch_size=4, num_workers=2)
    total = 0.0
    for xb, yb in loader:
        pred = model(xb)  # here
        total += nn.functional.mse_loss(pred, yb).item()
    print("loss sum", total)


if __name__ == "__main__":
    main()
