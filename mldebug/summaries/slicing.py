"""2-D slices of N-D tensors, reduced for display: what the VS Code panel
(`mldebug.dap.panel.tensor_json`) and the browser view (`mldebug.view`) both show.

Front-end neutral: imports numpy and torch only, knows nothing of JSON, DAP or Bokeh.

    slice_plane(value, name="", dims=None, index=None, grad=False, max_side=256) -> dict
        the plane of VALUE (or of its `.grad`) along DIMS at INDEX, downsampled in
        Python to at most MAX_SIDE cells per side, with a NaN/+Inf/-Inf code per cell,
        the finite min/max and histogram of the slice, and a PNG for image-shaped
        tensors. Bad arguments raise SliceError with the value named.
"""
from __future__ import annotations

import base64
import math
import struct
import sys
import zlib

NONFINITE_MAX = 1000         # cells listed in "nonfinite" by the JSON front ends
EXACT_STATS_MAX = 1 << 22    # slices larger than this: min/max/hist of a strided sample
HIST_BINS = 20
NONFINITE_SCAN_MAX = 1 << 20  # a huge strided slice: NaN/Inf the stride missed, up to this many
KIND_NAMES = {1: "nan", 2: "inf", 3: "-inf"}   # the per-cell codes of `kinds`
# ... and their colours on every surface (the view's heatmap, the notebook's thumbnail)
KIND_COLORS = {1: "#ff00ff", 2: "#ff2828", 3: "#00e6ff"}


class SliceError(ValueError):
    """A bad argument to slice_plane (the message names the value)."""


def is_tensor(x) -> bool:
    torch, np = sys.modules.get("torch"), sys.modules.get("numpy")
    return bool((torch is not None and isinstance(x, torch.Tensor))
                or (np is not None and isinstance(x, np.ndarray)))


def slice_plane(value, name: str = "", dims=None, index=None, grad: bool = False,
                max_side: int = 256) -> dict:
    """The displayable plane of VALUE:

    {"name", "value" (what is shown: VALUE or its .grad), "shape", "dims" ([d_row, d_col];
     [None, 0] for 1-D, [None, None] for 0-d), "index" (None at the shown dims), "full_index",
     "rows", "cols" (after downsampling), "stride": [sr, sc], "block_mean",
     "shown": float64 ndarray (NaN where the cell is not finite), "kinds": int8 ndarray
     (0 finite, 1 NaN, 2 +Inf, 3 -Inf), "min", "max" (finite values of the slice, None if
     none), "hist": {"counts", "range"}, "sampled", "image": None or
     {"width", "height", "channels", "png_base64"}}

    DIMS: which two dims are rows and columns (default the last two; negative allowed).
    INDEX: one int per dim choosing the slice (the shown dims are ignored; default 0).
    Downsampling: block means (a block with a NaN/Inf shows as that) for slices up to
    2^24 elements, plain strides above (plus one pass that finds the NaN/Inf the stride
    missed).
    """
    import numpy as np

    torch = sys.modules.get("torch")
    if grad:
        g = getattr(value, "grad", None)
        if g is None:
            raise SliceError(f"{name or 'value'} has no .grad")
        value, name = g, f"{name}.grad" if name else "grad"
    if not is_tensor(value):
        raise SliceError(f"tensor_json expects a torch tensor or numpy array, got {type(value).__name__}")
    max_side = int(max_side)
    if max_side < 1:
        raise SliceError(f"max_side must be >= 1, max_side={max_side}")
    if torch is None:
        raise SliceError("tensor_json needs torch installed")
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif value.dtype.kind in "biufc":
        t = torch.from_numpy(np.ascontiguousarray(value))
    else:
        raise SliceError(f"tensor_json: no numbers in a {value.dtype} array")
    shape = list(value.shape)
    ndim = len(shape)
    dims, full_index, err = _choose_slice(shape, dims, index)
    if err:
        raise SliceError(err)
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type == "meta" or _is_fake(t):
        raise SliceError(f"{name or 'value'} has no data ({t.device.type} tensor)")
    with torch.no_grad():
        plane = t[tuple(slice(None) if i in dims else full_index[i] for i in range(ndim))] if ndim else t
        if ndim >= 2 and dims[0] > dims[1]:
            plane = plane.transpose(0, 1)
        plane = plane.reshape(1, -1) if plane.dim() == 1 else plane.reshape(1, 1) if plane.dim() == 0 else plane
        if plane.is_complex():
            plane = plane.abs()
        plane = plane.to(torch.float32) if plane.dtype != torch.float64 else plane
        rows_in, cols_in = plane.shape
        sr, sc = max(1, math.ceil(rows_in / max_side)), max(1, math.ceil(cols_in / max_side))
        block_mean = (sr > 1 or sc > 1) and rows_in * cols_in <= (1 << 24)
        shown, kinds = _downsample(torch, plane, sr, sc, block_mean)
        shown = shown.cpu().double().numpy()
        kinds = kinds.cpu().numpy()
        lo, hi, hist, sampled = _slice_stats(torch, plane)
        image = _image(torch, t, shape, full_index, max_side)
    return {
        "name": name, "value": value, "shape": shape,
        "dims": list(dims) if ndim >= 2 else [None, 0] if ndim == 1 else [None, None],
        "index": [None if i in dims else full_index[i] for i in range(ndim)],
        "full_index": list(full_index),
        "rows": int(shown.shape[0]), "cols": int(shown.shape[1]), "stride": [sr, sc],
        "block_mean": block_mean, "shown": shown, "kinds": kinds,
        "min": lo, "max": hi, "hist": hist, "sampled": sampled, "image": image,
    }


def _choose_slice(shape, dims, index):
    ndim = len(shape)
    if ndim == 0:
        return [], [], None
    if ndim == 1:
        chosen = [0]
    elif dims is None:
        chosen = [ndim - 2, ndim - 1]
    else:
        try:
            chosen = [int(d) for d in dims]
        except (TypeError, ValueError):
            return None, None, f"dims must be two ints, dims={dims!r}"
        if len(chosen) != 2:
            return None, None, f"dims must be two ints, dims={dims!r}"
        chosen = [d + ndim if d < 0 else d for d in chosen]
        if any(not 0 <= d < ndim for d in chosen) or chosen[0] == chosen[1]:
            return None, None, f"dims must be two different dims of a {ndim}-d tensor, dims={dims!r}"
    full = [0] * ndim
    if index is not None:
        if not isinstance(index, (list, tuple)) or len(index) != ndim:
            return None, None, f"index must list one int (or null) per dim ({ndim}), index={index!r}"
        for i, v in enumerate(index):
            if i in chosen or v is None:
                continue
            try:
                v = int(v)
            except (TypeError, ValueError):
                return None, None, f"index[{i}] must be an int, index={index!r}"
            if not -shape[i] <= v < shape[i]:
                return None, None, f"index[{i}]={v} is out of range for size {shape[i]}"
            full[i] = v % shape[i]
    return chosen, full, None


def _downsample(torch, plane, sr, sc, block_mean):
    """(values, kinds): kinds 0 finite, 1 NaN, 2 +Inf, 3 -Inf per display cell."""
    if sr == 1 and sc == 1:
        shown = plane
        kinds = _kinds(torch, plane)
        return shown, kinds
    if not block_mean:
        shown = plane[::sr, ::sc]
        kinds = _kinds(torch, shown)
        # A finite sum proves every element finite (NaN and Inf propagate): one fast
        # reduction instead of a bool pass, which is many times slower on CPU.
        if math.isfinite(float(plane.sum())):
            return shown, kinds
        # A stride skips most elements: find the few NaN/Inf it missed (one pass).
        bad = ~torch.isfinite(plane)
        count = int(bad.sum())
        if 0 < count <= NONFINITE_SCAN_MAX:
            where = bad.nonzero()
            values = plane[where[:, 0], where[:, 1]]
            codes = torch.where(torch.isnan(values), 1, torch.where(values > 0, 2, 3)).to(torch.int8)
            cells = (where[:, 0] // sr, where[:, 1] // sc)
            kinds[cells] = codes.to(kinds.device)
            shown = shown.clone()
            shown[cells] = math.nan
        return shown, kinds
    import torch.nn.functional as F
    x = plane[None, None]
    k = (sr, sc)
    finite = torch.isfinite(x)
    total = F.avg_pool2d(torch.where(finite, x, torch.zeros((), dtype=x.dtype)).double(), k, k,
                         ceil_mode=True)
    share = F.avg_pool2d(finite.double(), k, k, ceil_mode=True)
    shown = (total / share.clamp_min(1e-300))[0, 0]
    pool = lambda m: F.max_pool2d(m.to(x.dtype), k, k, ceil_mode=True)[0, 0] > 0  # noqa: E731
    nan, pos, neg = pool(torch.isnan(x)), pool(x == math.inf), pool(x == -math.inf)
    kinds = torch.zeros(shown.shape, dtype=torch.int8)
    kinds[neg.cpu()] = 3
    kinds[pos.cpu()] = 2
    kinds[nan.cpu()] = 1
    shown = torch.where(kinds.to(shown.device) != 0, torch.full((), math.nan, dtype=shown.dtype,
                                                                device=shown.device), shown)
    return shown, kinds


def _kinds(torch, x):
    kinds = torch.zeros(x.shape, dtype=torch.int8, device=x.device)
    kinds[x == -math.inf] = 3
    kinds[x == math.inf] = 2
    kinds[torch.isnan(x)] = 1
    return kinds


def _slice_stats(torch, plane):
    flat = plane.reshape(-1)
    sampled = flat.numel() > EXACT_STATS_MAX
    if sampled:
        step = math.ceil(flat.numel() / EXACT_STATS_MAX)
        flat = flat[::step]
    finite = flat[torch.isfinite(flat)]
    if finite.numel() == 0:
        return None, None, {"counts": [], "range": None}, sampled
    lo, hi = (float(v) for v in torch.aminmax(finite))
    top = hi if hi > lo else lo + 1.0
    counts = torch.histc(finite.double(), bins=HIST_BINS, min=lo, max=top)
    return lo, hi, {"counts": [int(c) for c in counts.tolist()], "range": [lo, top]}, sampled


def _is_fake(t) -> bool:
    return type(t).__name__ in ("FakeTensor", "FunctionalTensor")


# -- image --------------------------------------------------------------------------------
def _image(torch, t, shape, index, max_side):
    """A PNG of (C,H,W) or (B,C,H,W) with C in (1, 3), min-max scaled; else None."""
    try:
        if len(shape) == 3:
            img = t
        elif len(shape) == 4:
            img = t[index[0]]
        else:
            return None
        c, h, w = img.shape
        if c not in (1, 3) or h < 4 or w < 4:
            return None
        step = max(1, math.ceil(max(h, w) / max_side))
        img = img[:, ::step, ::step]
        if img.is_complex():
            img = img.abs()
        img = img.to(torch.float32).cpu()
        finite = torch.isfinite(img)
        vals = img[finite]
        if vals.numel():
            lo, hi = float(vals.min()), float(vals.max())
        else:
            lo, hi = 0.0, 1.0
        scaled = ((img - lo) / (hi - lo if hi > lo else 1.0) * 255).clamp(0, 255)
        scaled = torch.where(finite, scaled, torch.zeros(())).round().to(torch.uint8)
        pixels = scaled.permute(1, 2, 0).contiguous().numpy()
        height, width = pixels.shape[:2]
        png = _png(pixels.tobytes(), width, height, c)
        return {"width": width, "height": height, "channels": c,
                "png_base64": base64.b64encode(png).decode("ascii")}
    except Exception:  # noqa: BLE001 - no image is not an error
        return None


def _png(raw: bytes, width: int, height: int, channels: int) -> bytes:
    row = width * channels
    scan = b"".join(b"\x00" + raw[y * row:(y + 1) * row] for y in range(height))

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    color = 0 if channels == 1 else 2
    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, color, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(scan, 6)) + chunk(b"IEND", b""))


