"""`TensorSummary`, the record of a tensor at a glance, and its text.

The package face (mldebug/summaries/__init__.py) gathers the public names; the
summaries are computed in `compute.py` and `describe.py` writes what `inspect` prints.

Public names
    summary(x) -> TensorSummary     torch tensor, numpy array or numpy scalar; never raises
    describe(obj, name=None) -> str the multi-line `inspect` text for ANY object; never raises
    nonfinite_counts(x) -> (nan, posinf, neginf)   exact counts
    has_nonfinite(x) -> bool        any NaN/Inf (one cheap aminmax pass for floats)
    short_dtype(dtype) -> str       'f32', 'bf16', 'f8e4m3', 'i64', 'u8', 'bool', 'c64', ...

The one-line format (`str(summary(x))`), pieces separated by one space, absent ones left out:

    {kind}[{shape}] {dtype} n={numel} ({bytes}) {note} x∈[{min}, {max}] μ={mean} σ={std}
        NaN!{n} +Inf!{n} -Inf!{n} {all zeros} {grad | grad_fn=Name} {device} {values}

    tensor[3, 196, 196] f32 n=115248 (450Kb) x∈[-2.118, 2.640] μ=-0.388 σ=1.073
    tensor[1000] f32 n=1000 (3.9Kb) x∈[-3.000, 3.000] μ=0.001 σ=1.002 NaN!2 +Inf!1 grad cuda:0
    tensor[3] f32 x∈[1.000, 3.000] μ=2.000 σ=1.000 grad_fn=MulBackward0 [2., 4., 6.]

- kind is 'tensor' or 'ndarray'; shape `[]` for 0-d. Statistics are over the FINITE values only.
- `n=… (bytes)` is shown when the values are not (more than VALUES_MAX elements); bytes are
  binary units: 12b, 3.9Kb, 450Kb, 1.2Mb, 4.0Gb.
- Numbers: 3 decimals between 1e-3 and 1e5, else 3-decimal scientific (1.235e+06); integer
  dtypes show integer min/max. Values use 4 significant digits, `1.` for integral floats.
- bool shows `True={count} ({percent}%)` instead of x∈/μ/σ; complex shows `|x|∈[…]` (stats of
  the magnitude); sparse layouts show the note `sparse_coo: stats of {nnz} stored values`.
- Odd inputs are early, labelled returns with a note instead of stats: `empty`, `meta` (shown as
  the device), `fake`, `nested: N components`, `no numeric stats` (numpy object/str/
  datetime/structured; their values are shown when few), `unavailable: {Error}: {message}`.
- The device is shown when it is not cpu; `grad` marks a leaf that requires grad, `grad_fn=…`
  a non-leaf.

`format_long()` adds: device/layout/contiguity, exact stats, non-finite counts with the first non-finite
index (row-major), zeros, a one-row histogram of the finite values (of a strided sample above
HIST_EXACT_MAX elements, flagged), the values when few, and the `.grad` summary.

Speed: a finite float32/float64 CPU tensor costs four passes that allocate nothing (aminmax, sum,
norm, count_nonzero) plus a histogram of at most HIST_SAMPLE elements. Everything else (other
dtypes, anything non-finite, float32 sums that overflow, |mean| >> std) goes piecewise: pieces of
PIECE elements are converted one at a time (float32 for 32-bit-or-narrower types, float64 for
wider ones: never a float64 copy of the whole tensor) and counted with nan_to_num arithmetic.
On other devices everything is computed there in float64, stacked, and brought to the host with
ONE transfer together with the histogram sample and the small values.
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ..core.quiet import own_call

try:
    import torch
except ImportError:  # numpy-only use: summaries keep shape/dtype, stats say unavailable
    torch = None

VALUES_MAX = 10            # show the values themselves up to this many elements
HIST_BINS = 20             # bins of the histogram of finite values

# One table for torch (str(dtype) without 'torch.') and numpy (dtype.name).
_SHORT = {
    "float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16",
    "float8_e4m3fn": "f8e4m3", "float8_e5m2": "f8e5m2", "float8_e4m3fnuz": "f8e4m3fnuz",
    "float8_e5m2fnuz": "f8e5m2fnuz", "float8_e8m0fnu": "f8e8m0", "float4_e2m1fn_x2": "f4e2m1x2",
    "float128": "f128", "longdouble": "f128",
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "bool": "bool", "complex32": "c32", "complex64": "c64", "complex128": "c128",
    "qint8": "qi8", "quint8": "qu8", "qint32": "qi32", "object": "object",
}
_BLOCKS = " ▁▂▃▄▅▆▇█"


def short_dtype(dtype) -> str:
    """'f32' for torch.float32 or np.float32; unknown dtypes keep their own name."""
    if isinstance(dtype, np.dtype):
        if dtype.fields:
            return "struct{" + ",".join(dtype.names) + "}"
        # 'U5' rather than numpy's 'str160'
        return dtype.str[1:] if dtype.kind in "USV" else _SHORT.get(dtype.name, dtype.name)
    name = str(dtype).replace("torch.", "")
    return _SHORT.get(name, name)


@dataclass
class TensorSummary:
    kind: str = "tensor"               # 'tensor' or 'ndarray' (or the type name of other input)
    shape: tuple = ()
    dtype: str = ""                    # short name, see _SHORT
    device: str = "cpu"
    layout: str = "strided"
    requires_grad: bool = False
    grad_fn: Optional[str] = None      # e.g. 'MulBackward0'
    nbytes: int = 0
    numel: int = 0
    min: Optional[float] = None        # min/max/mean/std over the finite values
    max: Optional[float] = None
    mean: Optional[float] = None
    std: Optional[float] = None        # unbiased; None below two finite values
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    zeros: int = 0
    first_nonfinite: Optional[tuple] = None   # row-major index of the first NaN/Inf
    hist: Optional[list] = None        # HIST_BINS counts of finite values over hist_range
    hist_range: Optional[tuple] = None
    hist_sampled: bool = False         # hist counts a strided sample, not every element
    values: Any = None                 # nested list (scalar for 0-d) when numel <= VALUES_MAX
    grad: Optional["TensorSummary"] = None
    note: str = ""
    contiguous: bool = True
    integer: bool = False              # integer/bool dtype: min/max are whole numbers
    complex: bool = False              # stats are of |x|

    @property
    def nonfinite(self) -> int:
        return self.nan + self.posinf + self.neginf

    def __str__(self) -> str:
        try:
            return _one_line(self)
        except Exception as e:  # a summary must print, whatever is in it
            return f"{self.kind}{list(self.shape)} {self.dtype} <format failed: {_err(e)}>"

    __repr__ = __str__

    def to_dict(self) -> dict:
        """All fields, JSON-safe (`json.dumps(d, allow_nan=False)` works); grad nested."""
        d = {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self)
             if f.name != "grad"}
        d["grad"] = self.grad.to_dict() if self.grad is not None else None
        return d

    @own_call   # (a heatmap of a NaN is no stop: the NaN watch looks away)
    def _repr_html_(self) -> str:
        """Jupyter's rich display: the line, a histogram, a heatmap of a 2-D value (html.py)."""
        from .html import summary_html   # only a notebook asks
        try:
            return summary_html(self, source_of(self), format_number)
        except Exception as e:  # noqa: BLE001 - the plain line is shown instead
            return f"<code>{self}</code><!-- html failed: {_err(e)} -->"

    def __getstate__(self):
        state = dict(self.__dict__)
        state.pop("_source", None)     # a weak reference does not pickle
        return state

    def format_long(self) -> str:
        try:
            return _long(self)
        except Exception as e:
            return f"{self}\n  <format failed: {_err(e)}>"



def _version(x):
    """X's version counter; None for an array (numpy keeps none). An inference tensor
    does not track one: reading it raises RuntimeError."""
    try:
        return x._version
    except AttributeError:
        return None


def keep_source(s: TensorSummary, x) -> None:
    """Remember a 2-D to 4-D X (a matrix, an image, a batch of images) weakly, with its
    version, for the summary's heatmap (html.py). A tensor made under inference_mode is
    not kept: without a version counter a change in place could not be seen."""
    try:
        if 2 <= len(getattr(x, "shape", ())) <= 4:
            s.__dict__["_source"] = (weakref.ref(x), _version(x))
    except (TypeError, RuntimeError):   # no weak references, or no version counter
        pass


def source_of(s: TensorSummary):
    """The value S summarised, while it is alive and unchanged; else None."""
    kept = s.__dict__.get("_source")
    if kept is None:
        return None
    x = kept[0]()
    try:
        if x is None or _version(x) != kept[1]:
            return None
    except RuntimeError:
        return None
    return x


# ---------------------------------------------------------------------------------- text
def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200].rstrip(": ")


def format_number(v, integer: bool = False) -> str:
    if v is None:
        return "?"
    if integer:
        return str(int(v))
    v = float(v)
    if not math.isfinite(v):
        return str(v)
    if v == 0 or 1e-3 <= abs(v) < 1e5:
        return f"{v:.3f}"
    return f"{v:.3e}"


def _val(v) -> str:
    """One value of a `values` list: 4 significant digits, `1.` for integral floats."""
    if isinstance(v, bool) or isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        g = f"{v:.4g}"
        return g if any(c in g for c in ".ein") else g + "."
    if isinstance(v, complex):
        return f"{v.real:.4g}{v.imag:+.4g}j"
    if isinstance(v, list):
        return "[" + ", ".join(_val(e) for e in v) + "]"
    r = repr(v) if isinstance(v, (str, bytes)) else str(v)
    return r if len(r) <= 20 else r[:17] + "..."


def _bytes(n: int) -> str:
    for unit in ("b", "Kb", "Mb", "Gb"):
        if n < 1024:
            break
        n /= 1024
    else:
        unit = "Tb"
    if unit == "b":
        return f"{int(n)}b"
    return f"{n:.1f}{unit}" if n < 10 else f"{n:.0f}{unit}"


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _one_line(s: TensorSummary) -> str:
    parts = [f"{s.kind}{_shape(s.shape)}", s.dtype]
    if s.values is None and s.numel:
        parts.append(f"n={s.numel} ({_bytes(s.nbytes)})")
    if s.note and s.note != "meta" and not s.note.startswith("complex"):
        parts.append(s.note)
    if s.min is not None and s.dtype == "bool":
        true = s.numel - s.zeros
        parts.append(f"True={true} ({100 * true / max(s.numel, 1):.1f}%)")
    elif s.min is not None and (s.numel > 1 or s.values is None):
        label = "|x|∈" if s.complex else "x∈"
        parts.append(f"{label}[{format_number(s.min, s.integer)}, {format_number(s.max, s.integer)}]")
        parts.append(f"μ={format_number(s.mean)}")
        if s.std is not None:
            parts.append(f"σ={format_number(s.std)}")
    for mark, count in (("NaN", s.nan), ("+Inf", s.posinf), ("-Inf", s.neginf)):
        if count:
            parts.append(f"{mark}!{count}")
    if s.values is None and s.numel > 1 and s.zeros == s.numel:
        parts.append("all zeros")
    if s.grad_fn:
        parts.append(f"grad_fn={s.grad_fn}")
    elif s.requires_grad:
        parts.append("grad")
    if s.device != "cpu":
        parts.append(s.device)
    if s.values is not None:
        parts.append(_val(s.values))
    return " ".join(p for p in parts if p)


def _hist_row(s: TensorSummary) -> str:
    top = max(s.hist) or 1
    return "".join(_BLOCKS[0] if c == 0 else _BLOCKS[1 + min(7, int(7 * c / top))]
                   for c in s.hist)


def _long(s: TensorSummary, indent: str = "  ") -> str:
    lines = [str(s)]
    where = [s.device, s.layout, "contiguous" if s.contiguous else "non-contiguous",
             f"{s.numel} elements", _bytes(s.nbytes)]
    lines.append(f"{indent}{s.dtype} {_shape(s.shape)} " + ", ".join(where))
    if s.note:
        lines.append(f"{indent}note: {s.note}")
    if s.min is not None:
        what = "|x|" if s.complex else "finite"
        std = "" if s.std is None else f"  std {format_number(s.std)}"
        lines.append(f"{indent}{what}: min {format_number(s.min, s.integer)}  max {format_number(s.max, s.integer)}"
                     f"  mean {format_number(s.mean)}{std}")
    if s.nonfinite:
        first = "" if s.first_nonfinite is None else f"; first at {list(s.first_nonfinite)}"
        lines.append(f"{indent}non-finite: NaN {s.nan}  +Inf {s.posinf}  -Inf {s.neginf}{first}")
    if s.min is not None and not s.note.startswith(("sparse", "complex")):
        pct = 100 * s.zeros / max(s.numel, 1)
        lines.append(f"{indent}zeros: {s.zeros} ({pct:.1f}%)")
    if s.hist:
        sampled = f"  (sample of {sum(s.hist)})" if s.hist_sampled else ""
        lo, hi = s.hist_range
        lines.append(f"{indent}hist: {format_number(lo, s.integer)} |{_hist_row(s)}| "
                     f"{format_number(hi, s.integer)}{sampled}")
    if s.values is not None and s.numel > 1:
        lines.append(f"{indent}values: {_val(s.values)}")
    if s.grad_fn:
        lines.append(f"{indent}grad_fn: {s.grad_fn}")
    if s.grad is not None:
        lines.append(f"{indent}.grad: " + _long(s.grad, indent + "  ").replace("\n", "\n  ", 0))
    elif s.requires_grad and not s.grad_fn:
        lines.append(f"{indent}.grad: None")
    return "\n".join(lines)


def _jsonable(v):
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, complex):
        return _val(v)
    if isinstance(v, (list, tuple)):
        return [_jsonable(e) for e in v]
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, np.generic):
        return _jsonable(v.item())
    return _safe_repr(v, 200)

def _safe_repr(obj, limit: int) -> str:
    try:
        text = repr(obj)
    except Exception as e:
        return f"<repr failed: {_err(e)}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."
