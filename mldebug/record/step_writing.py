"""The end of a recorded step: the step's statistics staged, packed into column blobs and
handed to the store's writer thread (methods of `Recorder`); once committed, the same
write goes to the live mirror (`to=`, mirror.py). The program's stops are noted at their
step (`[stop] ` + the stop's message), so a run and its dashboards show where it stopped."""
from __future__ import annotations

import time

import numpy as np
import torch

from ..core import session as _session
from ..core.quiet import own_work
from .capture_hooks import cuda_graph_aside
from .export import STOP_NOTE
from .mirror import Mirror
from .sinks import open_sinks


class StepWriting:
    """Methods of `Recorder`: finishing, packing and writing a recorded step."""

    def _finish_step(self) -> None:
        step = self.step_index
        if self._in_compiled and "compiled" not in self._warned:
            self._warned.add("compiled")
            self._say(
                "mldebug.record: the model runs under torch.compile: the inputs, outputs and "
                "gradients of the modules inside its compiled graph are not recorded (a "
                "hook there would break the graph); parameters and their gradients are, "
                "and the compiled module's own inputs and outputs when it is the module "
                "recorded. Record the uncompiled model to see every module, or "
                "mldebug.log_tensor what you need.")
        if not self._params_done and self.model is not None:
            self._record_params()
        with self._lock:
            entries, batch, caps = self._entries, self._batch, self._cap_store
            copied = self._copied
            self._tensor_hooks_off()
            self._reset_step()
        with own_work():
            changed, batch.twins = self._twins_of(batch, copied) if entries else (set(), [])
            staged = batch.stage() if entries else None   # no host transfer here
            caps = self._stage_captures(caps)
        entries = self._learn_copies(entries, batch.lost, changed)
        scalars, self._scalars = self._scalars, []
        notes, self._notes = self._notes, []
        self._last_flush = time.monotonic()
        w = self._writer
        if (staged is None or batch.on_host(staged)) and all(
                c[1].device.type == "cpu" for c in caps.values()):
            # all on the host: finished here. A writer thread that did it would hold the
            # GIL through many small numpy ops while the next step's Python waits (on a
            # small machine that cost more than the work); the commit still goes there
            w.flush()     # (series ids: the writer is idle while new ones are added)
            with own_work():
                packed, cap_rows = self._pack_step(step, batch, staged, entries, caps)
            job = lambda: self._commit(step, packed, entries, scalars, notes, cap_rows)
            if self._commit_here:
                w.run(job)
            else:
                w.submit(job)
            return
        w.submit(lambda: self._write_step(step, batch, staged, entries, caps, scalars, notes))

    def _write_step(self, step, batch, staged, entries, caps, scalars, notes) -> None:
        """On the writer thread: the host transfer, histograms, packing, the commit.
        (The watch's dispatch mode is per thread: this thread is not watched.)"""
        with torch.no_grad():
            packed, cap_rows = self._pack_step(step, batch, staged, entries, caps)
        self._commit(step, packed, entries, scalars, notes, cap_rows)

    def _commit(self, step, packed, entries, scalars, notes, cap_rows, recorded=True) -> None:
        """One transaction of the store (the writer thread's, or the training thread's
        for a step finished on the host); then the same write to the mirror's queue."""
        rows = _scalar_rows(scalars)
        w = self._writer
        w.write_step(step, packed, rows, notes, cap_rows, recorded=recorded)
        if self._mirror is not None and not w.failed:
            self._mirror.put(step, packed, entries, rows, notes)

    # -- the live mirror (to=) and the stops ----------------------------------------------
    def _open_mirror(self, to, name: str, meta: dict, background: bool):
        sinks = open_sinks(to, name, config={"mldebug": meta})
        return Mirror(sinks, self._say, background=background) if sinks else None

    def _close_mirror(self) -> None:
        mirror, self._mirror = self._mirror, None
        if mirror is not None:
            mirror.close()

    def _listen_for_stops(self) -> None:
        self._stops_of = _session.current()
        self._stops_of.add_listener(self._on_stop)

    def _stop_listening(self) -> None:
        session = getattr(self, "_stops_of", None)
        if session is not None:
            session.remove_listener(self._on_stop)
            self._stops_of = None

    def _on_stop(self, stop) -> None:
        """A stop of the program: a note at the step in progress (in a step's data
        handling before the forward too: not `_log_step`'s step that just ended), written
        now (the program may pause here, or end)."""
        self._notes.append((self.step_index, time.time(), STOP_NOTE + stop.message))
        if not cuda_graph_aside():
            self._flush_scalars(force=True)

    def _pack_step(self, step, batch, staged, entries, caps) -> tuple:
        """The step's stepdata row and capture rows (host transfer, histograms, packing)."""
        out = batch.finish_staged(staged) if staged is not None else None
        if out is not None and batch.twins:
            self._judge_twins(out, entries, batch.twins)
        cap_rows = self._capture_rows(step, caps)
        if not entries:
            return None, cap_rows
        if self.norm_listeners:
            self._tell_norms(step, entries, out["stats"])
        w = self._writer
        series = w._series
        sids = []
        for key, meta, _, _ in entries:
            sid = series.get(key)
            if sid is None:
                path, kind, idx, name, shape, dtype = meta[:6]
                sid = w.series_id(key, path, kind, idx, name, meta[6] if len(meta) > 6 else "",
                                  tuple(shape), str(dtype).replace("torch.", ""))
            sids.append(sid)
        return _pack(out, np.array(sids, np.int32), np.array([e[2] for e in entries], np.int32),
                     np.array([e[3] for e in entries], np.int64),
                     self.bins if self.sample else 0), cap_rows

    def _tell_norms(self, step, entries, stats) -> None:
        """The parameters' and gradients' L2 norms of a recorded step, from its summaries
        (what `history` shows while a recording computes them anyway): listener(step,
        {name: (norm, grad norm)})."""
        row: dict = {}
        for key, meta, _, r in entries:
            kind = meta[1]
            if kind in ("param", "param_grad"):
                name = meta[3]
                value = l2_norm_of_summary(stats[r])
                old = row.get(name, (None, None))
                row[name] = (value, old[1]) if kind == "param" else (old[0], value)
        if row:
            for listener in list(self.norm_listeners):
                listener(step, row)

    def _stage_captures(self, caps: dict) -> dict:
        """Means divided on the device before the step's tensors are handed over."""
        return {k: (cap, t / n if red == "mean" and n else t, red, n)
                for k, (cap, t, red, n) in caps.items()}

    def _capture_rows(self, step: int, caps: dict) -> list:
        out = []
        for (key, call), (cap, t, red, n) in caps.items():
            path, rest = key.split(":", 1)
            sid = self._writer.series_id(key, path, rest.split("[")[0], cap.index, "", "",
                                         tuple(t.shape), str(t.dtype).replace("torch.", ""))
            arr = t.detach().cpu()
            if arr.dtype == torch.bfloat16:
                arr = arr.float()
            a = np.ascontiguousarray(arr.numpy())
            out.append((step, sid, max(call, 0), red, str(list(a.shape)), a.dtype.str,
                        a.tobytes()))
        return out


def _scalar_rows(items: list) -> list:
    """(step, name, value) rows; tensors read with one transfer per device."""
    if not items:
        return []
    values = [v for _, _, v in items]
    by_device: dict = {}
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            by_device.setdefault(v.device, []).append(i)
    with torch.no_grad():   # the writer thread (or close())
        for dev, index in by_device.items():
            host = torch.stack([values[i].double() for i in index]).cpu().tolist()
            for i, h in zip(index, host):
                values[i] = h
    return [(s, n, None if float(v) != float(v) else float(v))
            for (s, n, _), v in zip(items, values)]


def _pack(out: dict, sids, calls, rows, bins: int) -> tuple:
    """The stepdata columns (after step) of a finished batch, rows picked by ROWS."""
    norm_off = np.full((len(rows), 2), -1, np.int64)
    chunks, o = [], 0
    got = out["norms"]
    if got:
        for j, r in enumerate(rows.tolist()):
            v = got.get(r)
            if v is not None:
                norm_off[j] = (o, len(v))
                chunks.append(v)
                o += len(v)
    norms = np.concatenate(chunks).astype("<f4") if chunks else np.zeros(0, "<f4")
    hist = out["hist"][rows].astype("<i4") if bins else np.zeros((len(rows), 0), "<i4")
    ranges = np.stack([out["lo"][rows], out["hi"][rows]], 1).astype("<f8")
    outside = np.stack([out["below"][rows], out["above"][rows]], 1).astype("<i4")
    return (len(rows), bins, sids.astype("<i4").tobytes(), calls.astype("<i4").tobytes(),
            out["stats"][rows].astype("<f8").tobytes(), hist.tobytes(), ranges.tobytes(),
            outside.tobytes(), out["sample_n"][rows].astype("<i4").tobytes(),
            norm_off.astype("<i8").tobytes(), norms.tobytes())


def l2_norm_of_summary(summary) -> float:
    """The L2 norm of a tensor from its summary row (`rows.SUMMARY`: count, mean, abs-mean,
    std, abs-max, min, max, nan, +inf, -inf): sqrt((n - 1)·std² + n·mean²) over the finite
    values, NaN when it holds a NaN, inf when an Inf."""
    count, mean, _, std = (float(v) for v in summary[:4])
    nan, posinf, neginf = (float(v) for v in summary[7:10])
    if nan:
        return float("nan")
    if posinf or neginf:
        return float("inf")
    n = count
    if n <= 0:
        return 0.0
    sumsq = n * mean * mean + ((n - 1) * std * std if n > 1 else 0.0)
    return float(np.sqrt(max(sumsq, 0.0)))
