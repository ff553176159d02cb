"""JSON for the VS Code panel, answered through DAP `evaluate` on the paused frame.

The extension evaluates, with `context: "repl"`,

    __import__('mldebug.dap.panel', fromlist=['_']).stop_json()
    __import__('mldebug.dap.panel', fromlist=['_']).frame_json(locals())
    __import__('mldebug.dap.panel', fromlist=['_']).tensor_json(x, 'x', [0, 1], None)
    __import__('mldebug.dap.panel', fromlist=['_']).graph_json()

and `JSON.parse`s the string result. The request MUST carry pydevd's raw-string format,
`"format": {"rawString": true}`: without it debugpy answers the str's repr (quoted,
escaped) cut at 65,536 characters, and a heatmap is longer than that. Every function returns a `str` of JSON (strict: no
NaN/Infinity literals), never raises (errors are `{"error": "..."}`), and keeps payloads
under about MAX_BYTES: heatmaps are downsampled here, in Python, not in the webview.

    stop_json()  -> {"stop": Stop.to_dict() of the session's last stop, or null}
    frame_json(namespace, limit=50)
                 -> {"tensors": [{"name", "line", "summary", "pending"}...], "truncated": n}
                    every tensor/array in NAMESPACE and one level inside lists, tuples and
                    dicts (`batch[0]`, `out['logits']`), sorted by name, at most LIMIT.
                    `pending: true` marks a summary still being computed (a huge tensor):
                    its `summary` has only shape/dtype/device/numel, ask again later.
    tensor_json(value, name="", dims=None, index=None, grad=False, max_side=256)
                 -> a 2-D slice for a heatmap, see `tensor_json`
    graph_json() -> {"graph": null}   (graph capture is not there yet)
"""
from __future__ import annotations

import base64
import json
import math
import struct
import sys
import zlib

MAX_BYTES = 1_000_000
NONFINITE_MAX = 1000         # cells listed in "nonfinite"
CONTAINER_ITEMS = 64         # items looked at inside one list/tuple/dict
EXACT_STATS_MAX = 1 << 22    # slices larger than this: min/max/hist of a strided sample
HIST_BINS = 20
NONFINITE_SCAN_MAX = 1 << 20  # a huge strided slice: NaN/Inf the stride missed, up to this many
FRAME_BUDGET_S = 0.25        # frame_json waits at most this long for summaries in all


def _dumps(obj) -> str:
    text = json.dumps(obj, allow_nan=False, default=str, separators=(",", ":"))
    if len(text) > MAX_BYTES:
        return json.dumps({"error": f"payload of {len(text)} bytes is over the "
                                    f"{MAX_BYTES}-byte limit; ask for less"})
    return text


def _error(exc: BaseException | str) -> str:
    text = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return json.dumps({"error": text})


def _safe(fn):
    def wrapper(*args, **kwargs):
        from . import watch_suspended
        try:
            with watch_suspended():
                return fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - the panel gets an error, never a raise
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                return _error(type(exc).__name__)
            return _error(exc)
    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


# -- stop ---------------------------------------------------------------------------------
@_safe
def stop_json() -> str:
    """{"stop": the session's last stop as Stop.to_dict(), or null}."""
    from .. import session as _session
    current = _session._current  # noqa: SLF001 - do not create a session just to look
    stop = None
    if current is not None and current.stops:
        stop = current.stops[-1].to_dict()
    return _dumps({"stop": _jsonable(stop)})


# -- frame --------------------------------------------------------------------------------
@_safe
def frame_json(namespace: dict, limit: int = 50) -> str:
    """Every tensor/array of NAMESPACE (and one level inside containers), summarised."""
    from . import variables as _v
    if not isinstance(namespace, dict):
        return _error(f"frame_json expects a dict such as locals(), got {type(namespace).__name__}")
    limit = max(0, int(limit))
    found = []
    for name, value in list(namespace.items()):
        if not isinstance(name, str) or name.startswith("__"):
            continue
        if _v.is_tensor(value):
            found.append((name, value))
            continue
        for sub, item in _container_items(name, value):
            if _v.is_tensor(item):
                found.append((sub, item))
    found.sort(key=lambda pair: pair[0])
    truncated = max(0, len(found) - limit)
    tensors = []
    for name, value in found[:limit]:
        summary, ready = _v.summary_within(value, budget=FRAME_BUDGET_S / max(1, len(found)))
        tensors.append({"name": name, "line": str(summary), "summary": summary.to_dict(),
                        "pending": not ready})
    return _dumps({"tensors": tensors, "truncated": truncated})


def _container_items(name: str, value):
    try:
        if isinstance(value, dict):
            items = list(value.items())[:CONTAINER_ITEMS]
            return [(f"{name}[{k!r}]", v) for k, v in items]
        if isinstance(value, (list, tuple)):
            return [(f"{name}[{i}]", v) for i, v in enumerate(value[:CONTAINER_ITEMS])]
    except Exception:  # noqa: BLE001 - odd containers are skipped
        pass
    return []


# -- tensor -------------------------------------------------------------------------------
@_safe
def tensor_json(value, name: str = "", dims=None, index=None, grad: bool = False,
                max_side: int = 256) -> str:
    """A 2-D slice of VALUE (or its `.grad`) for a heatmap:

    {"name", "shape", "dtype", "dims": [d_row, d_col], "index": [... null at the shown
     dims], "rows", "cols" (after downsampling), "stride": [sr, sc], "block_mean": bool,
     "data": [[float | null]] (null where the cell is NaN/Inf), "nonfinite": [[r, c,
     "nan" | "inf" | "-inf"]] (display cells, at most NONFINITE_MAX), "nonfinite_total",
     "min", "max" (finite values of the slice; null if none), "sampled" (min/max/hist of a
     strided sample of a huge slice), "summary": TensorSummary.to_dict() of the whole
     tensor (`"pending": true` while it is computed), "hist": {"counts", "range"},
     "image": null or {"width", "height", "channels", "png_base64"}}

    DIMS: which two dims are rows and columns (default the last two; negative allowed).
    INDEX: one int per dim choosing the slice (the shown dims are ignored; default 0).
    Downsampling to at most MAX_SIDE per side: block means (a block with a NaN/Inf shows
    as that) for slices up to 2^24 elements, plain strides above.
    A 1-D tensor is one row (dims [null, 0]); a 0-d tensor one cell (dims [null, null]).
    """
    import numpy as np
    from . import variables as _v

    torch = sys.modules.get("torch")
    if grad:
        g = getattr(value, "grad", None)
        if g is None:
            return _error(f"{name or 'value'} has no .grad")
        value, name = g, f"{name}.grad" if name else "grad"
    if not _v.is_tensor(value):
        return _error(f"tensor_json expects a torch tensor or numpy array, got {type(value).__name__}")
    max_side = int(max_side)
    if max_side < 1:
        return _error(f"max_side must be >= 1, max_side={max_side}")
    if torch is None:
        return _error("tensor_json needs torch installed")
    if isinstance(value, torch.Tensor):
        t = value.detach()
    elif value.dtype.kind in "biufc":
        t = torch.from_numpy(np.ascontiguousarray(value))
    else:
        return _error(f"tensor_json: no numbers in a {value.dtype} array")
    shape = list(value.shape)
    ndim = len(shape)
    dims, full_index, err = _choose_slice(shape, dims, index)
    if err:
        return _error(err)
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.device.type == "meta" or _is_fake(t):
        return _error(f"{name or 'value'} has no data ({t.device.type} tensor)")
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

    data = "[" + ",".join("[" + ",".join("%.6g" % x if math.isfinite(x) else "null" for x in row)
                          + "]" for row in shown.tolist()) + "]"
    bad = np.argwhere(kinds != 0)
    names = {1: "nan", 2: "inf", 3: "-inf"}
    nonfinite = [[int(r), int(c), names[int(kinds[r, c])]] for r, c in bad[:NONFINITE_MAX]]

    lo, hi, hist, sampled = _slice_stats(torch, plane)
    summary, ready = _v.summary_within(value, budget=0.05)
    payload = {
        "name": name, "shape": shape, "dtype": str(summary.dtype or value.dtype),
        "dims": list(dims) if ndim >= 2 else [None, 0] if ndim == 1 else [None, None],
        "index": [None if i in dims else full_index[i] for i in range(ndim)],
        "rows": int(shown.shape[0]), "cols": int(shown.shape[1]), "stride": [sr, sc],
        "block_mean": block_mean, "data": _DATA, "nonfinite": nonfinite,
        "nonfinite_total": int(len(bad)), "min": lo, "max": hi, "sampled": sampled,
        "summary": summary.to_dict(), "pending": not ready, "hist": hist,
        "image": _image(torch, t, shape, full_index, max_side),
    }
    text = json.dumps(_jsonable(payload), allow_nan=False, default=str, separators=(",", ":"))
    text = text.replace(json.dumps(_DATA), data, 1)
    if len(text) > MAX_BYTES:
        return _error(f"payload of {len(text)} bytes is over the {MAX_BYTES}-byte limit; "
                      f"ask for a smaller max_side (max_side={max_side})")
    return text


_DATA = "\u0000data\u0000"   # placeholder spliced with the preformatted data rows


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


# -- graph --------------------------------------------------------------------------------
@_safe
def graph_json() -> str:
    """{"graph": null} until graph capture lands."""
    return _dumps({"graph": None})


def _jsonable(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else None if math.isnan(v) else str(v)
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v
