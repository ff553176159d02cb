"""The ranks of a multi-process job tell each other about stops, through the store the
launcher already runs (torchrun's agent store, else the default process group's store
once the program initialised it; never a server of our own).

- A rank that stops posts its stop as the job's first stop (the first writer wins). A
  stop this rank did not make itself (a NaN/Inf that came in, or a gradient no op of this
  rank made: what a DDP all-reduce hands every rank) waits a moment for a peer's own
  stop and, when one comes, names it: `came in from rank 1: ...` and the report's `peer`.
- Every rank watches for the first stop on a thread of its own, never with a collective.
  When it is another rank's:
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

Doorbells, not polling. The watcher sends the store one request, a wait on this rank's
doorbell key `wake/<rank>`, and sleeps in it: the store answers only when the key is set,
so a healthy job costs the store nothing while it runs (a look every 0.1 s from each rank
would be 10,000 requests a second at 1,000 ranks, all to learn that nothing happened).
A rank that changes what the others must know (the first stop, a prompt opened or
closed) writes it, then rings every rank's doorbell with one `multi_set`; each watcher
wakes, clears its doorbell, reads what changed (a few small records) and waits again.
Clearing before reading loses no ring: a change written after the read rings again.

A thread blocked in the store's C++ must never meet the interpreter's shutdown (woken
there, it ends the process with 'terminate called without an active exception'), and a
store wait that reaches its timeout prints c10d's warnings. So this rank rings its own
doorbell: at exit (`_close`, an atexit hook, before the shutdown: the watcher returns and
is joined; `os._exit` ends the thread with the process) and once every REARM_S (the
`_alarm` thread), so that no wait ever reaches its own WAIT_S. A store that goes away
(the launcher ended) ends the wait with an error: the watcher returns without a word
(c10d itself logs that its connection closed).

Connections: the watcher's own client (blocked in its wait: a TCPStore client does one
request at a time) and the publisher's, for this rank's stops, prompts and rings. Under
torchrun's agent store the publisher connects when first needed (the agent's store
outlives its ranks); on the default group's store it connects with the watcher, since
the program may have destroyed that group (and its store) by the time this rank exits.

Keys (under mldebug/<run id>/<restart>/): `first_stop` (compare-and-set: the job's first
stop), `wake/<rank>` (doorbells), `acks` / `first_stop_done` (--batch's exit handshake),
`pauses` (a counter), `pause/<n>` (a prompt opened: who, where) and `resume/<n>`
('continue' or 'quit'), `tty/<host>` (the rank whose prompt has the terminal).
docs/multirank.md counts the requests a healthy second and a stop cost.
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
# a doorbell wait's own limit, never reached (REARM_S): c10d hands the socket's poll()
# an int of milliseconds (at most ~24.8 days) and warns on stderr when a wait times out
WAIT_S = 7 * 24 * 3600.0
REARM_S = 24 * 3600.0  # a quiet rank rings its own doorbell once a day: its wait re-arms
TTY_RETRY_S = 5.0    # a rank waiting for the terminal retries at each ring, else this often


def _prefix() -> str:
    # one job's keys: a restarted job (torchrun --max-restarts) starts afresh
    run = os.environ.get("TORCHELASTIC_RUN_ID", "job")
    return f"mldebug/{run}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _agent_store() -> bool:
    """Whether the ranks share the launcher's own store (torchrun's agent store)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" and \
        bool(os.environ.get("MASTER_ADDR")) and bool(os.environ.get("MASTER_PORT"))


def _connect():
    """A new client of the launcher's store, or None when there is none (yet)."""
    import torch.distributed as dist
    if not dist.is_available():
        return None
    if _agent_store():
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              is_master=False, timeout=timedelta(seconds=30))
    elif dist.is_initialized():
        store = dist.distributed_c10d._get_default_store().clone()
    else:
        return None
    return dist.PrefixStore(_prefix(), store)


def _bell(rank: int) -> str:
    return f"wake/{rank}"


def _take(store, key: str) -> Optional[str]:
    """KEY's value when some rank has set it, else None (never waits)."""
    if not store.check([key]):
        return None
    return store.get(key).decode("utf-8")


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
        self._connecting = threading.Lock()
        self._publisher = None        # stops, prompts, rings (the watcher has its own)
        self._own_stop = False
        self._ending = False          # --batch: a peer's stop is ending this rank
        self._posted_first = False
        self.first: Optional[dict] = None     # the job's first stop, once known
        self._first_known = threading.Event()
        self._holding = False         # a peer's prompt is open: hold at the next boundary
        self._my_pause: Optional[int] = None
        self._pause_no = 1            # the next prompt (pause/<n>) the watcher follows
        self._paused: Optional[dict] = None   # the peer's prompt this rank holds for
        self._turn = threading.Event()        # a ring came: the terminal may be free
        self._said_hold = False
        session.listeners.insert(0, self._before_report)   # annotates what is reported
        session.add_listener(self._after_report)
        if not session.batch:
            session.pause_listeners.append(self._pausing)
            session.resume_listeners.append(self._resumed)
            register_optimizer_step_pre_hook(self._at_optimizer_step)
            _autograd_patch.add(self._around_backward)
        self._closing = threading.Event()
        self._thread = _daemon(self._watch, "mldebug-peers")
        atexit.register(self._close)
        self._thread.start()

    # -- this rank stops ---------------------------------------------------------------
    def _store(self):
        with self._connecting:
            if self._publisher is None:
                try:
                    self._publisher = _connect()
                except Exception:  # noqa: BLE001 - no store: this rank is on its own
                    self._publisher = None
            return self._publisher

    def _ring_all(self, store) -> None:
        """Every rank's watcher looks at what changed: one request, however many ranks."""
        bells = [_bell(rank) for rank in range(self.info.world_size)]
        try:
            store.multi_set(bells, ["1"] * len(bells))
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            pass

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
            # the time that rank stops: give its own stop a moment to arrive (the
            # watcher hears of it: its doorbell rings)
            self._first_known.wait(GRACE_S)
            first = self.first
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
            self._ring_all(store)

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
        # (one rank, for a few seconds at most: the count of lines written, 20 times a
        # second until every other rank has written its own)
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
                self._turn.clear()    # (before asking: a ring that comes after counts)
                holder = store.compare_set(self._tty, "", me).decode("utf-8")
                if holder == me:
                    break
                if not told:
                    print(f"{self.info.tag}mldebug: rank {holder}'s prompt has the terminal; "
                          "this rank's opens when it continues", file=self.session.out,
                          flush=True)
                    told = True
                # the holder rings every rank when its prompt closes
                self._turn.wait(TTY_RETRY_S)
            self._my_pause = store.add(PAUSES, 1)
            store.set(f"pause/{self._my_pause}", json.dumps(
                {"rank": self.info.rank, "file": stop.file, "line": stop.line,
                 "reason": stop.reason, "op": stop.op, "message": stop.message,
                 "assertion": stop.assertion}))
        except Exception:  # noqa: BLE001 - the store is gone: this rank is on its own
            self._my_pause = None
            return
        self._ring_all(store)

    def _resumed(self, stop: Stop, ended: bool) -> None:
        store, pause, self._my_pause = self._store(), self._my_pause, None
        if store is None or pause is None:
            return
        try:
            store.set(f"resume/{pause}", "quit" if ended else "continue")
            store.compare_set(self._tty, str(self.info.rank), "")
        except Exception:  # noqa: BLE001
            return
        self._ring_all(store)

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

    # -- the watcher: another rank stops -----------------------------------------------
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

    def _watch(self) -> None:
        """Sleep on this rank's doorbell; at each ring, look at what changed."""
        store = self._connect_when_possible()
        if store is None:
            return
        if not _agent_store():
            self._store()     # now, while the default group's store is there (_close)
        _daemon(self._alarm, "mldebug-peers-alarm").start()
        try:
            while self._sleep(store):
                if self._look(store):
                    return
        except Exception:  # noqa: BLE001 - the store is gone: the job is ending
            return
        finally:
            self._holding = False      # no prompt left to hold for

    def _sleep(self, store) -> bool:
        """Wait until this rank's doorbell rings (True; cleared) or the watch is over
        (False: this process is exiting, or the store is gone)."""
        import torch.distributed as dist
        bell = _bell(self.info.rank)
        while not self._closing.is_set():
            armed = time.monotonic()
            try:
                store.wait([bell], timedelta(seconds=WAIT_S))
            except dist.DistStoreError:
                # its own time limit (a lost alarm ring): wait again, unless the wait
                # fails at once
                if time.monotonic() - armed < 1.0:
                    return False
                continue
            except Exception:  # noqa: BLE001 - the store is gone (the launcher ended)
                return False
            if self._closing.is_set():
                return False
            store.delete_key(bell)
            return True
        return False

    def _look(self, store) -> bool:
        """What changed since the last ring; True when there is nothing left to watch."""
        if self.first is None:
            value = _take(store, FIRST)
            if value:
                self.first = json.loads(value)
                self._first_known.set()
        if not self.session.batch:
            self._follow_pauses(store)
            self._turn.set()
            return False
        if self.first is None:
            return False
        if self.first.get("rank") != self.info.rank:
            self._peer_stopped(store, self.first)
        return True

    def _follow_pauses(self, store) -> None:
        """Interactively: each prompt opened on another rank holds this one until it
        continues; `quit` there (or the end of its post-mortem) ends this rank too."""
        while True:
            number = self._pause_no
            if self._paused is None:
                value = _take(store, f"pause/{number}")
                if value is None:
                    return
                pause = json.loads(value)
                if pause.get("rank") == self.info.rank:
                    self._pause_no += 1        # this rank's own prompt
                    continue
                self._paused, self._holding = pause, True
                print(f"{self.info.tag}waiting: {describe_first(pause)}",
                      file=self.session.out, flush=True)
            outcome = _take(store, f"resume/{number}")
            if outcome is None:
                return
            if outcome == "quit":
                print(f"{self.info.tag}mldebug: rank {self._paused.get('rank')} ended the "
                      "program at its prompt; ending this rank too",
                      file=self.session.out, flush=True)
                _flush_and_exit(0)
            self._paused, self._holding = None, False
            self._pause_no += 1

    def _peer_stopped(self, store, first: dict) -> None:
        # this rank's watch may be pinning what it found (the same NaN, come through a
        # collective): its own stop says more than a peer_stop; the first rank keeps the
        # job up for ACK_WAIT_S
        _session.wait_pinned(ACK_WAIT_S)
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
            # stopped rank has written its own line (it sets DONE within ACK_WAIT_S of
            # its stop, whatever the others do: the wait does not reach its limit)
            try:
                store.wait([DONE], timedelta(seconds=ACK_WAIT_S + GRACE_S))
            except Exception:  # noqa: BLE001
                pass
            # the main thread may be blocked in a collective the stopped rank will never
            # join: end here, with --batch's status for a stop
            _flush_and_exit(EXIT_PEER_STOP)

    def _alarm(self) -> None:
        """Ring this rank's own doorbell once every REARM_S: no wait of the watcher's
        ever reaches its limit (and c10d's warnings)."""
        while not self._closing.wait(REARM_S):
            self._ring_self()

    def _ring_self(self) -> None:
        store = self._store()
        if store is None:
            return
        try:
            store.set(_bell(self.info.rank), "1")
        except Exception:  # noqa: BLE001 - the store is gone: so is the watcher's wait
            pass

    def _close(self) -> None:
        """At exit, before the interpreter shuts down: the watcher leaves the store (its
        own doorbell ends its wait) and is joined."""
        if self._closing.is_set():
            return
        self._closing.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._ring_self()
            self._thread.join(timeout=5)


def _daemon(target, name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.pydev_do_not_trace = True        # never traced or suspended by debugpy
    thread.is_pydev_daemon_thread = True
    return thread


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
