"""The graph figure: the module tree of a Graph as rows (one a module call, indented by
depth, its output's shape and dtype, coloured by status: NaN/Inf, a violation, a failing
assertion), with a ▸/▾ toggle on the rows that have children. One drawer for every
surface that shows a graph: the browser view's Inspect tab (view/app.py, which wires the
clicks to its server), a notebook's inline display (mldebug/notebook, static) and the VS
Code panel (dap/panel.py's graph_json: a standalone document whose clicks the webview
reads from BokehJS's own models)."""
from __future__ import annotations

from bokeh.models import ColumnDataSource, Range1d, TapTool
from bokeh.plotting import figure

from . import graph_rows as _rows

STATUS_COLORS = {"ok": "#dee2e6", "nonfinite": "#ff6b6b", "violation": "#ffa94d",
                 "failing": "#c92a2a"}
ROW_H = 1.0
GRAPH_ROWS_SHOWN = 20   # rows in view; pan (drag) or wheel-zoom the graph for more


class GraphFigure:
    """`fig` with its node rows (`src`, name 'mld-graph-nodes') and toggles
    (`toggle_src`); draw(graph, expanded) fills them and returns the note line."""

    def __init__(self, title: str, width: int = 520, height: int = 460,
                 rows_shown: int = GRAPH_ROWS_SHOWN, css_classes=("mld-graph",)):
        self.rows_shown = rows_shown
        self.src = ColumnDataSource(data=dict(id=[], label=[], x=[], y=[], cx=[], w=[],
                                              color=[]), name="mld-graph-nodes")
        self.fig = figure(width=width, height=height, tools="ypan,ywheel_zoom,reset",
                          x_range=Range1d(0, 30), y_range=Range1d(rows_shown - 0.5, -0.5),
                          toolbar_location="above", title=title, css_classes=list(css_classes))
        self.fig.axis.visible = False
        self.fig.grid.visible = False
        self.node_renderer = self.fig.rect(x="cx", y="y", width="w", height=0.8,
                                           fill_color="color", line_color=None, source=self.src)
        self.fig.text(x="x", y="y", text="label", source=self.src,
                      text_font_size="11px", text_baseline="middle")
        self.toggle_src = ColumnDataSource(data=dict(id=[], x=[], y=[], arrow=[]),
                                           name="mld-graph-toggles")
        self.toggle_renderer = self.fig.rect(x="x", y="y", width=0.9, height=0.8,
                                             fill_alpha=0.0, line_color=None,
                                             source=self.toggle_src)
        self.fig.text(x="x", y="y", text="arrow", source=self.toggle_src,
                      text_font_size="12px", text_baseline="middle", text_align="center")

    def add_tap(self) -> None:
        """Clicks select a node or a toggle (the view's server answers them)."""
        self.fig.add_tools(TapTool(renderers=[self.node_renderer, self.toggle_renderer]))

    def draw(self, graph, expanded: set) -> str:
        rows = _rows.graph_rows(graph, expanded)
        rs = rows["rows"]
        width = [max(4.0, len(r["label"]) * 0.55) for r in rs]
        self.src.data = dict(
            id=[r["id"] for r in rs], label=[r["label"] for r in rs],
            x=[r["depth"] * 1.2 + 1.0 for r in rs], y=[i * ROW_H for i in range(len(rs))],
            cx=[r["depth"] * 1.2 + 1.0 + w / 2 - 0.1 for r, w in zip(rs, width)], w=width,
            color=[STATUS_COLORS[r["status"]] for r in rs])
        kids = [(i, r) for i, r in enumerate(rs) if r["has_children"]]
        self.toggle_src.data = dict(id=[r["id"] for _, r in kids],
                                    x=[r["depth"] * 1.2 + 0.45 for _, r in kids],
                                    y=[i * ROW_H for i, _ in kids],
                                    arrow=["▾" if r["open"] else "▸" for _, r in kids])
        self.fig.y_range.update(start=self.rows_shown - 0.5, end=-0.5)
        self.fig.x_range.update(start=0, end=max([30.0] + [r["depth"] * 1.2 + 1 + w
                                                           for r, w in zip(rs, width)]))
        return rows["note"]


def open_marked(graph, expanded: set) -> set:
    """EXPANDED with the roots and the path to every marked module call opened."""
    expanded = set(expanded) | set(graph.roots)
    for n in graph.nodes.values():
        if n.kind == "module" and (n.nonfinite or n.violations or n.failing):
            p = n.parent
            while p is not None:
                expanded.add(p)
                p = graph.nodes[p].parent if p in graph.nodes else None
    return expanded
