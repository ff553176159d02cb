"""Inline in a notebook, with the browser view's own figures, through Bokeh's notebook
output with its JavaScript inline (no CDN: offline, and in a kernel that reaches no
network):

- a Graph (what `mldebug.trace(model, x)` returns): the view's graph figure
  (figures/graph_figure.py, the one graph drawer), every module call opened;
- a recording (what `mldebug.record(...)` returns, or a run opened from its SQLite file
  with `mldebug.record.open_run`): the view's Timeline plots (view/timeline_panel.py)
  of its first parameter's series and its KPI (`loss` when logged).

Registered for the types by `%load_ext mldebug`, so neither `mldebug.graph` nor
`mldebug.record` knows of notebooks. The documents are static: no server answers
clicks, so what needs one (expand/collapse, choosing a series) stays the view's."""
from __future__ import annotations

import os

GRAPH_TYPE = ("mldebug.graph.model", "Graph")
RUN_TYPES = (("mldebug.record.store", "Run"), ("mldebug.record.recorder", "Recorder"))
ROWS_SHOWN_MAX = 20      # taller graphs scroll: drag or wheel over the figure

_bokeh_loaded = [False]


def show_graph(graph) -> None:
    """Display GRAPH in the running notebook (IPython's display hook for a Graph)."""
    from bokeh.layouts import column
    from bokeh.models import Div

    from ..figures.graph_figure import GraphFigure, open_marked

    modules = {nid for nid, n in graph.nodes.items() if n.kind == "module"}
    rows = min(ROWS_SHOWN_MAX, max(1, len(modules)))
    view = GraphFigure(title=f"{graph.root_type or 'graph'}: module calls "
                             "(drag or wheel to scroll)",
                       height=90 + 22 * rows, rows_shown=rows,
                       css_classes=("mld-graph", "mld-notebook-graph"))
    note = view.draw(graph, open_marked(graph, modules))
    _show(column(view.fig, Div(text=note)))


def show_run(run) -> None:
    """Display the timeline of RUN (a Run, or a Recorder: its store) in the notebook."""
    from bokeh.layouts import column
    from bokeh.models import Div

    from ..record.recorder import Recorder
    from ..view import data as _data
    from ..view.timeline_panel import TimelinePanel

    path = os.path.abspath(run.path)
    recorder = isinstance(run, Recorder)      # its run may still be being written
    name = run.run if recorder else run.name
    view = _data.timeline_view(path)
    steps = len(view["sides"][0]["stats"]["step"]) if view["sides"] else 0
    found = {"runs": [{"name": name or os.path.basename(path), "path": path, "status": "ok",
                       "steps": steps, "dir": os.path.dirname(path),
                       "live": recorder and not run.closed}],
             "notes": []}
    panel = TimelinePanel(None, None, Div)
    panel.fill(found, path, "", view)
    title = Div(text=f"<b>{name}</b>: series <code>{view['key']}</code>"
                     + (f", KPI <code>{view['kpi']}</code>" if view["kpi"] else "")
                     + f" ({path})")
    _show(column(title, panel.plots(), Div(text=panel.note.text)))


def _show(layout) -> None:
    from bokeh.io import output_notebook, show
    from bokeh.resources import INLINE

    if not _bokeh_loaded[0]:
        output_notebook(resources=INLINE, hide_banner=True)
        _bokeh_loaded[0] = True
    show(layout)


def register(shell) -> None:
    formatter = shell.display_formatter.ipython_display_formatter
    formatter.for_type_by_name(*GRAPH_TYPE, show_graph)
    for module, name in RUN_TYPES:
        formatter.for_type_by_name(module, name, show_run)


def unregister(shell) -> None:
    formatter = shell.display_formatter.ipython_display_formatter
    for key in (GRAPH_TYPE, *RUN_TYPES):
        try:
            formatter.pop(key)
        except (KeyError, TypeError):
            pass
