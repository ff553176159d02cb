"""A Graph (what `mldebug.trace(model, x)` returns) shown inline: the browser view's
graph figure (view/graph_figure.py, the one graph drawer), every module call opened,
through Bokeh's notebook output with its JavaScript inline (no CDN: offline, and in a
kernel that reaches no network). Registered for the type by `%load_ext mldebug`, so
`mldebug.graph` knows nothing of notebooks."""
from __future__ import annotations

GRAPH_TYPE = ("mldebug.graph.model", "Graph")
ROWS_SHOWN_MAX = 20      # taller graphs scroll: drag or wheel over the figure

_bokeh_loaded = [False]


def show_graph(graph) -> None:
    """Display GRAPH in the running notebook (IPython's display hook for a Graph)."""
    from bokeh.io import output_notebook, show
    from bokeh.layouts import column
    from bokeh.models import Div
    from bokeh.resources import INLINE

    from ..view.graph_figure import GraphFigure, open_marked

    modules = {nid for nid, n in graph.nodes.items() if n.kind == "module"}
    rows = min(ROWS_SHOWN_MAX, max(1, len(modules)))
    view = GraphFigure(title=f"{graph.root_type or 'graph'}: module calls "
                             "(drag or wheel to scroll)",
                       height=90 + 22 * rows, rows_shown=rows,
                       css_classes=("mld-graph", "mld-notebook-graph"))
    note = view.draw(graph, open_marked(graph, modules))
    if not _bokeh_loaded[0]:
        output_notebook(resources=INLINE, hide_banner=True)
        _bokeh_loaded[0] = True
    show(column(view.fig, Div(text=note)))


def register(shell) -> None:
    shell.display_formatter.ipython_display_formatter.for_type_by_name(*GRAPH_TYPE, show_graph)


def unregister(shell) -> None:
    try:
        shell.display_formatter.ipython_display_formatter.pop(GRAPH_TYPE)
    except (KeyError, TypeError):
        pass
