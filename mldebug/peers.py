"""The ranks of a multi-process job tell each other about stops, through the store the
launcher already runs (torchrun's agent store, else the default process group's store
once the program initialised it; never a server of our own).

- A rank that stops posts its stop as the job's first stop (the first writer wins). A
  stop this rank did not make itself (a NaN/Inf that came in, or a gradient no op of this
  rank made: what a DDP all-reduce hands every rank) waits a moment for a peer's own
  stop and, when one comes, names it: `came in from rank 1: ...` and the report's `peer`.
- Every rank watches for the first stop on a thread of its own (blocked in the store's
  wait: no polling, no collective). When it is another rank's:
  - `--batch`: one report line, `reason: "peer_stop"`, naming the rank, file:line and
    message of the first stop; one line on stderr; exit status 3 at once — whatever the
    program is doing (blocked in a collective the stopped rank will never join), so no
    gloo/NCCL error is recorded as the program's and nothing hangs. The stopped rank
    waits (a few seconds at most) until the others have written their line, before the
    launcher tears the job down.
  - interactively: one line, `[rank 0] waiting: rank 1 stopped at train.py:18 (NaN from
    aten.div)`.
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Optional

from .core import session as _session
from .core.ranks import RankInfo, this_rank
from .core.records import Stop

FIRST = "first_stop"
ACKS = "acks"
DONE = "first_stop_done"   # the first stop's rank wrote its line and may be terminated
GRACE_S = 3.0        # how long a stop this rank did not make waits for a peer's own
ACK_WAIT_S = 5.0     # how long a --batch stop waits for the others to write their line
EXIT_PEER_STOP = 3   # as --batch's own stop


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
        self._posted_first = False
        self._told = False
        self.first: Optional[dict] = None
        session.listeners.insert(0, self._before_report)   # annotates what is reported
        session.add_listener(self._after_report)
        self._thread = threading.Thread(target=self._watch, name="mldebug-peers",
                                        daemon=True)
        self._thread.pydev_do_not_trace = True
        self._thread.is_pydev_daemon_thread = True
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
        try:
            store.wait([FIRST], timedelta(seconds=seconds))
            value = store.get(FIRST).decode("utf-8")
            return json.loads(value) if value else None
        except Exception:  # noqa: BLE001 - none came in time
            return None

    def _after_report(self, stop: Stop) -> None:
        """--batch, this rank's stop is the job's first: let the others write their line
        before this rank exits (the launcher then stops them)."""
        if not (self.session.batch and self._posted_first) or stop.reason == "breakpoint":
            return
        # this rank is on its way out with --batch's status (BatchStop); the others exit
        # first and the launcher then sends SIGTERM: ignored, so that it does not turn
        # that status into a kill (a Python handler would not do: the interpreter's
        # shutdown resets it to the default; SIG_IGN it keeps)
        try:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        except ValueError:   # not the main thread: the launcher's signal then ends it
            pass
        store = self._store()
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

    # -- another rank stops ------------------------------------------------------------
    def _watch(self) -> None:
        store = None
        while store is None:
            try:
                store = _connect()
            except Exception:  # noqa: BLE001 - the launcher's store is gone: nothing to do
                return
            if store is None:
                time.sleep(0.5)    # until the program initialises torch.distributed
        while True:
            try:
                store.wait([FIRST], timedelta(days=1))
                value = store.get(FIRST).decode("utf-8")
            except Exception as exc:  # noqa: BLE001
                if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
                    continue
                return             # the store closed: the job is ending
            if value:
                break
        first = json.loads(value)
        if first.get("rank") == self.info.rank:
            return
        self.first = first
        self._peer_stopped(store, first)

    def _peer_stopped(self, store, first: dict) -> None:
        line = f"{self.info.tag}"
        with self._lock:
            own = self._own_stop
        if not self.session.batch:
            if not own:
                print(f"{line}waiting: {describe_first(first)}", file=self.session.out,
                      flush=True)
            return
        if own:
            # this rank stopped too: its own stop ends it (exit 3); only say it has seen
            _ack(store)
            return
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
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:  # noqa: BLE001
                    pass
            # the launcher terminates the others when one rank exits: not before the
            # stopped rank has written its own line
            try:
                store.wait([DONE], timedelta(seconds=ACK_WAIT_S))
            except Exception:  # noqa: BLE001
                pass
            # the main thread may be blocked in a collective the stopped rank will never
            # join: end here, with --batch's status for a stop
            os._exit(EXIT_PEER_STOP)


def _ack(store) -> None:
    try:
        store.add(ACKS, 1)
    except Exception:  # noqa: BLE001
        pass


def start(session: _session.Session) -> Optional[Peers]:
    """Watch the job's other ranks when this process is one rank of several."""
    info = this_rank()
    if info is None:
        return None
    return Peers(session, info)
