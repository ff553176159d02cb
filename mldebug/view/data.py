"""What the page draws, computed in Python from the engine's records (no statistics of
its own: `slicing.slice_plane`, `summary`, `graph`, `assertions`, `record.timeline`). Runs on the view's
worker thread, never on the IOLoop. Nothing here imports bokeh.
"""
from __future__ import annotations

import html
import os
import threading
from typing import Optional

import numpy as np

from ..assertions import registry as _registry
from ..assertions.runner import active_runner
from ..record.recorder import active_recorder
from ..record.store import list_runs, open_run
from ..record.timeline import compare, hist_grid, timeline
from ..summaries import budgeted as _v
from ..summaries import slicing as _slicing
from ..summaries import summary
from ..core import session as _session
from ..core.ranks import rank_tag
from ..core.records import data_text
# the graph's rows live with the graph figure (mldebug/figures), shared with the VS Code
# panel; these names stay importable from here
from ..figures.graph_rows import (GRAPH_ROWS_MAX, current_graph, graph_rows,  # noqa: F401
                                  node_entry_args)

MAX_SIDE = 400          # heatmap cells per side: about the plot's size in pixels
STATS_FIELDS = (("shape", "shape"), ("dtype", "dtype"), ("device", "device"),
                ("numel", "n"), ("min", "min"), ("max", "max"), ("mean", "mean"),
                ("std", "std"), ("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"),
                ("zeros", "zeros"), ("first_nonfinite", "first NaN/Inf at"),
                ("requires_grad", "requires_grad"), ("note", "note"))


# -- tensor panel ----------------------------------------------------------------------
def tensor_view(value, name: str, dims=None, index=None, max_side: int = MAX_SIDE) -> dict:
    """The heatmap of one slice: slice_plane's result plus the display array (float32,
    NaN / +Inf / -Inf where the cell is so; the colour mapper draws them apart) and the
    hover's index template. Raises slicing.SliceError for a bad request."""
    s = _slicing.slice_plane(value, name, dims, index, False, max_side)
    display = s["shown"].astype(np.float32)
    kinds = s["kinds"]
    display[kinds == 1] = np.nan
    display[kinds == 2] = np.inf
    display[kinds == 3] = -np.inf
    s["display"] = display
    ndim = len(s["shape"])
    parts = []
    for i in range(ndim):
        if i == s["dims"][0]:
            parts.append("{r}")
        elif i == s["dims"][1]:
            parts.append("{c}")
        else:
            parts.append(str(s["full_index"][i]))
    s["template"] = "[" + ", ".join(parts) + "]"
    s["rows_in"] = s["shape"][s["dims"][0]] if ndim >= 2 else 1
    s["cols_in"] = s["shape"][s["dims"][1]] if ndim >= 1 else 1
    finite = display[np.isfinite(display)]
    if finite.size:
        lo, hi = float(finite.min()), float(finite.max())
    else:
        lo, hi = 0.0, 1.0
    if hi <= lo:
        lo, hi = lo - 0.5, hi + 0.5
    s["low"], s["high"] = lo, hi
    s.pop("value", None)
    return s


def header(value) -> str:
    """The one line without the stats pass (shape, dtype, device)."""
    try:
        return str(_v.header(value)).replace(_v.PENDING_NOTE, "").strip()
    except Exception:  # noqa: BLE001
        return type(value).__name__


def stats_html(value, title: str) -> str:
    """The stats table of VALUE (its full TensorSummary), as HTML."""
    d = summary(value).to_dict()
    rows = []
    for key, label in STATS_FIELDS:
        v = d.get(key)
        if v in (None, "", [], False) and key not in ("nan", "posinf", "neginf", "min", "max"):
            continue
        if isinstance(v, float):
            v = f"{v:.6g}"
        elif isinstance(v, list):
            v = "[" + ", ".join(str(x) for x in v) + "]"
        cls = ' class="bad"' if key in ("nan", "posinf", "neginf") and v else ""
        rows.append(f"<tr{cls}><th>{html.escape(label)}</th><td>{html.escape(str(v))}</td></tr>")
    return (f'<div class="mld-stats"><b>{html.escape(title)}</b>'
            f'<table>{"".join(rows)}</table></div>')


# -- stop banner -------------------------------------------------------------------------
def banner_html(snapshot: dict) -> str:
    mode, stop, where = snapshot["mode"], snapshot["stop"], snapshot["where"]
    state = {"prompt": "paused at the mldebug prompt",
             "wait": "paused by mldebug.inspect(..., wait=True)",
             "running": "running (buttons work while mldebug's prompt waits)"}.get(mode, mode)
    parts = [f'<div class="mld-state mld-{html.escape(mode)}">Program: <b>{html.escape(state)}</b>']
    if where:
        parts.append(f' at <code class="mld-where">{html.escape(os.path.basename(where["file"]))}:'
                     f'{where["line"]}</code> in {html.escape(where["function"])}')
    parts.append("</div>")
    if stop:
        loc = f'{os.path.basename(stop.get("file") or "")}:{stop.get("line")}' if stop.get("file") else ""
        fields = [("reason", stop.get("reason")), ("op", stop.get("op")),
                  ("module", stop.get("module")), ("at", loc), ("stage", stop.get("stage")),
                  ("data", data_text(stop["data"]) if stop.get("data") else ""),
                  ("rank", stop.get("rank"))]
        cells = " ".join(f"<span class='mld-field'><i>{k}</i> {html.escape(str(v))}</span>"
                        for k, v in fields if v not in (None, ""))
        message = stop.get("message") or ""
        hint = stop.get("hint") or ""
        if hint:      # (the message ends with it: shown once, on its own line)
            message = message.replace(f"; hint: {hint}", "")
            hint = f'<div class="mld-hint"><b>Hint:</b> {html.escape(hint)}</div>'
        parts.append(f'<div class="mld-stop mld-reason-{html.escape(str(stop.get("reason")))}">'
                     f'<b>Stop:</b> {html.escape(message)}{hint}'
                     f'<div>{cells}</div></div>')
    elif mode != "wait":
        parts.append('<div class="mld-stop mld-none">No stop yet.</div>')
    return "".join(parts)


# -- assertions ----------------------------------------------------------------------------
def assertions_html() -> str:
    items = "".join(f"<li>{html.escape(a.describe())}</li>" for a in _registry.assertions())
    runner = active_runner()
    if runner is None:
        step = '<p class="mld-note">Assertions are not running (--break-on without assert).</p>'
    else:
        vs = list(runner.step_violations)
        step = (f"<p><b>Violations this step ({len(vs)}):</b></p><ul class='mld-violations'>"
                + "".join(f"<li class='bad'>{html.escape(v.headline())}</li>" for v in vs)
                + "</ul>") if vs else "<p>No violations this step.</p>"
    return f"<div class='mld-assertions'>{step}<details><summary>Registered assertions</summary><ul>{items}</ul></details></div>"


# -- timeline (recorded runs) ----------------------------------------------------------------
TIMELINE_BINS = 64      # value bins of the histogram-over-steps image
TIMELINE_STEPS = 200    # steps per series (evenly thinned beyond)
_run_dirs: list = []    # mldebug.view(runs=...), in the order given
_run_dirs_lock = threading.Lock()


def add_run_dirs(runs) -> list:
    """Add run directories (a path or a list of paths) to those the timeline lists;
    returns them all. Raises TypeError naming a value that is not a path."""
    if runs is None:
        return run_dirs()
    items = [runs] if isinstance(runs, (str, os.PathLike)) else list(runs)
    for r in items:
        if not isinstance(r, (str, os.PathLike)):
            raise TypeError(f"runs must be a directory path or a list of them, got {r!r}")
    with _run_dirs_lock:
        for r in items:
            d = os.path.abspath(os.fspath(r))
            if d not in _run_dirs:
                _run_dirs.append(d)
        return list(_run_dirs)


def run_dirs() -> list:
    """The directories the timeline lists: the running recording's run_dir (when
    `mldebug.record` runs in this process) first, then those given to the view and
    those of recordings seen running earlier (a run stays listed once it ends)."""
    rec = active_recorder()
    with _run_dirs_lock:
        if rec is not None:
            d = os.path.abspath(rec.run_dir)
            if d in _run_dirs:
                _run_dirs.remove(d)
            _run_dirs.insert(0, d)
        return list(_run_dirs)


def known_runs() -> dict:
    """{"runs": [{name, path, status, steps, dir, live}], "notes": [text]} of every run
    store in run_dirs(); a missing directory is a note, not an error."""
    rec = active_recorder()
    live = os.path.abspath(rec.path) if rec is not None else None
    runs, notes = [], []
    for d in run_dirs():
        try:
            found = list_runs(d)
        except (FileNotFoundError, NotADirectoryError) as exc:
            notes.append(str(exc))
            continue
        for r in found:
            runs.append({"name": r["name"], "path": os.path.abspath(r["path"]),
                         "status": r["status"], "steps": r["steps"], "dir": d,
                         "rank": r.get("rank"),
                         "live": os.path.abspath(r["path"]) == live})
    return {"runs": runs, "notes": notes}


def run_label(run: dict, several_dirs: bool) -> str:
    where = f" in {os.path.basename(run['dir']) or run['dir']}" if several_dirs else ""
    state = " (recording)" if run["live"] else " (unreadable)" if run["status"] == "unreadable" else ""
    return f"{rank_tag(run.get('rank'))}{run['name']}{where}: {run['steps']} steps{state}"


def _side(t: Optional[dict], key: str, kpi: str, bins: int) -> dict:
    """What one run contributes to the timeline panel for series KEY and scalar KPI."""
    def arr(values):
        return np.array([np.nan if v is None else v for v in values], dtype=np.float64)

    # the rank of a job that recorded it leads the name (legend, titles, notes)
    out = {"name": f"{rank_tag(t.get('rank'))}{t['name']}" if t else "", "note": "", "image": None,
           "stats": {"step": np.zeros(0), "mean": np.zeros(0), "std": np.zeros(0),
                     "abs_max": np.zeros(0), "nonfinite": np.zeros(0)},
           "kpi": {"step": np.zeros(0), "value": np.zeros(0)}}
    if t is None:
        return out
    if kpi in t["scalars"]:
        sc = t["scalars"][kpi]
        out["kpi"] = {"step": arr(sc["steps"]), "value": arr(sc["values"])}
    series = next((s for s in t["series"] if s["key"] == key), None)
    if series is None:
        out["note"] = f"no series {key} in run {out['name']}" if key else f"run {out['name']} has no series"
        return out
    st = series["stats"]
    abs_max = arr(st["abs_max"])
    abs_max[~(abs_max > 0)] = np.nan          # drawn on a log axis
    out["stats"] = {"step": arr(series["steps"]), "mean": arr(st["mean"]),
                    "std": arr(st["std"]), "abs_max": abs_max,
                    "nonfinite": arr([a + b + c for a, b, c in
                                      zip(st["nan"], st["posinf"], st["neginf"])])}
    if series["steps"]:
        g = hist_grid(series, bins)
        steps = g["steps"]
        # one image column per step of a regular grid (the median spacing); steps that
        # were not recorded stay empty
        gap = int(np.median(np.diff(steps))) if len(steps) > 1 else 1
        gap = max(gap, 1)
        ncols = min((steps[-1] - steps[0]) // gap + 1, 4 * TIMELINE_STEPS)
        image = np.full((bins, ncols), np.nan, dtype=np.float32)
        share = np.array([[np.nan if v is None else v for v in r] for r in g["share"]],
                         dtype=np.float32).reshape(bins, len(steps))
        cols = np.minimum((np.asarray(steps) - steps[0]) // gap, ncols - 1)
        image[:, cols] = share
        image[image == 0] = np.nan            # empty cells stay transparent
        out["image"] = {"image": image, "x": steps[0] - gap / 2, "dw": ncols * gap,
                        "y": g["lo"], "dh": g["hi"] - g["lo"],
                        "high": float(np.nanmax(image)) if np.isfinite(image).any() else 1.0}
        if series["calls"] > 1:
            out["note"] = f"{key} runs {series['calls']} times a step: its first call is shown"
    else:
        out["note"] = f"{key}: no recorded step in run {out['name']}"
    return out


def timeline_view(path_a: str, path_b: Optional[str] = None, key: Optional[str] = None,
                  kpi: Optional[str] = None, bins: int = TIMELINE_BINS) -> dict:
    """What the timeline panel draws for run PATH_A (and PATH_B beside it), series KEY
    (default: A's first parameter) and scalar KPI (default 'loss', else A's first scalar):
    {"series": [(key, label)], "key", "kpis": [...], "kpi", "sides": [side_a, side_b?]}.
    Raises FileNotFoundError / ValueError for a bad store."""
    with open_run(path_a) as run:
        series = run.series()
    keys = [s["key"] for s in series]
    if key not in keys:   # default: the first parameter (what a learning rate moves)
        key = next((s["key"] for s in series if s["kind"] == "param"), keys[0] if keys else "")
    chosen = next((s for s in series if s["key"] == key), None)
    filt = dict(modules=[chosen["module"]], kinds=[chosen["kind"]]) if chosen else \
        dict(modules=[], kinds=[])
    if path_b and path_b != path_a:
        ta, tb = compare(path_a, path_b, max_steps=TIMELINE_STEPS, **filt)["runs"]
    else:
        ta, tb = timeline(path_a, max_steps=TIMELINE_STEPS, **filt), None
    kpis = sorted(set(ta["scalars"]) | (set(tb["scalars"]) if tb else set()))
    if kpi not in kpis:
        kpi = "loss" if "loss" in kpis else (kpis[0] if kpis else "")
    labels = [(s["key"], f"{s['key']}  {list(s['shape'])}") for s in series]
    sides = [_side(ta, key, kpi, bins)] + ([_side(tb, key, kpi, bins)] if tb else [])
    return {"series": labels, "key": key, "kpis": kpis, "kpi": kpi, "sides": sides}
