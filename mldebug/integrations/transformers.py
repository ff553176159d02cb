"""`MLDebugCallback` for Hugging Face's `Trainer`: what `python -m mldebug` turns on, for a
run launched by the Trainer (a script, `accelerate launch`, an example's own CLI).

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MLDebugCallback(record=True, every=10)])

A NaN/Inf or an assertion pauses at mldebug's prompt in your `compute_loss` or model
code, with `state.global_step` as the stop's step; a recording counts the Trainer's
global steps. `report="stops.jsonl"` appends every stop as one JSON line.
Without a terminal (a scheduler's job) a stop writes its report line and ends the
training with one `mldebug.core.errors.StopError` naming it, as `--batch` would
(`batch=None`, the default; `batch=True` always, `batch=False` never: the prompt reads
stdin). The Trainer has no exception callback: an exception that leaves the program
first has what the watch still holds read (on a GPU, a NaN that caused it is the stop),
through `sys.excepthook` while training runs (integrations/wiring.py).
With `record=True` the recording is mirrored into the Trainer's own reporting (`to="logger"`,
the default): the SummaryWriter of `report_to="tensorboard"` and the run of
`report_to="wandb"`, on the main process; `to=None` keeps it in the store only, and any
`mldebug.record(to=)` target names another.
"""
from __future__ import annotations

import sys

from transformers import TrainerCallback

from .wiring import Wiring


class MLDebugCallback(TrainerCallback):
    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run=None, break_on=None,
                 report=None, to="logger", batch=None):
        self.to = to
        self.wiring = Wiring(watch=watch, assertions=assertions, record=record, every=every,
                             run_dir=run_dir, run=run, break_on=break_on, report=report,
                             batch=batch)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        to = self.to
        if to == "logger":
            # (the Trainer's handler calls this with itself as `self`; its reporting
            # callbacks come first, so their writer and run are open by now)
            handler = sys._getframe(1).f_locals.get("self")
            to = _reporting_targets(self, handler, args, state) if self.wiring.record else None
        self.wiring.start(model, step=state.global_step, to=to)
        # (the Trainer has no exception callback: an error that ends the program is
        # where what the watch still holds is read, before its traceback)
        self.wiring.read_before_uncaught()

    def on_step_begin(self, args, state, control, **kwargs):
        self.wiring.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.wiring.close()


def _reporting_targets(callback, handler, args, state) -> list:
    """The SummaryWriter of the Trainer's TensorBoardCallback (found among the callbacks
    of HANDLER, the CallbackHandler that holds CALLBACK) and the wandb run of
    `report_to="wandb"`, as `record(to=)` targets, mldebug's step under the Trainer's
    own x-axis key in W&B."""
    if not state.is_world_process_zero:
        return []
    targets: list = []
    callbacks = getattr(handler, "callbacks", None) or []
    if any(c is callback for c in callbacks):
        from transformers.integrations import TensorBoardCallback
        for c in callbacks:
            if isinstance(c, TensorBoardCallback) and getattr(c, "tb_writer", None) is not None:
                targets.append(c.tb_writer)
    if "wandb" in (args.report_to or []):
        wandb = sys.modules.get("wandb")
        if wandb is not None and wandb.run is not None:
            from ..record.sinks import WandbSink
            targets.append(WandbSink(wandb.run, step_key="train/global_step"))
    return targets
