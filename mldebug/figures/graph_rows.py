"""A Graph as the rows every surface draws: the visible module calls of its tree (a child
shows when its parent is open) with shape, dtype and status, and what a click on a row
shows (its output and gradient). No bokeh here: view/data.py, the VS Code panel's JSON
(dap/panel.py) and graph_figure.py share it."""
from __future__ import annotations

from typing import Optional

from .. import graph as _graph
from ..core import session as _session

GRAPH_ROWS_MAX = 1500   # module rows drawn in the graph (the rest is cut, with a note)


def current_graph():
    graph = _graph.last_graph()
    if graph is None:
        return None
    session = _session.current_if_any()   # a look must not create a session
    if session is not None:
        graph.mark_violation(session.last_violation)
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
