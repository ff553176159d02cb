"""Cause: a NaN that came in with the data. One record of the data set holds a NaN; the
first op that reads its batch stops (the marked line) and names the dataset index.
Remedy: fix or drop the record in the data pipeline. `--fixed` applies it."""
import sys

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Records(Dataset):
    def __init__(self):
        self.x = np.random.default_rng(0).standard_normal((12, 4), dtype=np.float32)
        self.x[7, 1] = float("nan")               # a corrupt record
        if FIXED:                                  # drop the records that are not finite
            self.x = self.x[np.isfinite(self.x).all(axis=1)]

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return torch.from_numpy(self.x[i])


model = nn.Linear(4, 1)
for batch in DataLoader(Records(), batch_size=4):
    out = model(batch)  # here
print("done")
