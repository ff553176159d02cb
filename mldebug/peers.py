"""The ranks of a multi-process job tell each other about stops, through the store the
launcher already runs (torchrun's agent store, else the default process group's store
once the program initialised it; never a server of our own).

- A rank that stops posts its stop as the job's first stop (the first writer wins). A
  stop this rank did not make itself (a NaN/Inf that came in, or a gradient no op of this
  rank made: what a DDP all-reduce hands every rank) waits a moment for a peer's own
  stop and, when one comes, names it: `came in from rank 1: ...` and the report's `peer`.
- Every rank watches for the first stop on a thread of its own (a look at the store
  every POLL_S, never a collective). When it is another rank's:
  - `--batch`: one report line, `reason: "peer_stop"`, naming the rank, file:line and
    message of the first stop; one line on stderr; exit status 3 at once — whatever the
    program is doing (blocked in a collective the stopped rank will never join), so no
    gloo/NCCL error is recorded as the program's and nothing hangs. The stopped rank
    waits (a few seconds at most) until the others have written their line, before the
    launcher tears the job down.
  - interactively: one line, `[rank 0] waiting: rank 1 stopped at train.py:18 (NaN from
    aten.div)`, and the rank holds at its next step boundary (the start of a backward —
    before DDP's gradient all-reduce — or an optimizer step) until the stopped rank's
    prompt continues; `quit` there ends every rank (status 0, as the stopped rank's), and
    so does the end of a post-mortem prompt (an uncaught exception: that rank is over).
    A rank already inside a collective stays there: a started collective cannot be
    released, so the process groups the program creates wait at least the debugging
    hold (`hold_timeouts`, core/pg_timeout.py: 6 hours unless `--hold-timeout`). One
    prompt at a time on a host's terminal: a rank that stops while another's prompt is
    open says so and waits its turn.

Keys (under mldebug/<run id>/<restart>/): `first_stop` (compare-and-set: the job's first
stop), `acks` / `first_stop_done` (--batch's exit handshake), `pauses` (a counter),
`pause/<n>` (a prompt opened: who, where) and `resume/<n>` ('continue' or 'quit'),
`tty/<host>` (the rank whose prompt has the terminal).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

from torch.optim.optimizer import register_optimizer_step_pre_hook

from .core import autograd_patch as _autograd_patch
from .core import session as _session
from .core.pg_timeout import DEFAULT_HOLD_S, HoldTimeout
from .core.ranks import RankInfo, this_rank
from .core.records import Stop

FIRST = "first_stop"
ACKS = "acks"
PAUSES = "pauses"
DONE = "first_stop_done"   # the first stop's rank wrote its line and may be terminated
GRACE_S = 3.0        # how long a stop this rank did not make waits for a peer's own
ACK_WAIT_S = 5.0     # how long a --batch stop waits for the others to write their line
EXIT_PEER_STOP = 3   # as --batch's own stop
POLL_S = 0.1         # how often the watcher asks the store (a round trip on its thread)


def _prefix() -> str:
    # one job's keys: a restarted job (torchrun --max-restarts) starts afresh
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    return f"mldebug/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _connect():
    """A new client of the launcher's store, or None when there is none (yet)."""
    import torch.distributed as dist
    if not dist.is_available():
        return None
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and \
            os.environ.get("MASTER_ADDR") and os.environ.get("MASTER_PORT"):
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=30))
    elif dist.is_initialized():
        store = dist.distributed_c10d._get_default_store().clone()
    else:
        return None
    return dist.PrefixStore(_prefix(), store)


def _made_here(stop: Stop) -> bool:
    """Whether this rank's own op (or code) made what stopped it."""
    v = stop.violation
    if v is None or stop.reason not in ("nan", "inf"):
        return True            # an assertion, an exception, a breakpoint: its own
    return bool(v.created and v.op)


def describe_first(first: dict) -> str:
    """'rank 1 stopped at train.py:18 (NaN from aten.div)'"""
    where = f" at {os.path.basename(first.get('file') or '')}:{first.get('line')}" \
        if first.get("file") else ""
    reason = first.get("reason")
    if reason in ("nan", "inf") and first.get("op"):
        op = first["op"].rsplit(".", 1)[0] if first["op"].count(".") > 1 else first["op"]
        what = f"{'NaN' if reason == 'nan' else 'Inf'} from {op}"
    elif reason == "assertion":
        what = f"assertion {first.get('assertion') or ''}".strip()
    else:
        what = (first.get("message") or reason or "")[:80]
    return f"rank {first.get('rank')} stopped{where} ({what})"


class Peers:
    """Started by the CLI in a multi-rank job; listens to the session's stops."""

    def __init__(self, session: _session.Session, info: RankInfo):
        self.session = session
        self.info = info
        self._lock = threading.Lock()
        self._publisher = None        # the main thread's client (the watcher has its own)
        self._own_stop = False
        self._ending = False          # --batch: a peer's stop is ending this rank
        self._posted_first = False
        self.first: Optional[dict] = None
        self._holding = False         # a peer's prompt is open: hold at the next boundary
        self._my_pause: Optional[int] = None
        self._said_hold = False
        session.listeners.insert(0, self._before_report)   # annotates what is reported
        session.add_listener(self._after_report)
        if not session.batch:
            session.pause_listeners.append(self._pausing)
            session.resume_listeners.append(self._resumed)
            register_optimizer_step_pre_hook(self._at_optimizer_step)
            _autograd_patch.add(self._around_backward)
        watch = self._watch if session.batch else self._watch_pauses
        self._thread = threading.Thread(target=watch, name="mldebug-peers", daemon=True)
        self._thread.pydev_do_not_trace = True
        self._thread.is_pydev_daemon_thread = True
        self._closing = threading.Event()
        atexit.register(self._close)
        self._thread.start()

    # -- this rank stops ---------------------------------------------------------------
    def _store(self):
        if self._publisher is None:
            try:
                self._publisher = _connect()
            except Exception:  # noqa: BLE001 - no store: this rank is on its own
                self._publisher = None
        return self._publisher

    def _before_report(self, stop: Stop) -> None:
        if stop.reason in ("peer_stop", "interrupt") or (
                stop.reason == "breakpoint" and self.session.batch):
            return
        with self._lock:
            if self._ending:
                return       # a peer's stop is ending this rank already (_peer_stopped)
            self._own_stop = True
        store = self._store()
        if store is None:
            return
        mine = json.dumps({"rank": self.info.rank, "file": stop.file, "line": stop.line,
                           "reason": stop.reason, "op": stop.op, "message": stop.message,
                           "assertion": stop.assertion, "stage": stop.stage})
        if not _made_here(stop):
            # a value another rank made reaches this one through a collective at about
            # the time that rank stops: give its own stop a moment to arrive
            first = self._wait_first(store, GRACE_S)
            if first is not None and first.get("rank") != self.info.rank:
                self._name_peer(stop, first)
                return
        try:
            winner = store.compare_set(FIRST, "", mine).decode("utf-8")
        except Exception:  # noqa: BLE001
            return
        first = json.loads(winner) if winner else None
        if first is not None and first.get("rank") != self.info.rank:
            if not _made_here(stop):
                self._name_peer(stop, first)
        else:
            self._posted_first = True

    def _name_peer(self, stop: Stop, first: dict) -> None:
        """This rank's NaN/Inf was made by another rank: say it came in through a
        collective from that rank, not that this rank's own ops made it."""
        stop.peer = {k: first.get(k) for k in ("rank", "file", "line", "message")}
        v = stop.violation
        if v is not None:
            kind = "a gradient collective" if stop.stage == "backward" else "a collective"
            v.created, v.culprit = False, f"{kind} from rank {first.get('rank')}"
            stop.created, stop.culprit = v.created, v.culprit
            stop.message = v.headline()
        stop.message += f"; {describe_first(first)}"

    @staticmethod
    def _wait_first(store, seconds: float) -> Optional[dict]:
        # polled: a store wait that times out prints c10d's warnings on stderr
        deadline = time.monotonic() + seconds
        try:
            while not store.check([FIRST]):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.05)
            value = store.get(FIRST).decode("utf-8")
            return json.loads(value) if value else None
        except Exception:  # noqa: BLE001 - no store
            return None

    def _after_report(self, stop: Stop) -> None:
        """--batch: this rank's line is written. Say so; when its stop is the job's
        first, let the others write theirs before it exits (the launcher stops the rest
        of the job when one rank exits)."""
        if not self.session.batch or stop.reason in ("breakpoint", "peer_stop") \
                or not self._own_stop:
            return
        # this rank is on its way out with --batch's status (BatchStop); when another
        # rank exits first the launcher sends SIGTERM: ignored, so that it does not turn
        # that status into a kill (a Python handler would not do: the interpreter's
        # shutdown resets it to the default; SIG_IGN it keeps)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:   # not the main thread: the launcher's signal then ends it
            pass
        store = self._store()
        if not self._posted_first:
            if store is not None:
                _ack(store)
            return
        deadline = time.monotonic() + ACK_WAIT_S
        try:
            while store is not None and time.monotonic() < deadline:
                if store.add(ACKS, 0) >= self.info.world_size - 1:
                    break
                time.sleep(0.05)
        except Exception:  # noqa: BLE001
            pass
        finally:
            if store is not None:
                try:
                    store.set(DONE, "1")     # the others may exit now
                except Exception:  # noqa: BLE001
                    pass

    # -- interactively: this rank's prompt, the others hold ----------------------------
    def _pausing(self, stop: Stop) -> None:
        """Right before this rank's prompt opens: take the host's terminal (one prompt
        at a time), then tell the others to hold."""
        store = self._store()
        if store is None:
            return
        me, told = str(self.info.rank), False
        try:
            while True:
                holder = store.compare_set(self._tty, "", me).decode("utf-8")
                if holder == me:
                    break
                if not told:
                    print(f"{self.info.tag}mldebug: rank {holder}'s prompt has the terminal; "
                          "this rank's opens when it continues", file=self.session.out,
                          flush=True)
                    told = True
                time.sleep(0.1)
            self._my_pause = store.add(PAUSES, 1)
            store.set(f"pause/{self._my_pause}", json.dumps(
                {"rank": self.info.rank, "file": stop.file, "line": stop.line,
                 "reason": stop.reason, "op": stop.op, "message": stop.message,
                 "assertion": stop.assertion}))
        except Exception:  # noqa: BLE001 - the store is gone: this rank is on its own
            self._my_pause = None

    def _resumed(self, stop: Stop, ended: bool) -> None:
        store, pause, self._my_pause = self._store(), self._my_pause, None
        if store is None or pause is None:
            return
        try:
            store.set(f"resume/{pause}", "quit" if ended else "continue")
            store.compare_set(self._tty, str(self.info.rank), "")
        except Exception:  # noqa: BLE001
            pass

    @property
    def _tty(self) -> str:
        return f"tty/{self.info.host}"

    def said_hold(self, name: str, old: Optional[timedelta], new: timedelta) -> None:
        """Once a job (rank 0 says it): the process groups' timeout was raised."""
        if self._said_hold or self.info.rank != 0:
            return
        self._said_hold = True
        was = f"the program's {old}" if old is not None else "the backend's default"
        print(f"{self.info.tag}mldebug: process groups wait up to {new} in a collective "
              f"(not {was}), so that no rank times out while another rank's prompt is "
              "open (--hold-timeout SECONDS; 0 keeps the program's)", file=sys.stderr,
              flush=True)

    def _at_optimizer_step(self, optimizer, args, kwargs) -> None:
        self._hold()

    def _around_backward(self, proceed, tensors, grad_tensors, args, kwargs):
        self._hold()       # before the backward's gradient collectives
        return proceed(tensors, grad_tensors, *args, **kwargs)

    def _hold(self) -> None:
        while self._holding:
            time.sleep(0.05)

    def _watch_pauses(self) -> None:
        """Every prompt opened on another rank: hold until it continues; end with it."""
        store = self._connect_when_possible()
        number = 1
        while store is not None:
            value = self._wait_get(store, f"pause/{number}")
            if value is None:
                return
            pause = json.loads(value)
            if pause.get("rank") != self.info.rank:
                self._holding = True
                print(f"{self.info.tag}waiting: {describe_first(pause)}",
                      file=self.session.out, flush=True)
                outcome = self._wait_get(store, f"resume/{number}")
                if outcome == "quit":
                    print(f"{self.info.tag}mldebug: rank {pause.get('rank')} ended the "
                          "program at its prompt; ending this rank too",
                          file=self.session.out, flush=True)
                    _flush_and_exit(0)
                self._holding = False
                if outcome is None:
                    return
            number += 1

    # -- another rank stops ------------------------------------------------------------
    def _connect_when_possible(self):
        while not self._closing.is_set():
            try:
                store = _connect()
            except Exception:  # noqa: BLE001 - the launcher's store is gone: nothing to do
                return None
            if store is not None:
                return store
            self._closing.wait(0.5)    # until the program initialises torch.distributed
        return None

    def _wait_get(self, store, key: str) -> Optional[str]:
        """KEY's value once some rank sets it; None when the store is gone or this
        process is exiting. Polled, never a blocking store wait: a thread blocked in the
        store's C++ when the interpreter shuts down aborts the process ('terminate called
        without an active exception'); this one returns within POLL_S and is joined at
        exit (`_close`)."""
        while not self._closing.is_set():
            try:
                if store.check([key]):
                    return store.get(key).decode("utf-8")
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                return None
            self._closing.wait(POLL_S)
        return None

    def _close(self) -> None:
        """At exit, before the interpreter shuts down: the watcher leaves the store."""
        self._closing.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        """--batch: the job's first stop, when it is another rank's, ends this rank."""
        store = self._connect_when_possible()
        value = self._wait_get(store, FIRST) if store is not None else None
        if not value:
            return
        first = json.loads(value)
        if first.get("rank") == self.info.rank:
            return
        self.first = first
        self._peer_stopped(store, first)

    def _peer_stopped(self, store, first: dict) -> None:
        with self._lock:
            if self._own_stop:
                # this rank stopped too: its own stop ends it (exit 3), and says so to
                # the first rank once its line is written (_after_report)
                return
            self._ending = True
        stop = Stop(reason="peer_stop", message=describe_first(first) + ": "
                    + (first.get("message") or ""), file=first.get("file") or "",
                    line=first.get("line") or 0, stage=first.get("stage") or "other",
                    peer={k: first.get(k) for k in ("rank", "file", "line", "message")})
        try:
            self.session.record(stop)
            print(f"{stop.tag}mldebug: stop: {stop.message}", file=self.session.out,
                  flush=True)
        finally:
            _ack(store)
            # the launcher terminates the others when one rank exits: not before the
            # stopped rank has written its own line
            deadline = time.monotonic() + ACK_WAIT_S
            try:
                while not store.check([DONE]) and time.monotonic() < deadline:
                    time.sleep(0.05)
            except Exception:  # noqa: BLE001
                pass
            # the main thread may be blocked in a collective the stopped rank will never
            # join: end here, with --batch's status for a stop
            _flush_and_exit(EXIT_PEER_STOP)


def _flush_and_exit(status: int) -> None:
    """End this rank from the peers' thread: the main thread may be blocked in a
    collective that will never complete."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def _ack(store) -> None:
    try:
        store.add(ACKS, 1)
    except Exception:  # noqa: BLE001
        pass


def hold_timeouts(peers: Optional[Peers], seconds: Optional[float]) -> Optional[HoldTimeout]:
    """Interactively, in a job of several ranks: the process groups the program creates
    outwait a prompt (SECONDS, default 6 hours; 0 or less: the program's own timeouts).
    None under --batch (a stop ends every rank at once) and for a single process."""
    if peers is None or peers.session.batch:
        return None
    seconds = DEFAULT_HOLD_S if seconds is None else seconds
    if seconds <= 0:
        return None
    return HoldTimeout(timedelta(seconds=seconds), peers.said_hold).install()


def start(session: _session.Session) -> Optional[Peers]:
    """Watch the job's other ranks when this process is one rank of several."""
    info = this_rank()
    if info is None:
        return None
    return Peers(session, info)
