"""A Lightning run launched by Lightning itself (no `python -m mldebug`): the callback
turns on the NaN/Inf watch and the assertions. At step 3 `training_step` takes the log of
a value that is not positive; mldebug stops there, in `training_step`, at step 3.

    python examples/lightning_callback.py
"""
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import lightning as L
from mldebug.integrations.lightning import MLDebugCallback


class Regressor(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        pred = self.net(x)
        scale = 1.0 - self.global_step / 3          # reaches 0 at step 3
        return torch.log(scale * ((pred - y) ** 2).mean())   # the bug: log of 0


    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


if __name__ == "__main__":
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(128, 4), torch.randn(128, 1))
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[MLDebugCallback()])
    trainer.fit(Regressor(), DataLoader(data, batch_size=16))
    print("trained", trainer.global_step, "steps")
