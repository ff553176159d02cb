"""A `TensorSummary` as HTML, for Jupyter's rich display (`TensorSummary._repr_html_`):
the one-line summary, a small histogram of the finite values with the NaN/Inf counts in
their colours, and for a 2-D to 4-D tensor or array a thumbnail heatmap (the plane the
view and the VS Code panel show, `slicing.slice_plane`: the last two dims at index 0 of
the others, downsampled to THUMB_SIDE cells a side) with NaN/+Inf/-Inf cells in their
colours, beside the picture itself for an image (C, H, W) or a batch of them with C 1
or 3. Self-contained: inline SVG and PNG data URLs, no script, nothing fetched.

The pictures need the values: `summary(x)` keeps a weak reference to X and the version
it summarised (compute.py); when X is gone or was changed in place since, the HTML
leaves them out rather than draw values the line does not describe.
"""
from __future__ import annotations

import base64
import html
import math

from .slicing import KIND_COLORS, _png, slice_plane

THUMB_SIDE = 48        # cells per side of the heatmap thumbnail, at most
THUMB_PX = 144         # its longer side on the page, in pixels
HIST_W, HIST_H = 180, 44
FINITE_COLOR = "#4263eb"


def summary_html(s, source, format_number) -> str:
    """The HTML of summary S (its module, tensor_summary.py, passes its FORMAT_NUMBER);
    SOURCE is the live value for the heatmap (None: none)."""
    parts = [f"<code>{html.escape(str(s))}</code>"]
    pictures = []
    if s.hist and s.hist_range:
        pictures.append(_hist_svg(s, format_number))
    if source is not None:
        heat = _heatmap(source)
        if heat:
            pictures.append(heat)
    counts = _nonfinite_legend(s)
    if counts:
        pictures.append(counts)
    if pictures:
        parts.append('<div style="display:flex;gap:14px;align-items:flex-end;margin-top:4px">'
                     + "".join(pictures) + "</div>")
    return '<div class="mldebug-summary">' + "".join(parts) + "</div>"


def _hist_svg(s, format_number) -> str:
    counts = list(s.hist)
    top = max(counts) or 1
    width = HIST_W / len(counts)
    bars = []
    for i, c in enumerate(counts):
        h = 0 if c == 0 else max(1.0, (HIST_H - 2) * c / top)
        bars.append(f'<rect x="{i * width:.1f}" y="{HIST_H - h:.1f}" width="{max(width - 1, 1):.1f}" '
                    f'height="{h:.1f}" fill="{FINITE_COLOR}"><title>{c}</title></rect>')
    lo, hi = s.hist_range
    sampled = " (sample)" if s.hist_sampled else ""
    label = (f'<div style="display:flex;justify-content:space-between;width:{HIST_W}px;'
             f'font-size:10px;color:#868e96"><span>{html.escape(format_number(lo, s.integer))}</span>'
             f'<span>finite values{sampled}</span>'
             f'<span>{html.escape(format_number(hi, s.integer))}</span></div>')
    return (f'<div class="mldebug-hist"><svg width="{HIST_W}" height="{HIST_H}" '
            f'xmlns="http://www.w3.org/2000/svg">{"".join(bars)}</svg>{label}</div>')


def _nonfinite_legend(s) -> str:
    items = [(n, name, KIND_COLORS[code]) for n, name, code in
             ((s.nan, "NaN", 1), (s.posinf, "+Inf", 2), (s.neginf, "-Inf", 3)) if n]
    if not items:
        return ""
    return ('<div class="mldebug-nonfinite" style="font-size:11px">' + "".join(
        f'<div><span style="display:inline-block;width:10px;height:10px;background:{color};'
        f'margin-right:4px"></span>{name} {n}</div>' for n, name, color in items) + "</div>")


def _heatmap(value) -> str:
    try:
        plane = slice_plane(value, max_side=THUMB_SIDE)
    except Exception:  # noqa: BLE001 - no thumbnail is not an error
        return ""
    shown, kinds = plane["shown"], plane["kinds"]
    rows, cols = shown.shape
    lo, hi = plane["min"], plane["max"]
    palette = _palette()
    span = (hi - lo) if lo is not None and hi > lo else 1.0
    pixels = bytearray()
    kind_rgb = {code: _rgb(color) for code, color in KIND_COLORS.items()}
    for r in range(rows):
        for c in range(cols):
            code = int(kinds[r, c])
            if code:
                pixels += kind_rgb[code]
                continue
            v = float(shown[r, c])
            if lo is None or not math.isfinite(v):
                pixels += b"\x80\x80\x80"
                continue
            pixels += palette[min(len(palette) - 1, int((v - lo) / span * (len(palette) - 1)))]
    png = base64.b64encode(_png(bytes(pixels), cols, rows, 3)).decode("ascii")
    scale = THUMB_PX / max(rows, cols)
    width, height = max(1, round(cols * scale)), max(1, round(rows * scale))
    shape = "×".join(str(n) for n in plane["shape"])
    where = ""
    if len(plane["shape"]) > 2:      # which plane: [0, :, :]
        where = "[" + ", ".join(":" if i is None else str(i) for i in plane["index"]) + "]"
    parts = [f'<div class="mldebug-heatmap"><img src="data:image/png;base64,{png}" '
             f'width="{width}" height="{height}" style="image-rendering:pixelated" '
             f'alt="heatmap of {shape}"><div style="font-size:10px;color:#868e96">'
             f'{shape}{" " + where if where else ""}'
             f'{" (downsampled)" if plane["stride"] != [1, 1] else ""}</div></div>']
    image = plane.get("image")
    if image:
        scale = THUMB_PX / max(image["width"], image["height"])
        parts.append(f'<div class="mldebug-image"><img src="data:image/png;base64,'
                     f'{image["png_base64"]}" width="{round(image["width"] * scale)}" '
                     f'height="{round(image["height"] * scale)}" alt="image"><div '
                     f'style="font-size:10px;color:#868e96">as an image</div></div>')
    return "".join(parts)


def _rgb(color: str) -> bytes:
    return bytes.fromhex(color.lstrip("#")[:6])


_PALETTE = None


def _palette() -> list:
    """Viridis as the view draws its heatmaps (bokeh, a dependency of mldebug); grey
    levels if bokeh cannot be imported."""
    global _PALETTE
    if _PALETTE is None:
        try:
            from bokeh.palettes import Viridis256
            _PALETTE = [_rgb(c) for c in Viridis256]
        except Exception:  # noqa: BLE001
            _PALETTE = [bytes((v, v, v)) for v in range(256)]
    return _PALETTE
