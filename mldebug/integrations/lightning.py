"""`MLDebugCallback` for Lightning: what `python -m mldebug` turns on, for a run launched
by Lightning's own entry point (a script calling `Trainer.fit`, a `LightningCLI`).

    trainer = L.Trainer(callbacks=[MLDebugCallback()])                 # watch + assertions
    trainer = L.Trainer(callbacks=[MLDebugCallback(record=True, every=10)])

A NaN/Inf or an assertion pauses at mldebug's prompt in `training_step` (stage forward:
the closure Lightning runs inside `optimizer.step` is the forward and backward), with
`trainer.global_step` as the stop's step; a recording counts Lightning's global steps.
`report="stops.jsonl"` appends every stop as one JSON line, as `--report` does.
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
except ImportError:  # the standalone package
    from pytorch_lightning import Callback

from .wiring import Wiring


class MLDebugCallback(Callback):
    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run=None, break_on=None,
                 report=None):
        super().__init__()
        self.wiring = Wiring(watch=watch, assertions=assertions, record=record, every=every,
                             run_dir=run_dir, run=run, break_on=break_on, report=report)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.wiring.start(pl_module, step=trainer.global_step, recording=False)

    def on_train_start(self, trainer, pl_module) -> None:
        # (a checkpoint's global step is restored by now, not yet at fit start)
        self.wiring.start_recording(pl_module, step=trainer.global_step)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.wiring.step(trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.wiring.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        self.wiring.close()
