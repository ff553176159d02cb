"""The live copy of a recording (`mldebug.record(..., to=...)`): each write the store has
committed (a recorded step's statistics, KPIs, notes) is handed to the mirror's own
thread, which makes the dashboard's items of it (export.py) and writes them into the
sinks (sinks.py: TensorBoard, W&B).

Why a thread of its own: the store's writer hands over a step only once the previous one
is committed (store.Writer.submit), and on a machine whose cores torch's threads take the
commit runs on the training thread (`Recorder._commit_here`); a sink's work (a
SummaryWriter's protobufs and checksums in Python, wandb's serialisation) in either place
would wait in the training step. Here `put` is an append to a queue.

The mirror's Python (protobufs, tensorboard's checksums) holds the GIL; a thread that
wants it back from a busy one waits up to the switch interval (5 ms), and the training
thread wants it back after every torch op. So the mirror lets go of it between two
events (`time.sleep(0)`): the training thread waits for one event's work at most.

Limits: at most BACKLOG recorded steps wait; a step arriving beyond that has its
statistics left out of the dashboard (they stay in the store: `python -m mldebug runs
export` writes them all) and a warning says so once; KPIs, notes and stops are never
left out. A sink that fails warns once and is dropped; the others go on. `close()` waits
for what is queued, then closes the sinks mldebug opened and flushes the others.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Optional

from .export import add_scalars_and_notes, add_series
from .sinks import StepItems, close_all
from .store import unpack_step

BACKLOG = 64                 # recorded steps waiting for the mirror, at most
CLOSE_WAIT_S = 120.0         # close() waits this long for the queue, then gives up


class Mirror:
    """put(step, packed, entries, scalar rows, notes) after each commit; close()."""

    def __init__(self, sinks: list, say: Callable[[str], None], background: bool = True):
        self.sinks = list(sinks)
        self._say = say
        self.left_out = 0             # recorded steps whose statistics were not mirrored
        self.mirrored = 0             # recorded steps mirrored
        self._queue: deque = deque()
        self._waiting = 0             # queued jobs holding a step's statistics
        self._cv = threading.Condition()
        self._closing = False
        self._thread: Optional[threading.Thread] = None
        if background:
            t = threading.Thread(target=self._work, name="mldebug-record-mirror", daemon=True)
            t.is_pydev_daemon_thread = True   # debugpy: not a user thread
            t.pydev_do_not_trace = True
            t.start()
            self._thread = t

    def describe(self) -> str:
        return ", ".join(s.where for s in self.sinks) or "nothing"

    # -- the store's side -------------------------------------------------------------
    def put(self, step: int, packed: Optional[tuple], entries: Optional[list], scalars: list,
            notes: list) -> None:
        """A committed write: STEP's packed statistics (`step_writing._pack`, rows in the
        order of ENTRIES (key, meta, call, row)) or None, scalar rows (step, name,
        value) and notes (step, time, text) of any steps."""
        if not self.sinks or (packed is None and not scalars and not notes):
            return
        if self._thread is None:
            self._write(step, packed, entries, scalars, notes)
            return
        with self._cv:
            if self._closing:
                return
            if packed is not None:
                if self._waiting >= BACKLOG:
                    packed = entries = None
                    self.left_out += 1
                    if self.left_out == 1:
                        self._say(f"mldebug.record: the mirror to {self.describe()} is "
                                  f"{BACKLOG} recorded steps behind: the statistics of step "
                                  f"{step} and of later steps it cannot take are left out "
                                  "of it (they are in the store: python -m mldebug runs "
                                  "export writes them all); KPIs and notes are not")
                else:
                    self._waiting += 1
            self._queue.append((step, packed, entries, scalars, notes))
            self._cv.notify()

    def close(self) -> None:
        """Write what is queued (waiting at most CLOSE_WAIT_S), then close the sinks."""
        with self._cv:
            self._closing = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(CLOSE_WAIT_S)
            if self._thread.is_alive():
                self._say(f"mldebug.record: the mirror to {self.describe()} did not finish "
                          f"within {CLOSE_WAIT_S:.0f} s; python -m mldebug runs export "
                          "writes the whole run")
            self._thread = None
        for sink, exc in close_all(self.sinks):
            self._say(f"mldebug.record: closing {sink.where} failed "
                      f"({type(exc).__name__}: {exc})")
        if self.left_out:
            self._say(f"mldebug.record: {self.left_out} recorded steps were left out of "
                      f"{self.describe()} (the mirror fell behind; they are in the store)")
        self.sinks = []

    # -- the mirror's thread ----------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if not self._queue:
                    return                  # closing, and nothing is left
                job = self._queue.popleft()
            try:
                self._write(*job)
            finally:
                if job[1] is not None:
                    with self._cv:
                        self._waiting -= 1

    def _write(self, step, packed, entries, scalars, notes) -> None:
        for items in _items_of(step, packed, entries, scalars, notes):
            for sink in list(self.sinks):
                try:
                    sink.write(items, pause=_let_others_run if self._thread else None)
                except Exception as exc:  # noqa: BLE001 - a dashboard never ends the program
                    self.sinks.remove(sink)
                    self._say(f"mldebug.record: writing to {sink.where} failed "
                              f"({type(exc).__name__}: {exc}); the mirror to it stops, "
                              "the recording goes on")
        if packed is not None:
            self.mirrored += 1


def _let_others_run() -> None:
    time.sleep(0)                  # (releases the GIL: a waiting thread takes it)


def _items_of(step, packed, entries, scalars, notes) -> list:
    """The items of one committed write, ascending by step: KPIs and notes of earlier
    steps (held until this write) each at their own step, then STEP's."""
    by_step: dict = {}
    for s, name, value in scalars:
        by_step.setdefault(s, ([], []))[0].append((name, value))
    for s, _time, text in notes:
        by_step.setdefault(s, ([], []))[1].append(text)
    if packed is not None:
        by_step.setdefault(step, ([], []))
    out = []
    for s in sorted(by_step):
        items = StepItems(s)
        if s == step and packed is not None:
            add_series(items, [e[0] for e in entries], unpack_step(*packed))
        add_scalars_and_notes(items, *by_step[s])
        out.append(items)
    return out
