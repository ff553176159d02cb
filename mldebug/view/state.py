"""What the browser view shows and what its buttons ask for: one `Hub` per process.

The program's thread (the prompt, `mldebug.inspect`) writes here; the Bokeh documents
(one per open page, on the server's thread) read snapshots and are told of changes
through listeners, which only schedule work with `doc.add_next_tick_callback`. Nothing
here imports bokeh or tornado.

Modes (what the program is doing, as the page sees it)
    running   the program runs (or is paused by another front end, e.g. debugpy):
              the buttons are disabled
    prompt    mldebug's prompt waits for a command: Continue / Step over put `c` / `n`
              in its input, as if typed
    wait      `mldebug.inspect(x, wait=True)` blocks the program until Continue
"""
from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from typing import Callable, Optional

MAX_ENTRIES = 32     # the inspect list keeps the newest this many (it holds references)

ACTIONS = {"continue": "c", "step": "n"}   # page button -> the command it types


class Entry:
    """One item of the inspect list: a value and how to find its gradient."""

    def __init__(self, key: int, name: str, value, source: str, grad=None, grad_name="",
                 note: str = ""):
        self.key = key
        self.name = name
        self.value = value           # a strong reference: the list is short (MAX_ENTRIES)
        self.source = source         # 'inspect' (Python), 'prompt', 'graph'
        self._grad = grad            # callable -> tensor or None (graph nodes); default .grad
        self.grad_name = grad_name
        self.note = note
        self.added = time.time()

    def grad(self):
        """(gradient tensor or None, its name)."""
        if self._grad is not None:
            try:
                return self._grad(), self.grad_name or f"{self.name}.grad"
            except Exception:  # noqa: BLE001 - a gradient we cannot read is no gradient
                return None, self.grad_name or f"{self.name}.grad"
        return getattr(self.value, "grad", None), f"{self.name}.grad"

    def label(self) -> str:
        return f"{self.name}  ({self.source})" if self.source != "inspect" else self.name


class Hub:
    """Thread-safe state of the view plus the command channel to the paused program."""

    def __init__(self):
        self._lock = threading.RLock()
        self._keys = itertools.count(1)
        self.entries: list[Entry] = []
        self.mode = "running"
        self.stop: Optional[dict] = None       # Stop.to_dict() of the last stop
        self.where: Optional[dict] = None      # {'file', 'line', 'function'} while paused
        self.pause_serial = 0                  # +1 at every pause (pages refresh graph etc.)
        self.commands: "queue.Queue[str]" = queue.Queue()   # lines for the prompt
        self._resume = threading.Event()       # releases inspect(wait=True)
        self._listeners: list[Callable[[str], None]] = []

    # -- listeners (pages) ---------------------------------------------------------
    def listen(self, fn: Callable[[str], None]) -> None:
        with self._lock:
            self._listeners.append(fn)

    def unlisten(self, fn) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _changed(self, what: str) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            try:
                fn(what)
            except Exception:  # noqa: BLE001 - a closed page never breaks the program
                pass

    def snapshot(self) -> dict:
        with self._lock:
            return {"mode": self.mode, "stop": self.stop, "where": self.where,
                    "pause_serial": self.pause_serial,
                    "entries": [(e.key, e.label()) for e in self.entries]}

    # -- the inspect list ------------------------------------------------------------
    def add(self, value, name: str, source: str = "inspect", **kwargs) -> Entry:
        with self._lock:
            # the same name again replaces the old entry (a loop inspecting `x` each step)
            self.entries = [e for e in self.entries if e.name != name]
            entry = Entry(next(self._keys), name, value, source, **kwargs)
            self.entries.append(entry)
            del self.entries[:-MAX_ENTRIES]
        self._changed("entries")
        return entry

    def get(self, key) -> Optional[Entry]:
        with self._lock:
            return next((e for e in self.entries if str(e.key) == str(key)), None)

    # -- pauses ----------------------------------------------------------------------
    def paused(self, mode: str, stop: Optional[dict], frame=None) -> None:
        where = None
        if frame is not None:
            where = {"file": os.path.abspath(frame.f_code.co_filename),
                     "line": frame.f_lineno, "function": frame.f_code.co_name}
        with self._lock:
            self._drain()           # a click meant for an earlier pause is void
            self.mode, self.stop, self.where = mode, stop, where
            self.pause_serial += 1
            self._resume.clear()
        self._changed("mode")

    def stop_recorded(self, stop: dict) -> None:
        """A stop the session recorded (any front end: the prompt, --batch, DAP): the
        banner shows it, whether or not this page's prompt pauses for it."""
        with self._lock:
            self.stop = stop
        self._changed("mode")

    def running(self) -> None:
        with self._lock:
            self._drain()
            self.mode, self.where = "running", None
        self._changed("mode")

    def _drain(self) -> None:
        while True:
            try:
                self.commands.get_nowait()
            except queue.Empty:
                return

    # -- the page's buttons ----------------------------------------------------------
    def press(self, action: str) -> str:
        """A button of the page: returns what happened, in words. Only the two known
        actions exist; the page can never send a command line of its own."""
        command = ACTIONS.get(action)
        if command is None:
            return f"unknown action {action!r}"
        with self._lock:
            mode = self.mode
            if mode == "prompt":
                self.commands.put(command)
                self.mode = "running"       # until the prompt says it is back
            elif mode == "wait" and action == "continue":
                self._resume.set()
                self.mode = "running"
            else:
                return f"the program is {mode}: nothing to {action}"
        self._changed("mode")
        return f"{action} sent"

    def wait_for_continue(self, poll: float = 0.2) -> None:
        """Block the caller (inspect(wait=True)) until the page's Continue."""
        while not self._resume.wait(poll):
            pass


_hub: Optional[Hub] = None
_hub_lock = threading.Lock()


def hub() -> Hub:
    global _hub
    with _hub_lock:
        if _hub is None:
            _hub = Hub()
        return _hub
