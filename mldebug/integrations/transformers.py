"""`MLDebugCallback` for Hugging Face's `Trainer`: what `python -m mldebug` turns on, for a
run launched by the Trainer (a script, `accelerate launch`, an example's own CLI).

    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[MLDebugCallback(record=True, every=10)])

A NaN/Inf or an assertion pauses at mldebug's prompt in your `compute_loss` or model
code, with `state.global_step` as the stop's step; a recording counts the Trainer's
global steps. `report="stops.jsonl"` appends every stop as one JSON line.
"""
from __future__ import annotations

from transformers import TrainerCallback

from .wiring import Wiring


class MLDebugCallback(TrainerCallback):
    def __init__(self, watch: bool = True, assertions: bool = True, record: bool = False,
                 every: int = 1, run_dir: str = "runs", run=None, break_on=None,
                 report=None):
        self.wiring = Wiring(watch=watch, assertions=assertions, record=record, every=every,
                             run_dir=run_dir, run=run, break_on=break_on, report=report)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.wiring.start(model, step=state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self.wiring.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.wiring.close()
