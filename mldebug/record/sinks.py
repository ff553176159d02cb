"""The dashboards a recording is copied into: TensorBoard event files, written by
`torch.utils.tensorboard.SummaryWriter` (over the `tensorboard` package), and Weights &
Biases runs, written by `wandb`. Both are optional extras, imported when first asked for;
without one the error is one line naming the extra (`pip install mldebug[tensorboard]`).

A sink takes one `StepItems` at a time (what export.py makes of a recorded step): its
scalars, histograms and texts under their tags, at the step's number. The same sinks serve
`python -m mldebug runs export` and the live mirror (`record(..., to=...)`, mirror.py).

    open_sinks(to, run_name) -> [sink]     what `record(to=...)` names (see `open_sinks`)
    TensorBoardSink(writer, owned)         any SummaryWriter (torch's or tensorboardX's)
    WandbSink(run, owned, step_key=None)   a wandb run; STEP_KEY: log the step under that
                                           key (a run the user logs to as well: its own
                                           step counter must not be overtaken), else
                                           `log(step=)` (a run mldebug started)

Sinks that mldebug opened are closed by it (`close()`: the event file closed, the W&B run
finished); those it was handed (a trainer's logger) are only flushed.
"""
from __future__ import annotations

import importlib
import os
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..core.errors import UsageError

EXTRA_HINT = "pip install mldebug[{0}]"
WANDB_MAX_BINS = 512          # wandb.Histogram's limit
EVENT_SUFFIX = ".mldebug"     # the end of every event file mldebug writes: told apart


@dataclass
class StepItems:
    """What one step puts in a dashboard: (tag, value) scalars in order (a KPI logged
    twice in a step is two), {tag: (edges float64 [n + 1], counts int64 [n])} histograms,
    {tag: text} texts, at STEP; WALLTIME the step's time (None: now)."""
    step: int
    scalars: list = field(default_factory=list)
    histograms: dict = field(default_factory=dict)
    texts: dict = field(default_factory=dict)
    walltime: Optional[float] = None

    def __bool__(self) -> bool:
        return bool(self.scalars or self.histograms or self.texts)


def need(extra: str, what: str):
    """The module behind EXTRA ('tensorboard' or 'wandb'), or one ImportError line."""
    try:
        # (torch.utils.tensorboard imports the tensorboard package)
        return importlib.import_module("torch.utils.tensorboard" if extra == "tensorboard"
                                       else "wandb")
    except ImportError:
        raise ImportError(f"{what} needs the {extra} package: "
                          f"{EXTRA_HINT.format(extra)}") from None


class TensorBoardSink:
    """Scalars, histograms (`add_histogram_raw`: the stored bins themselves) and texts
    into a SummaryWriter."""

    kind = "tensorboard"

    def __init__(self, writer, owned: bool = False):
        self.writer = writer
        self.owned = owned
        self.where = _logdir_of(writer)

    @classmethod
    def open(cls, logdir: str, what: str = "tensorboard") -> "TensorBoardSink":
        """A new event file of mldebug's own in LOGDIR (made when missing); nothing already
        there is touched (SummaryWriter names its file by time, host, process and a
        counter; `.mldebug` ends it)."""
        tb = need("tensorboard", what)
        logdir = os.fspath(logdir)
        if os.path.exists(logdir) and not os.path.isdir(logdir):
            raise NotADirectoryError(f"{what}: {logdir!r} is a file, not a directory")
        return cls(tb.SummaryWriter(log_dir=logdir, filename_suffix=EVENT_SUFFIX), owned=True)

    def write(self, items: StepItems, pause=None) -> None:
        """ITEMS into the event file; PAUSE() between two events (the mirror lets the
        training thread have the GIL there)."""
        for method, args, kwargs in self._calls(items):
            # a writer its owner closed (a trainer at its end, while the last steps were
            # on their way): the rest goes into an event file of mldebug's own beside it
            if self._closed_by_owner():
                self._own_writer()
            target = self if method.startswith("_") else self.writer
            try:
                getattr(target, method)(*args, **kwargs)
            except OSError as exc:
                if not self._closed_by_owner(exc):
                    raise
                self._own_writer()       # (closed while this event was on its way)
                target = self if method.startswith("_") else self.writer
                getattr(target, method)(*args, **kwargs)
            if pause is not None:
                pause()

    def _calls(self, items: StepItems):
        step, when = items.step, items.walltime
        together = _one_summary(self.writer, items.scalars)
        if together is not None:
            # a step's scalars as one event: tensorboard's own Summary of many values, as
            # TensorFlow writes them (an event each costs ~45 us of pure Python: 13 a
            # series, a step of 22 series 12.8 ms, against 4.1 ms so)
            yield "_add_summary", (together, step, when), {}
        else:
            for tag, value in items.scalars:
                yield "add_scalar", (tag, value, step), {"walltime": when}
        for tag, (edges, counts) in items.histograms.items():
            centres = (edges[:-1] + edges[1:]) / 2      # sum and sum of squares: by bin
            yield "add_histogram_raw", (tag,), dict(
                min=float(edges[0]), max=float(edges[-1]), num=int(counts.sum()),
                sum=float(centres @ counts), sum_squares=float((centres * centres) @ counts),
                bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(),
                global_step=step, walltime=when)
        for tag, text in items.texts.items():
            yield "add_text", (tag, text, step), {"walltime": when}

    def _add_summary(self, summary, step, walltime) -> None:
        self.writer._get_file_writer().add_summary(summary, step, walltime)

    def _closed_by_owner(self, exc: Optional[BaseException] = None) -> bool:
        """Whether the writer mldebug was handed has been closed by its owner (torch's
        SummaryWriter drops its file writers; tensorboard's says "Writer is closed"),
        and it names its folder: mldebug writes only where it was told to."""
        if self.owned or self.where == "?":
            return False
        return getattr(self.writer, "all_writers", ()) is None or (
            exc is not None and "closed" in str(exc).lower())

    def _own_writer(self) -> None:
        self.writer = need("tensorboard", "mirroring to TensorBoard").SummaryWriter(
            log_dir=self.where, filename_suffix=EVENT_SUFFIX)
        self.owned = True

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        if self.owned:
            self.writer.close()
        else:
            self.writer.flush()


class WandbSink:
    """Scalars, `wandb.Histogram`s and texts (strings) into a wandb run, one `log` a step."""

    kind = "wandb"

    def __init__(self, run, owned: bool = False, step_key: Optional[str] = None):
        self.wandb = need("wandb", "mirroring to W&B")
        self.run = run
        self.owned = owned
        self.step_key = step_key
        self.where = _wandb_where(run)
        if step_key == MLDEBUG_STEP:
            # mldebug's keys drawn over its own step, whatever the run's own counter is
            run.define_metric(MLDEBUG_STEP)
            run.define_metric("mldebug/*", step_metric=MLDEBUG_STEP)

    @classmethod
    def open(cls, name: str, config: Optional[dict] = None, what: str = "wandb",
             job_type: Optional[str] = None) -> "WandbSink":
        """A new W&B run named NAME: project, entity, mode (WANDB_MODE=offline) and
        directory (WANDB_DIR) as the user's wandb settings and environment say."""
        wandb = need("wandb", what)
        try:
            run = wandb.init(name=name, config=config, job_type=job_type)
        except Exception as exc:  # noqa: BLE001 - wandb's own errors: one line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise RuntimeError(f"{what}: wandb.init failed ({type(exc).__name__}: {first}); "
                               "WANDB_MODE=offline writes the run locally") from None
        return cls(run, owned=True)

    def write(self, items: StepItems, pause=None) -> None:
        """ITEMS as one row (PAUSE is not used: `log` takes the row at once)."""
        row: dict = {}
        for tag, value in items.scalars:
            row[tag] = value                       # (one value a key and step: the last)
        for tag, (edges, counts) in items.histograms.items():
            edges, counts = _at_most(edges, counts, WANDB_MAX_BINS)
            row[tag] = self.wandb.Histogram(np_histogram=(counts, edges))
        row.update(items.texts)
        if not row:
            return
        if self.step_key is None:
            self.run.log(row, step=items.step)
        else:
            row[self.step_key] = items.step
            self.run.log(row)

    def flush(self) -> None:
        pass                                       # (wandb hands rows over as they come)

    def close(self) -> None:
        if self.owned:
            self.run.finish()


MLDEBUG_STEP = "mldebug/step"    # the step key in a W&B run the user logs to as well


def open_sinks(to, run_name: str, config: Optional[dict] = None) -> list:
    """The sinks `record(..., to=TO)` names, opened:
        ("tensorboard", DIR)    a new event file of mldebug's own in DIR
        "wandb"                 the active `wandb.run` (its own step untouched: mldebug's
                                keys over "mldebug/step"), or a new run named RUN_NAME
        a SummaryWriter         (torch's or tensorboardX's) written into, never closed
        a wandb run object      logged to over "mldebug/step", never finished
        a sink                  (TensorBoardSink / WandbSink) as it is
        a list of these         all of them
    Raises UsageError for anything else, ImportError (one line) without the extra."""
    if to is None:
        return []
    if isinstance(to, list):
        sinks: list = []
        try:
            for one in to:
                if isinstance(one, list):
                    raise UsageError(f"record: to= takes a list of targets, not a list of "
                                     f"lists, got {to!r}")
                sinks += open_sinks(one, run_name, config)
        except BaseException:
            close_all(sinks)
            raise
        return sinks
    if isinstance(to, (TensorBoardSink, WandbSink)):
        return [to]
    if isinstance(to, tuple) and len(to) == 2 and to[0] == "tensorboard":
        if not isinstance(to[1], (str, os.PathLike)) or not os.fspath(to[1]):
            raise UsageError(f"record: to=('tensorboard', DIR) needs DIR a path, got {to[1]!r}")
        return [TensorBoardSink.open(to[1], what="record(to='tensorboard')")]
    if to == "wandb":
        wandb = need("wandb", "record(to='wandb')")
        if wandb.run is not None:
            return [WandbSink(wandb.run, owned=False, step_key=MLDEBUG_STEP)]
        return [WandbSink.open(run_name, config, what="record(to='wandb')")]
    if callable(getattr(to, "add_histogram_raw", None)) and callable(getattr(to, "add_scalar", None)):
        return [TensorBoardSink(to, owned=False)]
    if type(to).__module__.split(".")[0] == "wandb" and callable(getattr(to, "log", None)):
        return [WandbSink(to, owned=False, step_key=MLDEBUG_STEP)]
    raise UsageError("record: to= takes ('tensorboard', DIR), 'wandb', a SummaryWriter, a "
                     f"wandb run, or a list of these; got {to!r}")


def close_all(sinks: list) -> list:
    """Close every sink; the errors, as (sink, exception), for the caller to tell."""
    failed = []
    for sink in sinks:
        try:
            sink.close()
        except Exception as exc:  # noqa: BLE001 - one sink's failure leaves the others
            failed.append((sink, exc))
    return failed


def _one_summary(writer, scalars: list):
    """SCALARS [(tag, value)] as one tensorboard Summary of many values, built with
    torch's own `summary.scalar`, where WRITER is torch's SummaryWriter (None otherwise:
    then one `add_scalar` each)."""
    if not scalars or not hasattr(writer, "_get_file_writer"):
        return None
    try:
        from torch.utils.tensorboard import summary as tb_summary
    except ImportError:
        return None
    merged = tb_summary.scalar(*scalars[0])
    for tag, value in scalars[1:]:
        merged.value.extend(tb_summary.scalar(tag, value).value)
    return merged


def _at_most(edges, counts, n: int) -> tuple:
    """EDGES and COUNTS with neighbouring bins summed until at most N are left."""
    if len(counts) <= n:
        return edges, counts
    group = -(-len(counts) // n)
    cut = np.arange(0, len(counts), group)
    return np.append(edges[cut], edges[-1]), np.add.reduceat(counts, cut)


def _logdir_of(writer) -> str:
    """The folder of a SummaryWriter (torch's get_logdir, tensorboardX's logdir), or '?'."""
    get = getattr(writer, "get_logdir", None)
    try:
        where = get() if callable(get) else getattr(writer, "logdir", None)
    except Exception:  # noqa: BLE001 - a description only
        where = None
    return os.fspath(where) if isinstance(where, (str, os.PathLike)) and where else "?"


def _wandb_where(run) -> str:
    try:
        return f"W&B run {run.name!r} ({run.dir})"
    except Exception:  # noqa: BLE001 - a description only
        return "a W&B run"
