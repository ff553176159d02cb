"""`describe(obj)`: the multi-line text `inspect EXPR` prints, for any object."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import numpy as np

try:
    import torch
except ImportError:  # numpy-only use: summaries keep shape/dtype, stats say unavailable
    torch = None

from ..core.quiet import own_call
from .compute import _is_fake, summary
from .tensor_summary import (_bytes, _err, _safe_repr, _shape, format_number,
                             short_dtype)

DESCRIBE_ROWS = 50         # rows of a module table / items of a container that describe shows
DESCRIBE_WIDTH = 200       # characters per line of a container listing
REPR_MAX = 2000            # characters of repr() that describe shows for other objects


# ---------------------------------------------------------------------------------- describe
@own_call     # (the NaN watch looks away, core/quiet.py)
def describe(obj, name: Optional[str] = None) -> str:
    """The text `inspect EXPR` prints for any object. Never raises."""
    try:
        text = _describe(obj)
    except Exception as e:
        text = f"<describe failed: {_err(e)}>"
    return f"{name}: {text}" if name else text


def _is_array(obj) -> bool:
    return (torch is not None and isinstance(obj, torch.Tensor)) or \
        isinstance(obj, (np.ndarray, np.generic))


def _describe(obj) -> str:
    if _is_array(obj):
        return summary(obj).format_long()
    if _is_module(obj):
        return _module_table(obj)
    items = _items(obj)
    if items is not None:
        return _container(obj, items)
    return _safe_repr(obj, REPR_MAX)


def _items(obj):
    """(key, value) pairs of a container worth listing, else None."""
    if isinstance(obj, (str, bytes)):
        return None
    if isinstance(obj, dict) or (hasattr(obj, "keys") and hasattr(obj, "__getitem__")):
        try:
            return ((k, obj[k]) for k in obj.keys())
        except Exception:
            return None
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return zip(obj._fields, obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return ((f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj))
    if isinstance(obj, (list, tuple)) and any(  # a list of plain numbers reads best as repr
            _is_array(v) or _items(v) is not None or _is_module(v) for v in obj[:DESCRIBE_ROWS]):
        return enumerate(obj)
    return None


def _is_module(obj) -> bool:
    return torch is not None and isinstance(obj, torch.nn.Module)


def _container(obj, items) -> str:
    try:
        size = f" len={len(obj)}"
    except Exception:
        size = ""
    lines = [f"{type(obj).__name__}{size}"]
    for i, (k, v) in enumerate(items):
        if i == DESCRIBE_ROWS:
            lines.append(f"  ... {len(obj) - DESCRIBE_ROWS} more" if size else "  ...")
            break
        line = f"  {_safe_repr(k, 60) if not isinstance(k, str) else k}: {_short(v)}"
        lines.append(line if len(line) <= DESCRIBE_WIDTH else line[:DESCRIBE_WIDTH - 3] + "...")
    return "\n".join(lines)


def _short(v) -> str:
    if _is_array(v):
        return str(summary(v))
    if _is_module(v):
        n = sum(p.numel() for p in v.parameters())
        return f"{type(v).__name__} ({n} parameters)"
    if isinstance(v, (list, tuple, dict)) and not isinstance(v, str):
        return f"{type(v).__name__} len={len(v)}"
    return _safe_repr(v, DESCRIBE_WIDTH)




def _module_table(m) -> str:
    params = list(m.named_parameters())
    total = sum(p.numel() for _, p in params)
    nbytes = sum(p.numel() * p.element_size() for _, p in params)
    mode = "training" if m.training else "eval"
    head = (f"{type(m).__name__} ({mode}): {len(params)} parameter tensors, "
            f"{total} elements, {_bytes(nbytes)}")
    rows = [("name", "shape", "dtype", "device", "norm", "grad norm", "flags")]
    bad = 0
    for name, p in params[:DESCRIBE_ROWS]:
        norm, flags = _norm_and_flags(p)
        gnorm, gflags = _norm_and_flags(p.grad) if p.grad is not None else ("-", "")
        flags = " ".join(filter(None, [flags, gflags and f"grad {gflags}"]))
        rows.append((name, _shape(p.shape), short_dtype(p.dtype), str(p.device), norm, gnorm,
                     flags))
    for _, p in params[DESCRIBE_ROWS:]:  # count the rows we do not show too
        bad += bool(_norm_and_flags(p)[1])
    bad += sum(bool(r[6]) for r in rows[1:])
    widths = [max(len(r[i]) for r in rows) for i in range(7)]
    lines = [head]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    if len(params) > DESCRIBE_ROWS:
        lines.append(f"  ... {len(params) - DESCRIBE_ROWS} more")
    if bad:
        lines.append(f"  {bad} parameter tensor(s) with non-finite values")
    return "\n".join(lines)


def _norm_and_flags(p):
    """(norm text, flags text): norm is one cheap pass; exact counts only when it is not finite."""
    try:
        if p.device.type == "meta" or _is_fake(p) or p.numel() == 0:
            return "-", ""
        with torch.no_grad():
            x = p.detach()
            x = x.abs() if x.is_complex() else x
            norm = torch.linalg.vector_norm(x.to(torch.float32)).item()
        if math.isfinite(norm):
            return format_number(norm), ""
        s = summary(p)
        marks = [f"{m}!{c}" for m, c in (("NaN", s.nan), ("+Inf", s.posinf),
                                         ("-Inf", s.neginf)) if c]
        return format_number(norm), " ".join(marks) or "overflow"
    except Exception as e:
        return "?", f"unavailable: {_err(e)}"
