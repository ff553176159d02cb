"""The page's Timeline tab: recorded runs (`mldebug.record`) over their steps.

For a chosen run and series (module:kind): the series' histograms over steps as one
image (TorchExplorer style: x = step, y = value, colour = share of the step's samples in
that value bin), its stat lines (mean and std, abs-max on a log axis, NaN/Inf counts),
and a KPI curve (`mldebug.log_scalar`). "Compare with" draws a second run beside it: its
own histogram image, and its lines over the first run's in another colour. "Log scale"
colours the histograms by the log of the share (rare values, e.g. the first outliers
before an overflow, stay visible next to the bulk) and draws the KPI on a log axis.

Which runs: those in the running recording's run_dir and in the directories given to
`mldebug.view(runs=...)` (`data.run_dirs()`). The store is read on the view's worker
thread, when the tab is shown, at every pause of the program while it is shown (else at
the next showing), and on Refresh; results come back with `doc.add_next_tick_callback`.
Sections read data / plots / widgets / callbacks, as in app.py.
"""
from __future__ import annotations

import html

from bokeh.layouts import column, row
import numpy as np
from bokeh.models import (Button, CheckboxGroup, ColumnDataSource, HoverTool,
                          LinearColorMapper, LogColorMapper, Range1d, Select)
from bokeh.palettes import Viridis256
from bokeh.plotting import figure

from ..core.ranks import rank_tag
from . import data as _data
from .doc_thread import on_doc_thread

COLORS = ("#1c7ed6", "#e8590c")          # run A, run B
NO_RUN = ""                              # "Compare with: (none)"
NO_RUNS_NOTE = ("No recorded runs yet: record with <code>mldebug.record(model, "
                "run_dir=DIR)</code> in the program, or list a directory with "
                "<code>mldebug.view(runs=DIR)</code>.")


def _empty_stats():
    return dict(step=[], mean=[], std=[], abs_max=[], nonfinite=[])


class TimelinePanel:
    """The widgets of the Timeline tab of one page (document) and their callbacks."""

    def __init__(self, doc, server, Div):  # noqa: N803 - the page's Div factory
        self.doc = doc
        self.server = server
        self.shown = False        # the tab is the active one
        self.stale = True         # the store may have changed since the last read
        self.serial = 0           # newest read; older results are dropped
        self._setting = False     # widget values set from Python: no new read
        self._build(Div)

    # -- data / plots / widgets ------------------------------------------------------
    def _build(self, Div):  # noqa: N803
        self.run_a = Select(title="Run", options=[], value="", width=270,
                            name="mld-tl-run", css_classes=["mld-tl-run"])
        self.run_b = Select(title="Compare with", options=[(NO_RUN, "(none)")], value=NO_RUN,
                            width=270, name="mld-tl-other", css_classes=["mld-tl-other"])
        self.series = Select(title="Series (module:kind)", options=[], value="", width=270,
                             name="mld-tl-series", css_classes=["mld-tl-series"])
        self.kpi = Select(title="KPI (mldebug.log_scalar)", options=[], value="", width=270,
                          name="mld-tl-kpi", css_classes=["mld-tl-kpi"])
        self.refresh_btn = Button(label="Refresh", width=110, css_classes=["mld-tl-refresh"])
        self.log = CheckboxGroup(labels=["log scale (histogram colours, KPI)"], active=[],
                                 name="mld-tl-log", css_classes=["mld-tl-log"])
        self.note = Div(text=NO_RUNS_NOTE, width=270, css_classes=["mld-tl-note"])

        self.hist_src, self.hist_fig, self.mappers, self.log_mappers = [], [], [], []
        self.hist_glyphs = []
        for i, ab in enumerate("ab"):
            src = ColumnDataSource(data=dict(image=[], x=[], y=[], dw=[], dh=[]),
                                   name=f"mld-tl-hist-{ab}")
            mapper = LinearColorMapper(palette=Viridis256, low=0, high=1,
                                       nan_color=(0, 0, 0, 0))
            self.log_mappers.append(LogColorMapper(palette=Viridis256, low=1e-4, high=1,
                                                   nan_color=(0, 0, 0, 0)))
            fig = figure(width=470, height=300, tools="pan,wheel_zoom,box_zoom,reset",
                         x_range=Range1d(0, 1), y_range=Range1d(0, 1),
                         toolbar_location="above", x_axis_label="step", y_axis_label="value",
                         title="histogram over steps", css_classes=[f"mld-tl-hist-{ab}"],
                         visible=i == 0)
            fig.grid.visible = False
            r = fig.image(image="image", x="x", y="y", dw="dw", dh="dh", source=src,
                          color_mapper=mapper, name=f"mld-tl-image-{ab}")
            self.hist_glyphs.append(r.glyph)
            fig.add_tools(HoverTool(renderers=[r], tooltips=[
                ("step", "$x{0}"), ("value", "$y{%.4g}"), ("share", "@image{0.000}")],
                formatters={"$y": "printf"}))
            self.hist_src.append(src)
            self.hist_fig.append(fig)
            self.mappers.append(mapper)

        self.stats_src = [ColumnDataSource(data=_empty_stats(), name=f"mld-tl-stats-{ab}")
                          for ab in "ab"]
        self.kpi_src = [ColumnDataSource(data=dict(step=[], value=[]), name=f"mld-tl-kpi-{ab}")
                        for ab in "ab"]
        small = dict(width=315, height=220, tools="pan,wheel_zoom,box_zoom,reset",
                     toolbar_location="above", x_axis_label="step")
        self.mean_fig = figure(title="mean (line), std (dashed)", css_classes=["mld-tl-mean"],
                               **small)
        self.absmax_fig = figure(title="abs-max", y_axis_type="log",
                                 x_range=self.mean_fig.x_range, css_classes=["mld-tl-absmax"],
                                 **small)
        self.nonfinite_fig = figure(title="NaN + Inf count", x_range=self.mean_fig.x_range,
                                    css_classes=["mld-tl-nonfinite"], **small)
        # the KPI on a linear and on a log axis: two figures, one shown (a Bokeh figure's
        # axis type is fixed once it is drawn)
        self.kpi_fig = figure(width=955, height=220, title="KPI", x_axis_label="step",
                              tools="pan,wheel_zoom,box_zoom,reset", toolbar_location="above",
                              css_classes=["mld-tl-kpi-fig"])
        self.kpi_log_fig = figure(width=955, height=220, title="KPI (log axis)",
                                  x_axis_label="step", y_axis_type="log",
                                  x_range=self.kpi_fig.x_range, visible=False,
                                  tools="pan,wheel_zoom,box_zoom,reset",
                                  toolbar_location="above", name="mld-tl-kpi-log",
                                  css_classes=["mld-tl-kpi-log"])
        for i, color in enumerate(COLORS):
            s = self.stats_src[i]
            self.mean_fig.line("step", "mean", source=s, color=color, line_width=2)
            self.mean_fig.line("step", "std", source=s, color=color, line_dash="dashed")
            self.absmax_fig.line("step", "abs_max", source=s, color=color, line_width=2)
            self.nonfinite_fig.line("step", "nonfinite", source=s, color=color, line_width=2)
            for fig, col in ((self.mean_fig, "mean"), (self.absmax_fig, "abs_max"),
                             (self.nonfinite_fig, "nonfinite")):
                fig.scatter("step", col, source=s, color=color, size=4)
            for fig in (self.kpi_fig, self.kpi_log_fig):
                fig.line("step", "value", source=self.kpi_src[i], color=color, line_width=2)
        for fig, col in ((self.mean_fig, "mean"), (self.absmax_fig, "abs_max"),
                         (self.nonfinite_fig, "nonfinite")):
            fig.add_tools(HoverTool(tooltips=[("step", "@step"), (col, f"@{col}{{%.4g}}")],
                                    formatters={f"@{col}": "printf"}))
        for fig in (self.kpi_fig, self.kpi_log_fig):
            fig.add_tools(HoverTool(tooltips=[("step", "@step"), ("value", "@value{%.5g}")],
                                    formatters={"@value": "printf"}, mode="vline"))

        # -- callbacks ---------------------------------------------------------------
        for widget in (self.run_a, self.run_b, self.series, self.kpi):
            widget.on_change("value", self._on_choice)
        self.refresh_btn.on_click(self._on_refresh)
        self.log.on_change("active", self._on_log)

        # -- layout ------------------------------------------------------------------
        controls = column(self.run_a, self.run_b, self.series, self.kpi, self.log,
                          self.refresh_btn, self.note)
        self.layout = row(controls, column(row(*self.hist_fig),
                                           row(self.mean_fig, self.absmax_fig, self.nonfinite_fig),
                                           self.kpi_fig, self.kpi_log_fig))

    # -- a static document (a notebook's inline display) -------------------------------
    def fill(self, found: dict, a: str, b: str, view: dict) -> None:
        """Draw VIEW (`data.timeline_view` of run A, and B beside it) at once, on the
        caller's thread: for a document no server serves (mldebug/notebook)."""
        self.serial += 1
        self.stale = False
        self._show(self.serial, found, a, b, view)

    def plots(self):
        """The figures without the controls (a static document has no server to answer
        them): the histogram image(s), the stat lines and the KPI."""
        return column(row(*self.hist_fig),
                      row(self.mean_fig, self.absmax_fig, self.nonfinite_fig),
                      self.kpi_fig, self.kpi_log_fig)

    # -- the page -> the panel ---------------------------------------------------------
    def show(self, shown: bool) -> None:
        """The tab became the active one (True) or another did (False)."""
        self.shown = shown
        if shown and self.stale:
            self.load()

    def paused(self) -> None:
        """The program paused: re-read now when shown, else at the next showing."""
        self.stale = True
        if self.shown:
            self.load()

    # -- callbacks ---------------------------------------------------------------------
    def _on_choice(self, attr, old, new):
        if not self._setting:
            self.load()

    def _on_refresh(self):
        self.load()

    def _on_log(self, attr, old, new):
        """Switch the histogram colours and the KPI axis (no new read: same data)."""
        on = bool(new)
        for glyph, linear, log in zip(self.hist_glyphs, self.mappers, self.log_mappers):
            glyph.color_mapper = log if on else linear
        self.kpi_fig.visible = not on
        self.kpi_log_fig.visible = on

    # -- reading the store (worker thread) ------------------------------------------------
    def load(self) -> None:
        self.stale = False
        self.serial += 1
        serial = self.serial
        want = (self.run_a.value, self.run_b.value, self.series.value, self.kpi.value)
        self.note.text = "<i>reading the runs…</i>"

        def job():
            if serial != self.serial:
                return
            try:
                found = _data.known_runs()
                paths = [r["path"] for r in found["runs"]]
                a, b, key, kpi = want
                if a not in paths:      # the run being recorded, else the first one
                    a = next((r["path"] for r in found["runs"] if r["live"]),
                             paths[0] if paths else "")
                if b not in paths or b == a:
                    b = NO_RUN
                view = _data.timeline_view(a, b or None, key, kpi) if a else None
            except Exception as exc:  # noqa: BLE001 - a bad store is a note on the page
                self._later(self._show_error, serial, f"{type(exc).__name__}: {exc}")
                return
            self._later(self._show, serial, found, a, b, view)
        self.server.submit(job)

    def _later(self, fn, *args):
        on_doc_thread(self.doc, fn, *args)

    # -- drawing (IOLoop, from the worker's results) -------------------------------------
    def _show_error(self, serial, text):
        if serial == self.serial:
            self.note.text = f"<b class='bad'>{html.escape(text)}</b>"

    def _show(self, serial, found, a, b, view):
        if serial != self.serial:
            return
        runs = found["runs"]
        several = len({r["dir"] for r in runs}) > 1
        options = [(r["path"], _data.run_label(r, several)) for r in runs]
        names = {r["path"]: f"{rank_tag(r.get('rank'))}{r['name']}" for r in runs}
        self._setting = True
        try:
            self.run_a.options = options
            self.run_a.value = a
            self.run_b.options = [(NO_RUN, "(none)")] + [o for o in options if o[0] != a]
            self.run_b.value = b
            self.series.options = view["series"] if view else []
            self.series.value = view["key"] if view else ""
            self.kpi.options = view["kpis"] if view else []
            self.kpi.value = view["kpi"] if view else ""
        finally:
            self._setting = False
        sides = view["sides"] if view else []
        for i in range(2):
            self._draw_side(i, sides[i] if i < len(sides) else None)
        self.hist_fig[1].visible = len(sides) > 1
        self.kpi_fig.title.text = f"KPI: {view['kpi']}" if view and view["kpi"] else \
            "KPI (none logged: mldebug.log_scalar)"
        self.kpi_log_fig.title.text = self.kpi_fig.title.text + " (log axis: values <= 0 " \
            "are not drawn)"
        notes = list(found["notes"])
        if not runs:
            text = NO_RUNS_NOTE
        else:
            legend = " ".join(f"<span style='color:{COLORS[i]}'>━ <b>{html.escape(names.get(p, ''))}</b></span>"
                              for i, p in enumerate([a, b]) if p)
            text = legend
            notes += [s["note"] for s in sides if s["note"]]
        dirs = _data.run_dirs()
        text += "".join(f"<div class='mld-note'>{html.escape(n)}</div>" for n in notes)
        text += ("<div class='mld-note'>runs from: " + html.escape(", ".join(dirs)) + "</div>"
                 if dirs else "")
        self.note.text = text

    def _draw_side(self, i, side):
        fig, src = self.hist_fig[i], self.hist_src[i]
        if side is None:
            src.data = dict(image=[], x=[], y=[], dw=[], dh=[])
            self.stats_src[i].data = _empty_stats()
            self.kpi_src[i].data = dict(step=[], value=[])
            return
        image = side["image"]
        if image is not None:
            high = max(image["high"], 1e-9)
            self.mappers[i].update(low=0, high=high)
            shares = image["image"]
            low = float(np.nanmin(shares)) if np.isfinite(shares).any() else high / 1e4
            self.log_mappers[i].update(low=min(max(low, 1e-9), high / 2), high=high)
            fig.x_range.update(start=image["x"], end=image["x"] + image["dw"])
            fig.y_range.update(start=image["y"], end=image["y"] + image["dh"])
            src.data = dict(image=[image["image"]], x=[image["x"]], y=[image["y"]],
                            dw=[image["dw"]], dh=[image["dh"]])
        else:
            src.data = dict(image=[], x=[], y=[], dw=[], dh=[])
        fig.title.text = f"{side['name']}: {self.series.value}"
        self.stats_src[i].data = dict(side["stats"])
        self.kpi_src[i].data = dict(side["kpi"])
