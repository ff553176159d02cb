"""The run store: one SQLite file per run (`RUN_DIR/NAME.sqlite`), written one
transaction per recorded step, and the read API.

Safety: WAL journal, `synchronous=NORMAL`, one COMMIT per recorded step. A program
killed at any point (SIGKILL included) leaves every committed step readable; what is
lost is the step in progress (and scalars of unrecorded steps logged in the last
`SCALAR_FLUSH_S` seconds). A failing write warns once and never raises into the program.

Schema (version 1)
    meta(key, value)            JSON values: run, created, every, log, bins, sample, ...,
                                status ('recording' until close(), then 'closed')
    steps(step, time, recorded) one row per step that stored anything
    series(id, key, module, kind, idx, name, role, shape, dtype)
                                what a row is of. kind: input, output, input_grad,
                                output_grad, param, param_grad, tensor; key is
                                'MODULE:KIND[IDX]' for io, 'NAME:param' / 'NAME:param_grad'
                                for parameters, 'NAME:tensor' for log_tensor
    stepdata(step, k, bins, series, calls, stats, hist, ranges, outside, sample_n,
             norm_off, norms)
                                one row per recorded step, each column a packed array of
                                the step's K rows (little-endian, C order): series int32,
                                calls int32 (invocation index of the module in the step),
                                stats float64 [K, 10] (STAT_COLUMNS), hist int32 [K, bins]
                                (counts over [lo, hi] of a sample of sample_n values),
                                ranges float64 [K, 2] (lo, hi), outside int32 [K, 2]
                                (sample values below / above the range), sample_n int32,
                                norm_off int64 [K, 2] (start, length in norms, -1 if none),
                                norms float32 (per-sample gradient norms). One row per step
                                keeps a commit to a few appended pages: one row per tensor
                                costs ~4x more per step.
    scalars(step, name, value)  log_scalar
    notes(step, time, text)     log_note and record(note=...)
    captures(step, series, call, reduction, shape, dtype, data)
                                full tensors (capture=...), data = raw bytes (C order)
"""
from __future__ import annotations

import json
import math
import os
import queue
import sqlite3
import secrets
import threading
import time
import warnings
from typing import Iterable, Iterator, Optional

import numpy as np

from ..core.errors import UsageError

SCHEMA_VERSION = 1
SUFFIX = ".sqlite"
SCALAR_FLUSH_S = 1.0

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT);
CREATE TABLE IF NOT EXISTS steps (step INTEGER PRIMARY KEY, time REAL, recorded INTEGER);
CREATE TABLE IF NOT EXISTS series (id INTEGER PRIMARY KEY, key TEXT UNIQUE, module TEXT,
    kind TEXT, idx INTEGER, name TEXT, role TEXT, shape TEXT, dtype TEXT);
CREATE TABLE IF NOT EXISTS stepdata (step INTEGER PRIMARY KEY, k INTEGER, bins INTEGER,
    series BLOB, calls BLOB, stats BLOB, hist BLOB, ranges BLOB, outside BLOB,
    sample_n BLOB, norm_off BLOB, norms BLOB);
CREATE TABLE IF NOT EXISTS scalars (step INTEGER, name TEXT, value REAL);
CREATE INDEX IF NOT EXISTS scalars_name ON scalars (name, step);
CREATE TABLE IF NOT EXISTS notes (step INTEGER, time REAL, text TEXT);
CREATE TABLE IF NOT EXISTS captures (step INTEGER, series INTEGER, call INTEGER,
    reduction TEXT, shape TEXT, dtype TEXT, data BLOB);
"""
STAT_COLUMNS = ("numel", "mean", "abs_mean", "std", "abs_max", "min", "max", "nan",
                "posinf", "neginf")


def run_path(run_dir: str, name: str) -> str:
    return os.path.join(run_dir, name + SUFFIX)


def check_run_name(name: str) -> str:
    if not isinstance(name, str) or not name or name.strip() != name \
            or any(c in name for c in "/\\\0") or name in (".", ".."):
        raise UsageError(f"run name must be a non-empty file name without '/', run={name!r}")
    return name


def is_run_file(path: str) -> bool:
    """Whether PATH is a run mldebug recorded (a SQLite file with the run's meta table),
    read without changing it: only such a file is replaced by a new run of its name."""
    try:
        db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
        try:
            return db.execute("SELECT 1 FROM meta WHERE key = 'schema'").fetchone() is not None
        finally:
            db.close()
    except sqlite3.Error:
        return False


def _create(path: str, meta: dict) -> None:
    """A new, empty run at PATH, built under a temporary name beside it and renamed over
    what was there: an earlier run of the name is whole until the new one replaces it."""
    # a new name sqlite creates itself (its permissions, as for any run: 0644 less the
    # umask); mkstemp's 0600 would make a replaced run unreadable to the user's group
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)),
                       f".mldebug-run-{secrets.token_hex(8)}.sqlite")
    try:
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.executescript(_SCHEMA)
            db.execute("BEGIN")
            db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                           [(k, json.dumps(v, default=str)) for k, v in
                            dict(meta, schema=SCHEMA_VERSION, status="recording").items()])
            db.execute("COMMIT")
        finally:
            db.close()
        for extra in ("-wal", "-shm"):    # the earlier run's journal must not meet the new
            if os.path.exists(path + extra):
                os.remove(path + extra)
        os.replace(tmp, path)
    except BaseException:
        for leftover in (tmp, tmp + "-journal"):
            if os.path.exists(leftover):
                os.remove(leftover)
        raise


class Writer:
    """Writes one run. Every method is safe to call after a failure (it does nothing).

    With `background=True` the work handed to `submit(fn)` runs on one writer thread, in
    order; `submit` first waits for the previous job to be committed, so a program killed
    at any moment loses at most the step whose write is in flight (the issue's promise).
    The thread is marked so that debugpy neither traces nor suspends it."""

    def __init__(self, path: str, meta: dict, background: bool = True):
        self.path = path
        self.failed = False
        self._queue: Optional[queue.Queue] = None
        self._thread: Optional[threading.Thread] = None
        self._series: dict = {}            # key -> id
        self._pending_series: list = []   # new series of the step being written
        self._db = None
        if os.path.exists(path) and not is_run_file(path):
            raise FileExistsError(f"{path} exists and is not a run mldebug recorded: it is "
                                  "left as it is (pass another run= or run_dir=)")
        try:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            _create(path, meta)
            db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            self._db = db
        except (sqlite3.Error, OSError) as exc:
            raise OSError(f"cannot create the run store {path!r}: {exc}") from exc
        if background:
            self._queue = queue.Queue(maxsize=2)
            t = threading.Thread(target=self._work, name="mldebug-record-writer", daemon=True)
            t.is_pydev_daemon_thread = True   # debugpy: not a user thread
            t.pydev_do_not_trace = True
            t.start()
            self._thread = t

    def submit(self, fn) -> None:
        """Run FN() on the writer thread (inline without one); errors warn once."""
        if self._thread is None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001
                self._fail(exc)
            return
        self._queue.join()     # the previous step is on disk before the next is handed over
        self._queue.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                if fn is None:
                    return
                fn()
            except Exception as exc:  # noqa: BLE001 - a bug in recording never ends the program
                self._fail(exc)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until everything submitted is written."""
        if self._thread is not None:
            self._queue.join()

    def run(self, fn) -> None:
        """FN() now, on the calling thread, after everything submitted; errors warn once."""
        self.flush()
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a bug in recording never ends the program
            self._fail(exc)

    def _fail(self, exc: Exception) -> None:
        if not self.failed:
            self.failed = True
            warnings.warn(f"mldebug.record: writing {self.path!r} failed ({type(exc).__name__}: "
                          f"{exc}); recording stops, the program goes on",
                          RuntimeWarning, stacklevel=4)

    def series_id(self, key: str, module: str, kind: str, idx: int, name: str, role: str,
                  shape, dtype) -> int:
        """The id of KEY, inserted inside the current transaction when new."""
        sid = self._series.get(key)
        if sid is None:
            sid = len(self._series) + 1
            self._series[key] = sid
            self._pending_series.append((sid, key, module, kind, idx, name, role,
                                         json.dumps(list(shape)), dtype))
        return sid

    def write_step(self, step: int, stats: Optional[tuple], scalars: list, notes: list,
                   captures: list, recorded: bool = True) -> None:
        """One transaction: new series, the step's rows; then COMMIT."""
        if self._db is None or self.failed:
            return
        db = self._db
        try:
            db.execute("BEGIN")
            if self._pending_series:
                db.executemany("INSERT INTO series VALUES (?,?,?,?,?,?,?,?,?)",
                               self._pending_series)
            if stats:
                db.execute("INSERT OR REPLACE INTO stepdata VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                           (step,) + tuple(stats))
            if scalars:
                db.executemany("INSERT INTO scalars VALUES (?,?,?)", scalars)
            if notes:
                db.executemany("INSERT INTO notes VALUES (?,?,?)", notes)
            if captures:
                db.executemany("INSERT INTO captures VALUES (?,?,?,?,?,?,?)", captures)
            if stats or captures or recorded:
                db.execute("INSERT OR REPLACE INTO steps VALUES (?,?,?)",
                           (step, time.time(), int(recorded)))
            db.execute("COMMIT")
            self._pending_series = []
        except (sqlite3.Error, OSError, ValueError, OverflowError) as exc:
            try:
                db.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            self._fail(exc)

    def set_meta(self, **items) -> None:
        if self._db is None or self.failed:
            return
        try:
            self._db.executemany("INSERT OR REPLACE INTO meta VALUES (?, ?)",
                                 [(k, json.dumps(v, default=str)) for k, v in items.items()])
        except sqlite3.Error as exc:
            self._fail(exc)

    def close(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            self._thread = None
        if self._db is None:
            return
        try:
            self._db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            self._db.close()
        except sqlite3.Error as exc:
            self._fail(exc)
        self._db = None


# -- reading ----------------------------------------------------------------------------
class Run:
    """A stored run, read-only. `open_run(path)` or `Run(path)`; usable as a context manager.

        run.name, run.path, run.meta            the run's name, file and settings
        run.steps()                             steps that stored anything, ascending
        run.series(module=None, kind=None)      [{key, module, kind, idx, name, role, shape, dtype}]
        run.stats(key, steps=None)              [{step, call, numel, mean, abs_mean, std,
                                                  abs_max, min, max, nan, posinf, neginf}]
        run.histograms(key)                     [{step, call, lo, hi, counts, below, above,
                                                  sample_n}]
        run.norms(key, step, call=0)            per-sample gradient norms (numpy) or None
        run.scalars(name=None)                  {name: [(step, value), ...]}
        run.notes()                             [(step, text)]
        run.captures(key=None, step=None)       [{key, step, call, reduction, array}]
        run.step_rows()                         (step, {keys, calls, stats, hist, ...}) a step at a time
        run.step_times()                        {step: time it was written}
    """

    def __init__(self, path: str):
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"no run store at {path!r}")
        self.path = path
        try:
            self._db = sqlite3.connect(path, check_same_thread=False)
            self._db.execute("PRAGMA query_only=1")
            rows = self._db.execute("SELECT key, value FROM meta").fetchall()
        except sqlite3.Error as exc:
            raise ValueError(f"{path!r} is not an mldebug run store ({exc})") from None
        self.meta = {k: json.loads(v) for k, v in rows}
        self.name = self.meta.get("run") or os.path.basename(path)[:-len(SUFFIX)]
        self._series = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def __repr__(self):
        return f"Run({self.name!r}, {len(self.steps())} steps, {self.path!r})"

    @property
    def status(self) -> str:
        return self.meta.get("status", "?")

    def steps(self) -> list:
        return [r[0] for r in self._db.execute("SELECT step FROM steps ORDER BY step")]

    def _all_series(self) -> list:
        if self._series is None:
            cols = ("id", "key", "module", "kind", "idx", "name", "role", "shape", "dtype")
            self._series = [dict(zip(cols, r)) for r in
                            self._db.execute(f"SELECT {', '.join(cols)} FROM series ORDER BY id")]
            for s in self._series:
                s["shape"] = json.loads(s["shape"]) if s["shape"] else []
        return self._series

    def series(self, module: Optional[str] = None, kind: Optional[str] = None) -> list:
        return [{k: v for k, v in s.items() if k != "id"} for s in self._all_series()
                if (module is None or s["module"] == module) and (kind is None or s["kind"] == kind)]

    def _sid(self, key: str) -> int:
        for s in self._all_series():
            if s["key"] == key:
                return s["id"]
        keys = [s["key"] for s in self._all_series()]
        hint = ", ".join(keys[:8]) + (" ..." if len(keys) > 8 else "")
        raise KeyError(f"no series {key!r} in run {self.name!r} (have: {hint or 'none'})")

    def _rows_of(self, sid: int):
        """(step, call, index, unpacked step data) for every row of series SID."""
        for (step, k, bins, series, calls, stats, hist, ranges, outside, sample_n, noff,
             norms) in self._db.execute("SELECT * FROM stepdata ORDER BY step"):
            ids = np.frombuffer(series, "<i4")
            hits = np.nonzero(ids == sid)[0]
            if not len(hits):
                continue
            data = {"k": k, "bins": bins, "calls": np.frombuffer(calls, "<i4"),
                    "stats": np.frombuffer(stats, "<f8").reshape(k, len(STAT_COLUMNS)),
                    "hist": np.frombuffer(hist, "<i4").reshape(k, bins) if bins else None,
                    "ranges": np.frombuffer(ranges, "<f8").reshape(k, 2),
                    "outside": np.frombuffer(outside, "<i4").reshape(k, 2),
                    "sample_n": np.frombuffer(sample_n, "<i4"),
                    "norm_off": np.frombuffer(noff, "<i8").reshape(k, 2), "norms": norms}
            for i in hits:
                yield step, int(data["calls"][i]), int(i), data

    def table(self, keys: Optional[Iterable[str]] = None,
              steps: Optional[Iterable[int]] = None) -> dict:
        """Everything of many series in ONE pass over the steps: {key: {'steps': int64 [n],
        'calls': [n], 'stats': float64 [n, 10] (STAT_COLUMNS), 'hist': int32 [n, bins],
        'ranges': [n, 2], 'outside': [n, 2], 'sample_n': [n]}} (all series by default)."""
        by_sid = {s["id"]: s["key"] for s in self._all_series()}
        if keys is not None:
            wanted_keys = set(keys)
            missing = wanted_keys - set(by_sid.values())
            if missing:
                self._sid(sorted(missing)[0])   # raises KeyError with the known keys
            by_sid = {i: k for i, k in by_sid.items() if k in wanted_keys}
        wanted_steps = set(steps) if steps is not None else None
        acc: dict = {k: {"steps": [], "calls": [], "stats": [], "hist": [], "ranges": [],
                         "outside": [], "sample_n": []} for k in by_sid.values()}
        sid_array = np.array(sorted(by_sid), np.int32)
        for (step, k, bins, series, calls, stats, hist, ranges, outside, sample_n, _noff,
             _norms) in self._db.execute("SELECT * FROM stepdata ORDER BY step"):
            if wanted_steps is not None and step not in wanted_steps:
                continue
            ids = np.frombuffer(series, "<i4")
            hits = np.nonzero(np.isin(ids, sid_array))[0]
            if not len(hits):
                continue
            st = np.frombuffer(stats, "<f8").reshape(k, len(STAT_COLUMNS))
            hi = np.frombuffer(hist, "<i4").reshape(k, bins) if bins else np.zeros((k, 0), "<i4")
            rg = np.frombuffer(ranges, "<f8").reshape(k, 2)
            out = np.frombuffer(outside, "<i4").reshape(k, 2)
            cl = np.frombuffer(calls, "<i4")
            sn = np.frombuffer(sample_n, "<i4")
            for i in hits:
                a = acc[by_sid[int(ids[i])]]
                a["steps"].append(step)
                a["calls"].append(int(cl[i]))
                a["stats"].append(st[i])
                a["hist"].append(hi[i])
                a["ranges"].append(rg[i])
                a["outside"].append(out[i])
                a["sample_n"].append(int(sn[i]))
        result = {}
        for key, a in acc.items():
            n = len(a["steps"])
            result[key] = {
                "steps": np.array(a["steps"], np.int64), "calls": np.array(a["calls"], np.int64),
                "stats": np.array(a["stats"]).reshape(n, len(STAT_COLUMNS)),
                "hist": np.array(a["hist"]).reshape(n, -1) if n else np.zeros((0, 0), np.int32),
                "ranges": np.array(a["ranges"]).reshape(n, 2),
                "outside": np.array(a["outside"]).reshape(n, 2),
                "sample_n": np.array(a["sample_n"], np.int64)}
        return result

    def stats(self, key: str, steps: Optional[Iterable[int]] = None) -> list:
        """[{step, call, numel, mean, abs_mean, std, abs_max, min, max, nan, posinf,
        neginf}] of series KEY, by step and call (None where undefined)."""
        wanted = set(steps) if steps is not None else None
        out = []
        ints = {"numel", "nan", "posinf", "neginf"}
        for step, call, i, data in self._rows_of(self._sid(key)):
            if wanted is not None and step not in wanted:
                continue
            d = {"step": step, "call": call}
            for name, v in zip(STAT_COLUMNS, data["stats"][i]):
                v = float(v)
                d[name] = int(v) if name in ints else (None if v != v else v)
            out.append(d)
        return out

    def histograms(self, key: str) -> list:
        """[{step, call, lo, hi, counts, below, above, sample_n}] of series KEY."""
        out = []
        for step, call, i, data in self._rows_of(self._sid(key)):
            lo, hi = (float(v) for v in data["ranges"][i])
            out.append({"step": step, "call": call, "lo": lo, "hi": hi,
                        "counts": data["hist"][i].tolist() if data["hist"] is not None else [],
                        "below": int(data["outside"][i, 0]), "above": int(data["outside"][i, 1]),
                        "sample_n": int(data["sample_n"][i])})
        return out

    def norms(self, key: str, step: int, call: int = 0):
        """Per-sample gradient norms of series KEY at STEP (numpy float32) or None."""
        for s, c, i, data in self._rows_of(self._sid(key)):
            if s == step and c == call:
                start, length = (int(v) for v in data["norm_off"][i])
                if start < 0:
                    return None
                return np.frombuffer(data["norms"], "<f4")[start:start + length].copy()
        return None

    def scalars(self, name: Optional[str] = None) -> dict:
        q = "SELECT name, step, value FROM scalars"
        args: tuple = ()
        if name is not None:
            q += " WHERE name=?"
            args = (name,)
        out: dict = {}
        for n, step, value in self._db.execute(q + " ORDER BY rowid", args):
            out.setdefault(n, []).append((step, math.nan if value is None else value))
        return out

    def notes(self) -> list:
        return [(s, t) for s, t in self._db.execute("SELECT step, text FROM notes ORDER BY rowid")]

    def captures(self, key: Optional[str] = None, step: Optional[int] = None) -> list:
        by_id = {s["id"]: s["key"] for s in self._all_series()}
        q, args = "SELECT step, series, call, reduction, shape, dtype, data FROM captures", []
        cond = []
        if key is not None:
            cond.append("series=?")
            args.append(self._sid(key))
        if step is not None:
            cond.append("step=?")
            args.append(step)
        if cond:
            q += " WHERE " + " AND ".join(cond)
        out = []
        for s, sid, call, red, shape, dtype, data in self._db.execute(q + " ORDER BY rowid", args):
            arr = np.frombuffer(data, dtype=np.dtype(dtype)).reshape(json.loads(shape)).copy()
            out.append({"key": by_id.get(sid, "?"), "step": s, "call": call,
                        "reduction": red, "array": arr})
        return out

    def step_rows(self) -> Iterator[tuple]:
        """(step, `unpack_step` arrays plus 'keys', the series key of each row) of every
        recorded step, ascending, read one row at a time (an export walks a long run
        without holding it in memory)."""
        by_id = {s["id"]: s["key"] for s in self._all_series()}
        cur = self._db.execute("SELECT step, k, bins, series, calls, stats, hist, ranges, "
                               "outside, sample_n FROM stepdata ORDER BY step")
        for step, *columns in cur:
            rows = unpack_step(*columns)
            ids = rows["series"].tolist()
            if any(i not in by_id for i in ids):    # (a run still recording added some)
                self._series = None
                by_id = {s["id"]: s["key"] for s in self._all_series()}
            rows["keys"] = [by_id.get(i, f"?{i}") for i in ids]
            yield step, rows

    def step_times(self) -> dict:
        """{step: time.time() when it was written} of the steps that stored anything."""
        return dict(self._db.execute("SELECT step, time FROM steps"))


def unpack_step(k, bins, series, calls, stats, hist, ranges, outside, sample_n, *_norms) -> dict:
    """The arrays of one step's K rows: a stepdata row's columns after `step`, or the
    tuple the recorder packs for it (`step_writing._pack`, norms last)."""
    return {"series": np.frombuffer(series, "<i4"), "calls": np.frombuffer(calls, "<i4"),
            "stats": np.frombuffer(stats, "<f8").reshape(k, len(STAT_COLUMNS)),
            "hist": np.frombuffer(hist, "<i4").reshape(k, bins),
            "ranges": np.frombuffer(ranges, "<f8").reshape(k, 2),
            "outside": np.frombuffer(outside, "<i4").reshape(k, 2),
            "sample_n": np.frombuffer(sample_n, "<i4")}


def open_run(path_or_name: str, run_dir: Optional[str] = None) -> Run:
    """Open a stored run: a path to its .sqlite file, or a run name inside RUN_DIR."""
    path = os.fspath(path_or_name)
    if run_dir is not None and not os.path.exists(path):
        path = run_path(run_dir, path)
    return Run(path)


def list_runs(run_dir: str) -> list:
    """[{name, path, status, steps, first, last, created, note, scalars, rank,
    world_size}] for every run store in
    RUN_DIR (sorted by name). Raises FileNotFoundError / NotADirectoryError."""
    if not os.path.exists(run_dir):
        raise FileNotFoundError(f"no such directory: {run_dir!r}")
    if not os.path.isdir(run_dir):
        raise NotADirectoryError(f"not a directory: {run_dir!r}")
    out = []
    for entry in sorted(os.listdir(run_dir)):
        if not entry.endswith(SUFFIX):
            continue
        path = os.path.join(run_dir, entry)
        try:
            with Run(path) as run:
                steps = run.steps()
                out.append({"name": run.name, "path": path, "status": run.status,
                            "steps": len(steps), "first": steps[0] if steps else None,
                            "last": steps[-1] if steps else None,
                            "created": run.meta.get("created"), "note": run.meta.get("note", ""),
                            "scalars": sorted(run.scalars()),
                            # the rank of a multi-process job that recorded it (else None)
                            "rank": run.meta.get("rank"),
                            "world_size": run.meta.get("world_size")})
        except (ValueError, sqlite3.Error) as exc:
            out.append({"name": entry[:-len(SUFFIX)], "path": path, "status": "unreadable",
                        "error": str(exc), "steps": 0, "first": None, "last": None,
                        "created": None, "note": "", "scalars": [], "rank": None,
                        "world_size": None})
    return out
