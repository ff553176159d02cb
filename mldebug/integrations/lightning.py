"""`MLDebugCallback` for Lightning: what `python -m mldebug` turns on, for a run launched
by Lightning's own entry point (a script calling `Trainer.fit`, a `LightningCLI`).

    trainer = L.Trainer(callbacks=[MLDebugCallback()])                 # watch + assertions
    trainer = L.Trainer(callbacks=[MLDebugCallback(record=True, every=10)])

A NaN/Inf or an assertion pauses at mldebug's prompt in `training_step` (stage forward:
the closure Lightning runs inside `optimizer.step` is the forward and backward), with
`trainer.global_step` as the stop's step; a recording counts Lightning's global steps.
`report="stops.jsonl"` appends every stop as one JSON line, as `--report` does.
Without a terminal (a scheduler's job) a stop writes its report line and ends the fit with
one `mldebug.core.errors.StopError` naming it, as `--batch` would (`batch=None`, the
default; `batch=True` always, `batch=False` never: the prompt reads stdin).
With `record=True` the recording is mirrored into the trainer's own TensorBoardLogger or
WandbLogger (`to="logger"`, the default; on global rank 0, whose loggers write), so its
histograms land in the run the user already opened; `to=None` keeps it in the store only,
and any `mldebug.record(to=)` target names another.
"""
from __future__ import annotations

try:
    from lightning.pytorch import Callback
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger
except ImportError:  # the standalone package
    from pytorch_lightning import Callback
    from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger

from .wiring import Wiring


class MLDebugCallback(Callback):
    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run=None, break_on=None,
                 report=None, to="logger", batch=None):
        super().__init__()
        self.to = to
        self.wiring = Wiring(watch=watch, assertions=assertions, record=record, every=every,
                             run_dir=run_dir, run=run, break_on=break_on, report=report,
                             batch=batch)

    def on_fit_start(self, trainer, pl_module) -> None:
        self.wiring.start(pl_module, step=trainer.global_step, recording=False)

    def on_train_start(self, trainer, pl_module) -> None:
        # (a checkpoint's global step is restored by now, not yet at fit start)
        to = self.to
        if to == "logger":
            to = _logger_targets(trainer) if self.wiring.record else None
        self.wiring.start_recording(pl_module, step=trainer.global_step, to=to)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.wiring.step(trainer.global_step)

    def on_fit_end(self, trainer, pl_module) -> None:
        self.wiring.close()

    def on_exception(self, trainer, pl_module, exception) -> None:
        try:
            # a NaN/Inf the watch still holds (read late, on a GPU) is the first stop,
            # naming the exception as what it led to (watch/before_exception.py)
            self.wiring.read_before(exception)
        finally:
            self.wiring.close(after_error=True)


def _logger_targets(trainer) -> list:
    """The trainer's TensorBoard and W&B loggers as `record(to=)` targets: a logger's
    SummaryWriter; its wandb run, with mldebug's step under Lightning's own x-axis key."""
    if not trainer.is_global_zero:       # (the other ranks' loggers write nothing)
        return []
    from ..record.sinks import WandbSink
    targets: list = []
    for logger in trainer.loggers:
        if isinstance(logger, TensorBoardLogger):
            targets.append(logger.experiment)
        elif isinstance(logger, WandbLogger):
            targets.append(WandbSink(logger.experiment, step_key="trainer/global_step"))
    return targets
