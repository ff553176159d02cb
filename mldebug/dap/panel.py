"""JSON for the VS Code panel, answered through DAP `evaluate` on the paused frame.

The extension evaluates, with `context: "repl"`,

    __import__('mldebug.dap.panel', fromlist=['_']).stop_json()
    __import__('mldebug.dap.panel', fromlist=['_']).frame_json(locals())
    __import__('mldebug.dap.panel', fromlist=['_']).tensor_json(x, 'x', [0, 1], None)
    __import__('mldebug.dap.panel', fromlist=['_']).graph_json(['root#0'], mark=True)
    __import__('mldebug.dap.panel', fromlist=['_']).node_tensor_json('head#0', None, None, False)

and `JSON.parse`s the string result. The request MUST carry pydevd's raw-string format,
`"format": {"rawString": true}`: without it debugpy answers the str's repr (quoted,
escaped) cut at 65,536 characters, and a heatmap is longer than that. Every function returns a `str` of JSON (strict: no
NaN/Infinity literals), never raises (errors are `{"error": "..."}`), and keeps payloads
under about MAX_BYTES: heatmaps are downsampled here, in Python, not in the webview.

    stop_json()  -> {"stop": Stop.to_dict() of the session's last stop, or null}
    frame_json(namespace, limit=50)
                 -> {"tensors": [{"name", "line", "summary", "pending"}...], "truncated": n}
                    every tensor/array in NAMESPACE and one level inside lists, tuples and
                    dicts (`batch[0]`, `out['logits']`), sorted by name, at most LIMIT.
                    `pending: true` marks a summary still being computed (a huge tensor):
                    its `summary` has only shape/dtype/device/numel, ask again later.
    tensor_json(value, name="", dims=None, index=None, grad=False, max_side=256)
                 -> a 2-D slice for a heatmap, see `tensor_json`
    graph_json(expanded=None, mark=True)
                 -> {"graph": null, "note"} or {"graph": {"item": the view's graph figure
                    as bokeh.embed.json_item, "note", "expanded", "marked", "modules",
                    "bokeh": {"version", "js"}}}, see `graph_json`
    node_tensor_json(node_id, dims=None, index=None, grad=False, max_side=256)
                 -> tensor_json of a graph node's output (or its gradient)
"""
from __future__ import annotations

import json
import math
import warnings

from ..summaries import budgeted as _v
from ..summaries import slicing as _slicing
from ..core import session as _session
from ..core.quiet import watch_suspended
# the slicing itself lives in mldebug.slicing (shared with the browser view); these names
# stay importable from here
from ..summaries.slicing import (EXACT_STATS_MAX, HIST_BINS, NONFINITE_MAX,  # noqa: F401
                       NONFINITE_SCAN_MAX, _choose_slice, _downsample, _image, _is_fake,
                       _kinds, _png, _slice_stats)

MAX_BYTES = 1_000_000
CONTAINER_ITEMS = 64         # items looked at inside one list/tuple/dict
FRAME_BUDGET_S = 0.25        # frame_json waits at most this long for summaries in all
GRAPH_ROWS_SHOWN = 16        # rows of the graph in view; drag or wheel over it for more


def _dumps(obj) -> str:
    text = json.dumps(obj, allow_nan=False, default=str, separators=(",", ":"))
    if len(text) > MAX_BYTES:
        return json.dumps({"error": f"payload of {len(text)} bytes is over the "
                                    f"{MAX_BYTES}-byte limit; ask for less"})
    return text


def _error(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return json.dumps({"error": text})


def _safe(fn):
    def wrapper(*args, **kwargs):
        try:
            with watch_suspended():
                return fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the panel gets an error, never a raise
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                return _error(type(exc).__name__)
            return _error(exc)
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    wrapper.__wrapped__ = fn
    return wrapper


# -- stop ---------------------------------------------------------------------------------
@_safe
def stop_json() -> str:
    """{"stop": the session's last stop as Stop.to_dict(), or null}."""
    current = _session.current_if_any()   # a look must not create a session
    stop = None
    if current is not None and current.stops:
        stop = current.stops[-1].to_dict()
    return _dumps({"stop": _jsonable(stop)})


# -- frame --------------------------------------------------------------------------------
@_safe
def frame_json(namespace: dict, limit: int = 50) -> str:
    """Every tensor/array of NAMESPACE (and one level inside containers), summarised."""
    if not isinstance(namespace, dict):
        return _error(f"frame_json expects a dict such as locals(), got {type(namespace).__name__}")
    limit = max(0, int(limit))
    found = []
    for name, value in list(namespace.items()):
        if not isinstance(name, str) or name.startswith("__"):
            continue
        if _v.is_tensor(value):
            found.append((name, value))
            continue
        for sub, item in _container_items(name, value):
            if _v.is_tensor(item):
                found.append((sub, item))
    found.sort(key=lambda pair: pair[0])
    truncated = max(0, len(found) - limit)
    tensors = []
    for name, value in found[:limit]:
        summary, ready = _v.summary_within(value, budget=FRAME_BUDGET_S / max(1, len(found)))
        tensors.append({"name": name, "line": str(summary), "summary": summary.to_dict(),
                        "pending": not ready})
    return _dumps({"tensors": tensors, "truncated": truncated})


def _container_items(name: str, value):
    try:
        if isinstance(value, dict):
            items = list(value.items())[:CONTAINER_ITEMS]
            return [(f"{name}[{k!r}]", v) for k, v in items]
        if isinstance(value, (list, tuple)):
            return [(f"{name}[{i}]", v) for i, v in enumerate(value[:CONTAINER_ITEMS])]
    except Exception:  # noqa: BLE001 - odd containers are skipped
        pass
    return []


# -- tensor -------------------------------------------------------------------------------
@_safe
def tensor_json(value, name: str = "", dims=None, index=None, grad: bool = False,
                max_side: int = 256) -> str:
    """A 2-D slice of VALUE (or its `.grad`) for a heatmap:

    {"name", "shape", "dtype", "dims": [d_row, d_col], "index": [... null at the shown
     dims], "rows", "cols" (after downsampling), "stride": [sr, sc], "block_mean": bool,
     "data": [[float | null]] (null where the cell is NaN/Inf), "nonfinite": [[r, c,
     "nan" | "inf" | "-inf"]] (display cells, at most NONFINITE_MAX), "nonfinite_total",
     "min", "max" (finite values of the slice; null if none), "sampled" (min/max/hist of a
     strided sample of a huge slice), "summary": TensorSummary.to_dict() of the whole
     tensor (`"pending": true` while it is computed), "hist": {"counts", "range"},
     "image": null or {"width", "height", "channels", "png_base64"}}

    DIMS: which two dims are rows and columns (default the last two; negative allowed).
    INDEX: one int per dim choosing the slice (the shown dims are ignored; default 0).
    Downsampling to at most MAX_SIDE per side: block means (a block with a NaN/Inf shows
    as that) for slices up to 2^24 elements, plain strides above.
    A 1-D tensor is one row (dims [null, 0]); a 0-d tensor one cell (dims [null, null]).
    """
    import numpy as np

    try:
        s = _slicing.slice_plane(value, name, dims, index, grad, max_side)
    except _slicing.SliceError as exc:
        return _error(str(exc))
    value, shown, kinds = s["value"], s["shown"], s["kinds"]
    data = "[" + ",".join("[" + ",".join("%.6g" % x if math.isfinite(x) else "null" for x in row)
                          + "]" for row in shown.tolist()) + "]"
    bad = np.argwhere(kinds != 0)
    names = _slicing.KIND_NAMES
    nonfinite = [[int(r), int(c), names[int(kinds[r, c])]] for r, c in bad[:NONFINITE_MAX]]

    summary, ready = _v.summary_within(value, budget=0.05)
    payload = {
        "name": s["name"], "shape": s["shape"], "dtype": str(summary.dtype or value.dtype),
        "dims": s["dims"], "index": s["index"], "rows": s["rows"], "cols": s["cols"],
        "stride": s["stride"], "block_mean": s["block_mean"], "data": _DATA,
        "nonfinite": nonfinite, "nonfinite_total": int(len(bad)), "min": s["min"],
        "max": s["max"], "sampled": s["sampled"], "summary": summary.to_dict(),
        "pending": not ready, "hist": s["hist"], "image": s["image"],
    }
    text = json.dumps(_jsonable(payload), allow_nan=False, default=str, separators=(",", ":"))
    text = text.replace(json.dumps(_DATA), data, 1)
    if len(text) > MAX_BYTES:
        return _error(f"payload of {len(text)} bytes is over the {MAX_BYTES}-byte limit; "
                      f"ask for a smaller max_side (max_side={max_side})")
    return text


_DATA = "\u0000data\u0000"   # placeholder spliced with the preformatted data rows


# -- graph --------------------------------------------------------------------------------
@_safe
def graph_json(expanded=None, mark: bool = True, rows_shown: int = GRAPH_ROWS_SHOWN) -> str:
    """The graph of the last forward pass as the browser view draws it (one drawer:
    figures/graph_figure.py), a standalone Bokeh document for BokehJS in the webview:

    {"graph": null, "note": why} when no graph capture runs or no pass was seen, else
    {"graph": {"item": bokeh.embed.json_item of the figure, "note": "N module calls",
     "expanded": [open node ids], "marked": [NaN/Inf, violation, failing module ids],
     "modules": N, "bokeh": {"version", "js": [absolute paths of the BokehJS files]}}}

    EXPANDED: the node ids open (the roots are not open unless listed); MARK also opens
    the roots and the path to every marked module call, as the view does for a new pass.
    The figure's node rows are the ColumnDataSource named 'mld-graph-nodes' (column `id`),
    its toggles 'mld-graph-toggles': the webview reads clicks from their selections."""
    from ..figures import graph_rows as _rows

    graph = _rows.current_graph()
    if graph is None or not graph.modules():
        return _dumps({"graph": None, "note": _rows.graph_rows(None, set())["note"]})
    from bokeh.embed import json_item

    from ..figures.graph_figure import GraphFigure, open_marked

    opened = {str(i) for i in (expanded or ())} & set(graph.nodes)
    if mark:
        opened = open_marked(graph, opened)
    modules = graph.modules()
    rows = max(1, min(int(rows_shown), len(modules)))
    view = GraphFigure(title=f"{graph.root_type or 'graph'}: click \u25b8 to expand, a name "
                             "to show its output", height=90 + 22 * rows, rows_shown=rows,
                       css_classes=("mld-graph", "mld-panel-graph"))
    view.fig.sizing_mode = "stretch_width"
    view.add_tap()
    note = view.draw(graph, opened)
    marked = [nid for nid, n in graph.nodes.items()
              if n.kind == "module" and (n.nonfinite or n.violations or n.failing)]
    return _dumps({"graph": {"item": json_item(view.fig), "note": note,
                             "expanded": sorted(opened), "marked": marked,
                             "modules": len(modules), "bokeh": bokeh_files()}})


def bokeh_files() -> dict:
    """The BokehJS that draws graph_json's document: this bokeh's own static files (the
    JavaScript must be the version of the Python that wrote the JSON), never a CDN."""
    import bokeh
    from bokeh.resources import Resources

    js = Resources(mode="absolute", minified=True, components=["bokeh"]).js_files
    return {"version": bokeh.__version__, "js": [str(f) for f in js]}


@_safe
def node_tensor_json(node_id: str, dims=None, index=None, grad: bool = False,
                     max_side: int = 256) -> str:
    """tensor_json of a graph node's output (GRAD: its gradient, the output's .grad else
    the module's first parameter gradient, as the view shows it), named as the view
    names it ("head output", "fc.weight.grad"); an error when it is gone."""
    from ..figures import graph_rows as _rows

    with warnings.catch_warnings():     # an output's .grad: torch warns for non-leaves
        warnings.simplefilter("ignore")
        args = _rows.node_entry_args(_rows.current_graph(), str(node_id))
        if args is None:
            return _error(f"no node {node_id!r} in the graph of the last pass")
        value = args["grad"]() if grad else args["value"]
    if grad:
        name = args["grad_name"]
        if value is None:
            return _error(f"{args['name']}: no gradient yet (backward has not reached it)")
    else:
        name = args["name"]
        if value is None:
            return _error(f"{name}: {args.get('note', 'not available')}")
    return tensor_json.__wrapped__(value, name, dims, index, False, max_side)


def _jsonable(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v
