"""What the page draws, computed in Python from the engine's records (no statistics of
its own: `slicing.slice_plane`, `summary`, `graph`, `assertions`). Runs on the view's
worker thread, never on the IOLoop. Nothing here imports bokeh.
"""
from __future__ import annotations

import html
import os
from typing import Optional

from .. import slicing as _slicing

MAX_SIDE = 400          # heatmap cells per side: about the plot's size in pixels
GRAPH_ROWS_MAX = 1500   # module rows drawn in the graph (the rest is cut, with a note)
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
    import numpy as np

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
    from ..dap import variables as _v
    try:
        return str(_v.header(value)).replace(_v.PENDING_NOTE, "").strip()
    except Exception:  # noqa: BLE001
        return type(value).__name__


def stats_html(value, title: str) -> str:
    """The stats table of VALUE (its full TensorSummary), as HTML."""
    from ..summary import summary

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
                  ("module", stop.get("module")), ("at", loc), ("stage", stop.get("stage"))]
        cells = " ".join(f"<span class='mld-field'><i>{k}</i> {html.escape(str(v))}</span>"
                        for k, v in fields if v)
        parts.append(f'<div class="mld-stop mld-reason-{html.escape(str(stop.get("reason")))}">'
                     f'<b>Stop:</b> {html.escape(stop.get("message") or "")}'
                     f'<div>{cells}</div></div>')
    elif mode != "wait":
        parts.append('<div class="mld-stop mld-none">No stop yet.</div>')
    return "".join(parts)


# -- graph ---------------------------------------------------------------------------------
def current_graph():
    try:
        from .. import graph as _graph
    except Exception:  # noqa: BLE001 - no torch: no graph
        return None
    graph = _graph.last_graph()
    if graph is None:
        return None
    try:
        from .. import session as _session
        violation = _session._current.last_violation if _session._current else None  # noqa: SLF001
        if violation is not None and violation.module:
            graph.mark(violation.module, violation.kind if violation.kind != "assertion"
                       else violation.assertion)
    except Exception:  # noqa: BLE001
        pass
    return graph


def graph_rows(graph, expanded: set) -> dict:
    """Visible rows of the module tree (a child shows when its parent is expanded):
    {"rows": [{"id", "label", "depth", "has_children", "open", "status"}], "note"}.
    status: 'nonfinite' | 'violation' | 'failing' | 'ok'."""
    if graph is None:
        return {"rows": [], "note": "No forward pass seen yet (graph capture runs with the CLI)."}
    nodes = graph.nodes
    rows = []

    def walk(nid):
        if len(rows) >= GRAPH_ROWS_MAX:
            return
        n = nodes.get(nid)
        if n is None or n.kind != "module":
            return
        kids = [c for c in n.children if c in nodes and nodes[c].kind == "module"]
        is_open = nid in expanded
        status = ("failing" if n.failing else "nonfinite" if n.nonfinite
                  else "violation" if n.violations else "ok")
        shape = ""
        if n.outputs:
            s, dt = n.outputs[0]
            shape = f" [{', '.join(str(d) for d in s)}] {dt}"
        mark = ""
        if n.nonfinite:
            mark += " NaN/Inf!"
        if n.violations:
            mark += " ⚠ " + ",".join(n.violations)
        rows.append({"id": nid, "label": f"{n.path or '(root)'} ({n.type}){shape}{mark}",
                     "depth": n.depth, "has_children": bool(kids), "open": is_open,
                     "status": status})
        if is_open:
            for c in kids:
                walk(c)

    for r in graph.roots:
        walk(r)
    note = f"{len(graph.modules())} module calls"
    if len(rows) >= GRAPH_ROWS_MAX:
        note += f"; showing the first {GRAPH_ROWS_MAX} rows"
    return {"rows": rows, "note": note}


def node_entry_args(graph, node_id: str) -> Optional[dict]:
    """What the inspect list gets for a clicked node: its first output still alive, and
    as gradient that output's .grad or the module's first parameter gradient."""
    node = graph.find(node_id) if graph is not None else None
    if node is None:
        return None
    outputs = [t for t in node.output_tensors() if t is not None]
    module = node.module
    name = node.path or "(root)"

    def grad():
        if outputs and getattr(outputs[0], "grad", None) is not None:
            return outputs[0].grad
        if module is not None:
            for _, p in module.named_parameters(recurse=False):
                if p.grad is not None:
                    return p.grad
            for _, p in module.named_parameters():
                if p.grad is not None:
                    return p.grad
        return None

    grad_name = f"{name} output.grad"
    if module is not None and not (outputs and getattr(outputs[0], "grad", None) is not None):
        pname = next((n for n, p in module.named_parameters() if p.grad is not None), None)
        if pname:
            grad_name = f"{name}.{pname}.grad"
    if outputs:
        return {"value": outputs[0], "name": f"{name} output", "grad": grad,
                "grad_name": grad_name}
    return {"value": None, "name": f"{name} output", "grad": grad, "grad_name": grad_name,
            "note": "its output was freed when the pass ended (stop inside the step to see it)"}


# -- assertions ----------------------------------------------------------------------------
def assertions_html() -> str:
    try:
        from ..assertions import registry as _registry
        from ..assertions.runner import active_runner
    except Exception as exc:  # noqa: BLE001
        return f"<i>assertions unavailable: {html.escape(str(exc))}</i>"
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
