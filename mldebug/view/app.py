"""The page: one Bokeh document per open browser tab. Its Inspect tab is here; its
Timeline tab (recorded runs) is timeline_panel.py.

Sections read data / plots / widgets / callbacks / layout. Every change from the program
arrives through the hub's listener and is applied with `doc.add_next_tick_callback`; the
heavy work (slices, summaries, the graph) runs on the server's worker thread, whose
results come back the same way. The page sends only widget values and button clicks.
"""
from __future__ import annotations

import html
from functools import partial

from bokeh.layouts import column, row
from bokeh.models import (Button, ColorBar, ColumnDataSource, CustomJSHover,
                          HoverTool, InlineStyleSheet, LinearColorMapper, RadioButtonGroup, Range1d, Select,
                          Slider, TabPanel, Tabs)
from bokeh.models import Div as _Div
from bokeh.palettes import Viridis256
from bokeh.plotting import figure

from ..core.ranks import this_rank
from ..summaries import slicing as _slicing
from . import data as _data
from . import state as _state
from .doc_thread import on_doc_thread
from ..figures.graph_figure import GraphFigure, open_marked
from .timeline_panel import TimelinePanel

NAN_COLOR, POSINF_COLOR, NEGINF_COLOR = (_slicing.KIND_COLORS[k] for k in (1, 2, 3))

CSS = """
.mld-state{font-size:14px;margin:2px 0}
.mld-stop{font-size:14px;padding:6px 8px;border-radius:4px;background:#f1f3f5;margin:4px 0}
.mld-reason-nan,.mld-reason-inf{background:#ffe3e3}
.mld-reason-assertion{background:#fff4e6}
.mld-hint{margin:4px 0;padding:4px 6px;background:#fff9db;border-left:3px solid #f59f00}
.mld-field{margin-right:14px}.mld-field i{color:#868e96;margin-right:4px}
.mld-stats table{border-collapse:collapse;font-size:13px}
.mld-stats th{text-align:left;padding:1px 10px 1px 0;color:#495057;font-weight:normal}
.mld-stats tr.bad td{color:#c92a2a;font-weight:bold}
li.bad{color:#c92a2a}
.mld-note{color:#868e96}
.bad{color:#c92a2a}
"""


class Page:
    """The widgets of one document and their callbacks."""

    def __init__(self, doc, server):
        self.doc = doc
        self.server = server
        self.hub = _state.hub()
        self.entry = None          # the Entry shown in the tensor panel
        self.dims = None           # [row dim, col dim] of the shown slice
        self.index = None          # full index (one int per dim)
        self.show_grad = False
        self.serial = 0            # newest tensor request; older results are dropped
        self.stats_serial = -1     # request whose full stats are shown
        self.expanded: set = set()
        self.graph = None
        self.last_pause = -1
        self.known_keys: set = set()
        self._build()

    # -- data / plots / widgets ------------------------------------------------------
    def _build(self):
        sheet = InlineStyleSheet(css=CSS)   # a Div lives in its own shadow root

        def Div(**kwargs):  # noqa: N802 - every Div of the page gets the sheet
            return _Div(stylesheets=[sheet], **kwargs)

        self.banner = Div(text="", width=1100, css_classes=["mld-banner"])
        self.continue_btn = Button(label="Continue", button_type="success", width=110,
                                   disabled=True, css_classes=["mld-continue"])
        self.step_btn = Button(label="Step over", button_type="primary", width=110,
                               disabled=True, css_classes=["mld-step"])
        self.control_note = Div(text="", width=600, css_classes=["mld-control-note"])

        self.entries = Select(title="Inspect list", options=[], value="", width=260,
                              css_classes=["mld-entries"])
        self.which = RadioButtonGroup(labels=["value", "gradient"], active=0,
                                      css_classes=["mld-which"])
        self.row_dim = Select(title="rows: dim", options=[], value="", width=125,
                              css_classes=["mld-rowdim"])
        self.col_dim = Select(title="columns: dim", options=[], value="", width=125,
                              css_classes=["mld-coldim"])
        self.sliders = column(Div(text=""), width=260)
        self.tensor_title = Div(text="<i>Nothing inspected yet: <code>inspect x</code> at "
                                "the prompt or <code>mldebug.inspect(x)</code>.</i>",
                                width=700, css_classes=["mld-tensor-title"])

        self.heat_src = ColumnDataSource(data=dict(image=[], x=[], y=[], dw=[], dh=[]))
        self.meta = ColumnDataSource(data=dict(template=["[{r}, {c}]"], block=[""]))
        self.mapper = LinearColorMapper(palette=Viridis256, low=0, high=1,
                                        nan_color=NAN_COLOR, high_color=POSINF_COLOR,
                                        low_color=NEGINF_COLOR)
        self.heat = figure(width=560, height=460, tools="pan,wheel_zoom,box_zoom,reset,save",
                           x_range=Range1d(0, 1), y_range=Range1d(1, 0),
                           toolbar_location="above", css_classes=["mld-heatmap"],
                           x_axis_label="column", y_axis_label="row")
        self.heat.grid.visible = False
        heat_r = self.heat.image(image="image", x="x", y="y", dw="dw", dh="dh",
                                 source=self.heat_src, color_mapper=self.mapper)
        index_fmt = CustomJSHover(args=dict(meta=self.meta), code="""
            const r = Math.floor(special_vars.y), c = Math.floor(special_vars.x);
            return meta.data.template[0].replace('{r}', r).replace('{c}', c) + meta.data.block[0];
        """)
        value_fmt = CustomJSHover(code="""
            if (Number.isNaN(value)) return 'NaN';
            if (value === Infinity) return '+Inf';
            if (value === -Infinity) return '-Inf';
            return Number(value).toPrecision(6);
        """)
        self.heat.add_tools(HoverTool(renderers=[heat_r], tooltips=[
            ("index", "$x{custom}"), ("value", "@image{custom}")],
            formatters={"$x": index_fmt, "@image": value_fmt}))
        self.heat.add_layout(ColorBar(color_mapper=self.mapper, width=12), "right")
        self.image_div = Div(text="", width=300, css_classes=["mld-image"])

        self.hist_src = ColumnDataSource(data=dict(left=[], right=[], top=[]))
        self.hist = figure(width=360, height=200, tools="", toolbar_location=None,
                           title="histogram of the slice (finite values)",
                           css_classes=["mld-hist"])
        self.hist.quad(left="left", right="right", top="top", bottom=0, source=self.hist_src,
                       fill_color="#4c6ef5", line_color="#364fc7")
        self.stats = Div(text="", width=360, css_classes=["mld-stats-div"])

        self.graph_view = GraphFigure("graph of the last step (click ▸ to expand, a name "
                                      "to show its output)")
        self.graph_view.add_tap()
        self.graph_src, self.toggle_src = self.graph_view.src, self.graph_view.toggle_src
        self.graph_fig = self.graph_view.fig
        self.graph_note = Div(text="", width=520, css_classes=["mld-graph-note"])
        self.assertions = Div(text="", width=560, css_classes=["mld-assertions-div"])
        self.timeline = TimelinePanel(self.doc, self.server, Div)

        # -- callbacks ---------------------------------------------------------------
        self.continue_btn.on_click(partial(self._press, "continue"))
        self.step_btn.on_click(partial(self._press, "step"))
        self.entries.on_change("value", self._on_entry)
        self.which.on_change("active", self._on_which)
        self.row_dim.on_change("value", self._on_dims)
        self.col_dim.on_change("value", self._on_dims)
        self.graph_src.selected.on_change("indices", self._on_node)
        self.toggle_src.selected.on_change("indices", self._on_toggle)

        # -- layout ------------------------------------------------------------------
        controls = row(self.continue_btn, self.step_btn, self.control_note)
        tensor_side = column(self.entries, self.which, row(self.row_dim, self.col_dim),
                             self.sliders, self.image_div)
        tensor = column(self.tensor_title, row(tensor_side, self.heat,
                                               column(self.hist, self.stats)))
        lower = row(column(self.graph_fig, self.graph_note),
                    column(Div(text="<h3>Assertions</h3>"), self.assertions))
        self.tabs = Tabs(tabs=[TabPanel(child=column(tensor, lower), title="Inspect"),
                               TabPanel(child=self.timeline.layout, title="Timeline")],
                         name="mld-tabs", css_classes=["mld-tabs"])
        self.tabs.on_change("active", self._on_tab)
        self.doc.add_root(column(Div(text="<h2>mldebug</h2>"), self.banner, controls,
                                 self.tabs))
        rank = this_rank()       # which rank of a multi-process job this page shows
        self.doc.title = "mldebug view" + (f" [rank {rank.rank}]" if rank is not None else "")

    # -- program -> page ----------------------------------------------------------------
    def attach(self):
        self.hub.listen(self._hub_changed)
        self.doc.on_session_destroyed(lambda ctx: self.hub.unlisten(self._hub_changed))
        self._refresh()

    def _hub_changed(self, what):
        try:
            self.doc.add_next_tick_callback(self._refresh)
        except Exception:  # noqa: BLE001 - the page went away
            self.hub.unlisten(self._hub_changed)

    def _refresh(self):
        snap = self.hub.snapshot()
        self.banner.text = _data.banner_html(snap)
        mode = snap["mode"]
        self.continue_btn.disabled = mode not in ("prompt", "wait")
        self.step_btn.disabled = mode != "prompt"
        self.control_note.text = {
            "prompt": "Continue and Step over act as <code>c</code> and <code>n</code> typed at the prompt.",
            "wait": "Continue releases <code>mldebug.inspect(..., wait=True)</code>.",
        }.get(mode, "<i>The program is running: the buttons wait for the next pause.</i>")
        options = [(str(k), label) for k, label in snap["entries"]]
        new = [k for k, _ in options if k not in self.known_keys]
        self.known_keys = {k for k, _ in options}
        self.entries.options = options
        if new:        # the newest inspected value is shown
            self.entries.value = new[-1]
        elif self.entries.value not in self.known_keys:
            self.entries.value = options[-1][0] if options else ""
        if snap["pause_serial"] != self.last_pause:
            self.last_pause = snap["pause_serial"]
            self._load_graph()
            self.timeline.paused()
            if self.entry is not None:
                self._request_tensor()   # the values may have changed since

    # -- callbacks ---------------------------------------------------------------------
    def _press(self, action):
        self.control_note.text = html.escape(self.hub.press(action))

    def _on_tab(self, attr, old, new):
        self.timeline.show(new == 1)

    def _on_entry(self, attr, old, new):
        entry = self.hub.get(new)
        if entry is None:
            return
        self.entry, self.dims, self.index = entry, None, None
        self._request_tensor()

    def _on_which(self, attr, old, new):
        self.show_grad = new == 1
        self.dims, self.index = None, None
        self._request_tensor()

    def _on_dims(self, attr, old, new):
        if self.dims is None or not self.row_dim.value or not self.col_dim.value:
            return
        dims = [int(self.row_dim.value), int(self.col_dim.value)]
        if dims == self.dims:
            return
        if dims[0] == dims[1]:
            self.tensor_title.text += " <b>(choose two different dims)</b>"
            return
        self.dims = dims
        self._request_tensor()

    def _on_index(self, dim, attr, old, new):
        if self.index is None or self.index[dim] == int(new):
            return
        self.index[dim] = int(new)
        self._request_tensor()

    def _on_node(self, attr, old, new):
        if not new:
            return
        nid = self.graph_src.data["id"][new[0]]
        graph = self.graph
        self.graph_src.selected.indices = []

        def job():
            args = _data.node_entry_args(graph, nid)
            if args is not None:
                self.hub.add(source="graph", **args)   # the refresh selects it
        self.server.submit(job)

    def _on_toggle(self, attr, old, new):
        if not new:
            return
        nid = self.toggle_src.data["id"][new[0]]
        self.toggle_src.selected.indices = []
        self.expanded ^= {nid}
        self._draw_graph()

    # -- the tensor panel --------------------------------------------------------------
    def _request_tensor(self):
        entry = self.entry
        if entry is None:
            return
        self.serial += 1
        serial, dims, index, want_grad = self.serial, self.dims, self.index, self.show_grad

        def job():
            if self.serial != serial:
                return      # superseded by a newer request
            if want_grad:
                value, name = entry.grad()
                if value is None:
                    self._later(self._show_error, serial, f"{html.escape(name)}: no gradient "
                                "(backward has not run, or it is not retained)")
                    return
            else:
                value, name = entry.value, entry.name
            if value is None:
                self._later(self._show_error, serial,
                            f"{html.escape(entry.name)}: {html.escape(entry.note or 'no value')}")
                return
            if not _slicing.is_tensor(value):
                self._later(self._show_error, serial,
                            f"{html.escape(name)} is a {html.escape(type(value).__name__)}, "
                            "not a tensor or array: <code>inspect</code> at the prompt describes it")
                return
            try:
                view = _data.tensor_view(value, name, dims, index)
            except _slicing.SliceError as exc:
                self._later(self._show_error, serial, html.escape(str(exc)))
                return
            view["header"] = _data.header(value)
            self._later(self._show_tensor, serial, view)
            stats = _data.stats_html(value, name)      # the full pass, after the heatmap
            self._later(self._show_stats, serial, stats)
        self.server.submit(job)

    def _later(self, fn, *args):
        on_doc_thread(self.doc, fn, *args)

    def _show_error(self, serial, text):
        if serial != self.serial:
            return
        self.tensor_title.text = f"<b class='bad'>{text}</b>"
        self.heat_src.data = dict(image=[], x=[], y=[], dw=[], dh=[])
        self.hist_src.data = dict(left=[], right=[], top=[])
        self.stats.text = ""
        self.image_div.text = ""

    def _show_tensor(self, serial, v):
        if serial != self.serial:
            return
        shape = v["shape"]
        ndim = len(shape)
        first = self.dims is None
        self.dims = list(v["dims"]) if ndim >= 2 else None
        self.index = list(v["full_index"])
        sr, sc = v["stride"]
        rows_in, cols_in = v["rows_in"], v["cols_in"]
        down = (f" shown as {v['rows']}×{v['cols']} "
                f"({'block means' if v['block_mean'] else 'every'} {sr}×{sc})") if sr > 1 or sc > 1 else ""
        self.tensor_title.text = (f"<b class='mld-tensor-name'>{html.escape(v['name'])}</b> "
                                  f"<code>{html.escape(v['header'])}</code> slice "
                                  f"<code>{html.escape(v['template'].replace('{r}', ':').replace('{c}', ':'))}</code>"
                                  f"{html.escape(down)}")
        self.meta.data = dict(template=[v["template"]],
                              block=[f" (block {sr}×{sc})" if sr > 1 or sc > 1 else ""])
        self.mapper.update(low=v["low"], high=v["high"])
        self.heat.x_range.update(start=0, end=cols_in)
        self.heat.y_range.update(start=rows_in, end=0)
        self.heat_src.data = dict(image=[v["display"]], x=[0], y=[0], dw=[cols_in],
                                  dh=[rows_in])
        hist = v["hist"]
        if hist["counts"]:
            lo, hi = hist["range"]
            n = len(hist["counts"])
            width = (hi - lo) / n
            self.hist_src.data = dict(left=[lo + i * width for i in range(n)],
                                      right=[lo + (i + 1) * width for i in range(n)],
                                      top=hist["counts"])
        else:
            self.hist_src.data = dict(left=[], right=[], top=[])
        img = v["image"]
        if img:
            scale = max(1, 256 // max(img["width"], img["height"]))
            self.image_div.text = (f"<div>image view{' (batch ' + str(self.index[0]) + ')' if ndim == 4 else ''}</div>"
                                   f"<img class='mld-img' alt='image view' "
                                   f"width='{img['width'] * scale}' height='{img['height'] * scale}' "
                                   f"style='image-rendering:pixelated' "
                                   f"src='data:image/png;base64,{img['png_base64']}'>")
        else:
            self.image_div.text = ""
        if self.stats_serial != serial:
            # (Bokeh may run the job's next-tick callbacks out of order: stats that came
            # first must not be overwritten)
            self.stats.text = "<i>stats: computing…</i>"
        if first or ndim != len(self.row_dim.options):
            self._build_dim_controls(shape)

    def _build_dim_controls(self, shape):
        ndim = len(shape)
        opts = [(str(i), f"{i} (size {s})") for i, s in enumerate(shape)]
        self.row_dim.options = opts if ndim >= 2 else []
        self.col_dim.options = opts if ndim >= 2 else []
        if ndim >= 2:
            self.row_dim.value, self.col_dim.value = str(self.dims[0]), str(self.dims[1])
        sliders = []
        for d in range(ndim):
            if self.dims is not None and d in self.dims or shape[d] <= 1 or ndim < 2:
                continue
            title = f"dim {d} index" + (" (batch)" if d == 0 and ndim >= 3 else "")
            s = Slider(start=0, end=shape[d] - 1, step=1, value=self.index[d], title=title,
                       width=250, css_classes=[f"mld-slider-{d}"])
            s.on_change("value_throttled", partial(self._on_index, d))
            sliders.append(s)
        self.sliders.children = sliders or [_Div(text="")]

    def _show_stats(self, serial, text):
        if serial == self.serial:
            self.stats_serial = serial
            self.stats.text = text

    # -- graph and assertions ------------------------------------------------------------
    def _load_graph(self):
        def job():
            graph = _data.current_graph()
            text = _data.assertions_html()
            self._later(self._set_graph, graph, text)
        self.server.submit(job)

    def _set_graph(self, graph, assertions_text):
        if graph is not self.graph and graph is not None:
            # open the root and the path to anything marked
            self.expanded = open_marked(graph, self.expanded)
        self.graph = graph
        self.assertions.text = assertions_text
        self._draw_graph()

    def _draw_graph(self):
        self.graph_note.text = html.escape(self.graph_view.draw(self.graph, self.expanded))


def make_doc(doc, server):
    Page(doc, server).attach()
