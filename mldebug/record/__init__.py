"""Record what a model's tensors do over training steps, stored per run (SQLite).

    rec = mldebug.record(model, log=("io", "io_grad", "params", "params_grad"), every=10,
                         run_dir="runs", run="baseline")
    for x, y in data:
        opt.zero_grad(); loss = f(model(x), y); loss.backward(); opt.step()
        mldebug.log_scalar("loss", loss)       # KPI curve (a tensor is read without a sync)
    rec.close()                                # or: with mldebug.record(...) as rec:

    run = mldebug.record.open_run("runs/baseline.sqlite")
    run.stats("fc:output[0]")                  # [{step, call, mean, abs_mean, std, ...}]
    python -m mldebug runs runs/               # list runs and their steps

What a step is
    By default a step ends at `optimizer.step()` of any optimizer that holds a parameter
    of the model (global optimizer hooks; several such optimizers stepping in a row end
    one step each). Steps are numbered from 0 (from `first_step=N` when a resumed run
    starts recording at its global step N). `rec.step()` ends a step by hand: its first
    call turns the optimizer counting off (or pass `step="manual"`). Step N is recorded
    when N % every == 0 (or `every(N)` is true for a callable).

What is recorded on a recorded step (`log=`)
    io           every floating input and output of each chosen module invocation, when
                 the module returns (a tensor passed on unchanged is computed once)
    io_grad      the gradient of the loss w.r.t. those tensors (a tensor hook, so it is
                 the tensor's whole gradient), plus per-sample gradient norms along
                 `batch_dim` (default 0)
    params       each parameter of the chosen modules, before the optimizer updates it
    params_grad  their .grad, read at the same moment
    Each as a row: numel, mean, abs_mean, std, abs_max, min, max (of the finite values),
    nan, posinf, neginf counts, and a histogram: `bins` bins of a fixed random sample of
    `sample` values (every value when fewer), range = [min, max] clipped to
    mean ± `clip`·std (None: no clipping); sample values outside count as below/above.

Choosing modules
    modules=   among model.modules(); children= among model.children(): a type (or tuple
               of types), an index, a path pattern ('encoder.*', '(root)' for the model
               itself), a callable (path, module) -> bool, a list of these, or True for all.
               Default: every module. `training_only` (default True) skips invocations
               of modules in eval mode.
    condition= callable(module, inputs, output) -> bool, asked at each invocation (the
               torchfunc recorder's condition); False skips it.
    capture=   Capture(modules, what, reduction) items: full tensors of chosen layers
               (what: 'pre_input', 'input', 'output', 'input_grad', 'output_grad' =
               torchfunc's ForwardPre, ForwardInput, ForwardOutput, BackwardInput,
               BackwardOutput), combined over a step's invocations by `reduction`.

Named tensors, scalars, notes (module functions; no-ops when nothing records)
    mldebug.log_tensor(name, t, role="")    stats + histogram of t, on recorded steps
    mldebug.log_scalar(name, v)             every step; written with the next recorded
                                            step, or at least once a second
    mldebug.log_note(text)                  a note at the current step
    (each stop of the program is noted at the step in progress: "[stop] " + its message)

Cost
    Steps that are not recorded run with no module hook installed (only two global
    optimizer hooks that count). Recorded steps compute a few reductions per tensor on
    its device and bring everything to the host once per step. benchmarks/bench_record.py
    measures it.

Live copy in TensorBoard or Weights & Biases (`to=`; optional extras)
    to=("tensorboard", DIR)   a new event file of mldebug's own in DIR
    to="wandb"                the active wandb.run (mldebug's keys over "mldebug/step"),
                              or a new run named after this one (WANDB_MODE, WANDB_PROJECT,
                              WANDB_ENTITY as the environment says)
    to=writer / run / [...]   a SummaryWriter or wandb run of your own, or several targets
    Each committed write (a recorded step's stats and histograms, KPIs, notes, stops)
    goes to the mirror's own thread (mirror.py), never waited for by the training step;
    tags and numbers are those of `python -m mldebug runs export` (export.py).

Store and safety
    RUN_DIR/RUN.sqlite, one transaction per recorded step (WAL): a killed program leaves
    every committed step readable. Nothing the recorder does changes what the program
    computes (no_grad, no in-place writes, its own random generator); a failing write
    warns once and recording stops, the program goes on.
"""
from __future__ import annotations

import os as _os
import tempfile as _tempfile

from ..core.callable_module import make_callable
from ..core.quiet import own_call
from . import recorder as _recorder
from .recorder import LOGS, WHAT, Capture, Recorder, active_recorder  # noqa: F401
from .store import Run, list_runs, open_run  # noqa: F401

__all__ = ["record", "Recorder", "Capture", "Run", "open_run", "list_runs",
           "log_tensor", "log_scalar", "log_note", "active_recorder", "LOGS", "WHAT"]


def _record(model=None, log=LOGS, every=1, modules=None, children=None, condition=None,
           capture=(), run_dir="runs", run=None, note="", bins=30, sample=1024, clip=5.0,
           batch_dim=0, training_only=True, if_exists="replace", step="optimizer",
           background=True, first_step=0, to=None) -> Recorder:
    """Start recording MODEL (or only scalars/named tensors when None); returns the
    running Recorder (a context manager; close() ends it). TO: a live copy in
    TensorBoard or W&B (("tensorboard", DIR), "wandb", a SummaryWriter, a wandb run)."""
    _check_run_dir(run_dir)
    return Recorder(model, log=log, every=every, modules=modules, children=children,
                    condition=condition, capture=capture, run_dir=run_dir, run=run,
                    note=note, bins=bins, sample=sample, clip=clip, batch_dim=batch_dim,
                    training_only=training_only, if_exists=if_exists, step=step,
                    background=background, first_step=first_step, to=to).start()


def _check_run_dir(run_dir) -> None:
    """A folder runs cannot be written to is one clear OSError (of the same kind),
    before anything is hooked: not a traceback through the recorder at step 0."""
    try:
        _os.makedirs(run_dir, exist_ok=True)
        with _tempfile.TemporaryFile(dir=run_dir):
            pass
    except OSError as exc:
        raise type(exc)(f"mldebug.record: cannot write runs in run_dir={str(run_dir)!r}: "
                        f"{exc.strerror or exc}; pass run_dir= a folder you can write to"
                        ) from None


@own_call   # (the NaN watch looks away: a NaN logged is no stop, core/quiet.py)
def log_tensor(name: str, t, role: str = "") -> None:
    """Stats and histogram of T under NAME in the running recording (recorded steps only).
    ROLE is free text shown beside it (e.g. 'helper', 'attention')."""
    rec = _recorder._ACTIVE
    if rec is not None:
        rec.log_tensor(name, t, role=role)


@own_call   # (the NaN watch looks away: a NaN logged is no stop, core/quiet.py)
def log_scalar(name: str, value) -> None:
    """A KPI (loss, accuracy, lr) at the current step of the running recording."""
    rec = _recorder._ACTIVE
    if rec is not None:
        rec.log_scalar(name, value)


@own_call   # (the NaN watch looks away: a NaN logged is no stop, core/quiet.py)
def log_note(text: str) -> None:
    """A free-text note at the current step of the running recording."""
    rec = _recorder._ACTIVE
    if rec is not None:
        rec.log_note(text)


# `mldebug.record` is both this package and the function that starts a recording (as
# `mldebug.watch`): `mldebug.record(model, ...)` and `mldebug.record.open_run(...)` both
# work, in any import order
__doc_record__ = _record.__doc__
record = make_callable(__name__, _record)
