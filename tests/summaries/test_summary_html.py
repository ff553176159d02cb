"""TensorSummary's HTML (Jupyter's rich display): the line, a histogram, a 2-D value's
heatmap with NaN/Inf in their colours; the plain repr stays the line."""
from __future__ import annotations

import base64
import pickle
import re
import struct
import zlib

import numpy as np
import torch

import mldebug
from mldebug.summaries.slicing import KIND_COLORS


def png_pixels(html: str):
    """(width, height, rows of RGB tuples) of the heatmap's PNG in HTML."""
    raw = base64.b64decode(re.search(r"data:image/png;base64,([A-Za-z0-9+/=]+)", html).group(1))
    width, height = struct.unpack(">II", raw[16:24])
    pos, data = 8, b""
    while pos < len(raw):
        (length,) = struct.unpack(">I", raw[pos:pos + 4])
        kind = raw[pos + 4:pos + 8]
        if kind == b"IDAT":
            data += raw[pos + 8:pos + 8 + length]
        pos += 12 + length
    scan = zlib.decompress(data)
    rows = []
    for y in range(height):
        line = scan[y * (1 + 3 * width) + 1:(y + 1) * (1 + 3 * width)]
        rows.append([tuple(line[3 * x:3 * x + 3]) for x in range(width)])
    return width, height, rows


def rgb(color: str):
    return tuple(bytes.fromhex(color[1:]))


def test_the_html_has_the_line_a_histogram_and_a_heatmap_with_nan_and_inf_coloured():
    x = torch.randn(6, 8)
    x[2, 3], x[4, 1], x[0, 0] = float("nan"), float("inf"), float("-inf")
    s = mldebug.summary(x)
    html = s._repr_html_()
    assert repr(s) == str(s) and repr(s).startswith("tensor[6, 8] f32")   # unchanged
    assert f"<code>{str(s)}</code>" in html
    assert html.count("<rect") == len(s.hist)
    assert "NaN 1" in html and "+Inf 1" in html and "-Inf 1" in html
    width, height, rows = png_pixels(html)
    assert (width, height) == (8, 6)
    assert rows[2][3] == rgb(KIND_COLORS[1])
    assert rows[4][1] == rgb(KIND_COLORS[2])
    assert rows[0][0] == rgb(KIND_COLORS[3])
    assert rows[1][1] not in {rgb(c) for c in KIND_COLORS.values()}


def test_a_big_plane_is_a_thumbnail_that_still_shows_its_one_nan():
    x = torch.zeros(1000, 300)
    x[777, 5] = float("nan")
    width, height, rows = png_pixels(mldebug.summary(x)._repr_html_())
    assert max(width, height) <= 48
    assert sum(row.count(rgb(KIND_COLORS[1])) for row in rows) == 1


def test_no_heatmap_for_a_value_changed_since_or_not_2d():
    x = torch.ones(4, 4)
    s = mldebug.summary(x)
    assert "mldebug-heatmap" in s._repr_html_()
    x.add_(1)           # the line no longer describes these values
    assert "mldebug-heatmap" not in s._repr_html_()
    assert "mldebug-heatmap" not in mldebug.summary(torch.randn(100))._repr_html_()
    a = np.arange(12.0).reshape(3, 4)
    assert "mldebug-heatmap" in mldebug.summary(a)._repr_html_()


def test_a_summary_still_pickles_and_compares_as_before():
    x = torch.randn(3, 3)
    s = mldebug.summary(x)
    back = pickle.loads(pickle.dumps(s))
    assert back == s and str(back) == str(s)
    assert "mldebug-heatmap" not in back._repr_html_()


def test_an_image_batch_shows_its_first_plane_with_the_nan_and_the_picture():
    x = torch.rand(2, 3, 32, 32)
    x[0, 0, 5, 6] = float("nan")
    html = mldebug.summary(x)._repr_html_()
    width, height, rows = png_pixels(html)           # the heatmap comes first
    assert (width, height) == (32, 32) and rows[5][6] == rgb(KIND_COLORS[1])
    assert "2×3×32×32 [0, 0, :, :]" in html
    assert 'class="mldebug-image"' in html           # and the batch's first image
    assert "mldebug-image" not in mldebug.summary(y := torch.rand(5, 7, 9))._repr_html_()
    assert "mldebug-heatmap" in mldebug.summary(y)._repr_html_()
    assert "mldebug-heatmap" not in mldebug.summary(z := torch.rand(2, 2, 2, 2, 2))._repr_html_()
    del z


def test_a_tensor_made_under_inference_mode_is_summarised_without_a_heatmap():
    """An inference tensor keeps no version counter (reading it raises): its summary has
    its stats as any other's, and no heatmap, since a change in place could not be seen."""
    with torch.inference_mode():
        x = torch.tensor([[1.0, float("nan")], [3.0, 4.0]])
    s = mldebug.summary(x)
    assert s.nan == 1 and s.max == 4.0, s
    assert "<img" not in s._repr_html_()
