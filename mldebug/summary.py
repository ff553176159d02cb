"""One-glance summaries of tensors and arrays, and the text `inspect EXPR` prints.

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
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

try:
    import torch
except ImportError:  # numpy-only use: summaries keep shape/dtype, stats say unavailable
    torch = None

VALUES_MAX = 10            # show the values themselves up to this many elements
HIST_BINS = 20             # bins of the histogram of finite values
HIST_EXACT_MAX = 1 << 18   # above this many elements the histogram is of a strided sample ...
HIST_SAMPLE = 1 << 16      # ... of about this many elements
PIECE = 1 << 20            # elements converted to float64 at a time on the piecewise path (CPU:
PIECE_DEVICE = 1 << 24     # ~cache-sized; accelerators: big, as each piece costs kernel launches)
CANCEL = 1e-3              # Σx² - (Σx)²/n below this fraction of Σx²: recompute σ centred
DESCRIBE_ROWS = 50         # rows of a module table / items of a container that describe shows
DESCRIBE_WIDTH = 200       # characters per line of a container listing
REPR_MAX = 2000            # characters of repr() that describe shows for other objects

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

    def format_long(self) -> str:
        try:
            return _long(self)
        except Exception as e:
            return f"{self}\n  <format failed: {_err(e)}>"


# ---------------------------------------------------------------------------------- summary
def summary(x) -> TensorSummary:
    """Summarise a torch tensor, numpy array or numpy scalar. Never raises, never modifies x."""
    try:
        if torch is not None and isinstance(x, torch.Tensor):
            with torch.no_grad():
                return _tensor_summary(x)
        if isinstance(x, (np.ndarray, np.generic)):
            return _array_summary(np.asarray(x))
        return TensorSummary(kind=type(x).__name__, note="unavailable: not a tensor or array")
    except Exception as e:
        return TensorSummary(kind=type(x).__name__, note=f"unavailable: {_err(e)}")


def _tensor_summary(t) -> TensorSummary:
    s = TensorSummary(kind="tensor", dtype=short_dtype(t.dtype), device=str(t.device),
                      layout=str(t.layout).replace("torch.", ""), requires_grad=t.requires_grad,
                      grad_fn=type(t.grad_fn).__name__ if t.grad_fn is not None else None)
    s.complex = t.is_complex()
    s.integer = not (t.is_floating_point() or s.complex or t.is_quantized)
    if t.is_nested:  # ragged: no single shape
        s.note, s.contiguous = f"nested: {t.size(0)} components", False
        return s
    s.shape, s.numel = tuple(t.shape), t.numel()
    s.nbytes = s.numel * t.element_size()
    s.contiguous = t.layout == torch.strided and t.is_contiguous()
    if t.is_leaf and t.grad is not None:  # .grad of a non-leaf warns; only leaves have one
        s.grad = summary(t.grad)
    try:
        _tensor_stats(t.detach(), s)
    except Exception as e:
        s.note = f"unavailable: {_err(e)}"
    return s


def _tensor_stats(t, s: TensorSummary) -> None:
    if s.numel == 0:
        s.note = "empty"
        return
    if t.device.type == "meta":
        s.note = "meta"
        return
    if _is_fake(t):  # torch.compile tracing: there is no data to read
        s.note = "fake"
        return
    if t.is_quantized:
        t, s.note = t.dequantize(), "quantized: stats of dequantized values"
    if t.layout != torch.strided:
        _sparse_stats(t, s)
        return
    if s.complex:
        s.note = "complex: stats of |x|"
    _fill(s, t, want_values=True)


def _sparse_stats(t, s: TensorSummary) -> None:
    """Stats of the stored values only: a sparse tensor is never densified."""
    vals = t._values() if t.layout == torch.sparse_coo else t.values()
    s.note = f"{s.layout}: stats of {vals.numel()} stored values"
    s.nbytes = sum(v.numel() * v.element_size() for v in _sparse_parts(t))
    _fill(s, vals, want_values=False)
    s.zeros += s.numel - vals.numel()  # the implicit zeros
    k, s.first_nonfinite = (s.first_nonfinite or (None,))[0], None
    if k is None or vals.dim() != 1:
        return
    if t.layout == torch.sparse_coo and t.is_coalesced():  # coalesced = row-major order
        s.first_nonfinite = tuple(int(i) for i in t._indices()[:, k].tolist())
    elif t.layout == torch.sparse_csr:
        row = int(torch.searchsorted(t.crow_indices(), k, right=True)) - 1
        s.first_nonfinite = (row, int(t.col_indices()[k]))


def _sparse_parts(t):
    if t.layout == torch.sparse_coo:
        return (t._indices(), t._values())
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return (t.crow_indices(), t.col_indices(), t.values())
    return (t.ccol_indices(), t.row_indices(), t.values())


def _array_summary(a: np.ndarray) -> TensorSummary:
    s = TensorSummary(kind="ndarray", shape=tuple(a.shape), dtype=short_dtype(a.dtype),
                      nbytes=int(a.nbytes), numel=int(a.size), contiguous=a.flags.c_contiguous)
    s.complex = a.dtype.kind == "c"
    s.integer = a.dtype.kind in "biu"
    if a.size == 0:
        s.note = "empty"
        return s
    if a.dtype.kind not in "biufc":  # object, str, bytes, datetime, structured
        s.note = "no numeric stats"
        if a.size <= VALUES_MAX:
            s.values = a.tolist()
        return s
    if torch is None:
        s.note = "unavailable: torch is not installed"
        return s
    if s.complex:
        s.note = "complex: stats of |x|"
    try:
        _fill(s, _as_torch(a), want_values=True)
    except Exception as e:
        s.note = f"unavailable: {_err(e)}"
    return s


def _as_torch(a: np.ndarray):
    """A zero-copy torch view of a where torch can take it; a copy only for negative strides
    and dtypes torch lacks (longdouble → float64)."""
    if a.dtype.kind == "f" and a.dtype.itemsize > 8:
        a = a.astype(np.float64)
    if any(st < 0 for st in a.strides):
        a = np.ascontiguousarray(a)
    with warnings.catch_warnings():  # read-only arrays warn; we only read
        warnings.simplefilter("ignore")
        return torch.from_numpy(a)


# ---------------------------------------------------------------------------------- engine
def _fill(s: TensorSummary, t, want_values: bool) -> None:
    """Fill the numeric fields of s from strided tensor t (any dtype/device)."""
    r, sample, small = _reduce(t, want_values and t.numel() <= VALUES_MAX)
    n = int(r["n"])
    s.nan, s.posinf, s.neginf = int(r["nan"]), int(r["posinf"]), int(r["neginf"])
    s.zeros = int(r["zeros"])
    if r["first"] >= 0:
        s.first_nonfinite = tuple(int(i) for i in np.unravel_index(int(r["first"]), t.shape))
    if small is not None:
        s.values = small
    if n == 0:
        return
    num = int if s.integer else float
    s.min, s.max = num(r["lo"]), num(r["hi"])
    s.mean = r["sum"] / n
    s.std = math.sqrt(max(r["ss"], 0.0) / (n - 1)) if n > 1 else None
    if s.dtype == "bool" or r["lo"] == r["hi"]:
        return
    s.hist = [int(c) for c in torch.histc(sample, HIST_BINS, r["lo"], r["hi"]).tolist()]
    s.hist_range = (num(r["lo"]), num(r["hi"]))
    s.hist_sampled = t.numel() > HIST_EXACT_MAX


_KEYS = ("n", "sum", "ss", "lo", "hi", "zeros", "nan", "posinf", "neginf", "first")


def _converter(dtype, wide: bool):
    """Per-piece conversion to a float type that holds every value exactly: float32 for 32-bit
    floats and anything narrower, float64 for the rest (and when `wide`); |x| for complex."""
    small = dtype.itemsize <= (4 if dtype.is_floating_point or dtype.is_complex else 2)
    if dtype.is_complex:
        small = dtype.itemsize <= 8
    to = torch.float32 if small and not wide else torch.float64
    if dtype.is_complex:
        return lambda p: p.abs().to(to)
    return lambda p: p.to(to)


def _reduce(t, want_small: bool, device_path: Optional[bool] = None):
    """Everything about the finite values of t, as a dict of _KEYS (ss: Σ(x-μ)²), plus the
    histogram sample (host float tensor) and the small values (nested list) when asked.
    device_path (default: t is not on the CPU) avoids every host round trip but one."""
    sample = _sample(t, HIST_SAMPLE) if t.numel() > HIST_EXACT_MAX else t
    if device_path is None:
        device_path = t.device.type != "cpu"
    if not device_path:
        small = _small_values(t) if want_small else None
        sample = _converter(t.dtype, False)(sample.reshape(-1))
        r = _fast(t) if t.dtype in (torch.float32, torch.float64) else None
        if r is None:
            r = _pieces_reduce(t, _converter(t.dtype, False), careful=False)
        if r["n"] and not (math.isfinite(r["sum"]) and math.isfinite(r["ss"])):
            r = _pieces_reduce(t, _converter(t.dtype, True), careful=False)  # float32 overflowed
        return r, sample, small
    # Another device: all on the device in float64, then ONE transfer of stats, sample and
    # small values.
    conv = _converter(t.dtype, True)
    stats = _pieces_reduce(t, conv, careful=True)
    parts = [stats, conv(sample.reshape(-1))]
    if want_small:
        flat = t.reshape(-1)
        parts.append(torch.view_as_real(flat.to(torch.complex128)).reshape(-1)
                     if t.is_complex() else flat.to(torch.float64))
    host = torch.cat(parts).cpu()
    r = dict(zip(_KEYS, host[:len(_KEYS)].tolist()))
    sample = host[len(_KEYS):len(_KEYS) + parts[1].numel()]
    small = None
    if want_small:
        flat = host[len(_KEYS) + parts[1].numel():].tolist()
        if t.is_complex():
            flat = [complex(a, b) for a, b in zip(flat[::2], flat[1::2])]
        else:
            py = bool if t.dtype == torch.bool else (float if t.is_floating_point() else int)
            flat = [py(v) for v in flat]
        small = np.array(flat, dtype=object).reshape(t.shape).tolist() if t.dim() else flat[0]
    return r, sample, small


def _fast(x) -> Optional[dict]:
    """All-finite float32/float64 on CPU: four passes, no allocation. None sends the caller to
    the exact piecewise path: something is non-finite, the float32 sums overflowed, or
    Σx² - (Σx)²/n cancelled (|mean| >> std)."""
    lo, hi = (v.item() for v in torch.aminmax(x))
    if not (math.isfinite(lo) and math.isfinite(hi)):  # a NaN propagates into aminmax
        return None
    n = x.numel()
    s = x.sum().item()
    sq = torch.linalg.vector_norm(x).item() ** 2
    ss = sq - s * s / n
    if lo == hi:
        ss = 0.0
    elif not (math.isfinite(s) and math.isfinite(sq)) or ss <= sq * CANCEL:
        return None
    return dict(n=n, sum=s, ss=ss, lo=lo, hi=hi, zeros=n - torch.count_nonzero(x).item(),
                nan=0, posinf=0, neginf=0, first=-1)


def _pieces_reduce(t, conv, careful: bool):
    """Exact stats piece by piece. careful (not CPU): no host round trips, returns the stats
    as a float64 device tensor in _KEYS order; else a dict."""
    rows, offsets, off = [], [], 0
    size = PIECE if t.device.type == "cpu" else PIECE_DEVICE
    for p in _pieces(t, size):
        rows.append(_row(conv(p).reshape(-1), check_on_host=not careful))
        offsets.append(off)
        off += p.numel()
    R = torch.stack(rows)
    tot = R.sum(0)
    offs = torch.tensor(offsets, dtype=torch.float64, device=R.device)
    first = torch.where(R[:, 9] >= 0, R[:, 9] + offs, math.inf).amin()
    n, s = tot[0], tot[1]
    lo, hi = R[:, 3].amin(), R[:, 4].amax()
    mean = s / n
    ss = tot[2] - s * s / n
    if careful or (n.item() > 0 and not ss > tot[2] * CANCEL):  # cancelled (or overflowed):
        ss = sum(_centred(conv(p).reshape(-1), mean) for p in _pieces(t, size))  # Σ(x-μ)²
    ss = torch.where(lo == hi, 0.0, ss)
    first = torch.where(torch.isinf(first), -1.0, first)
    out = torch.stack([n, s, ss, lo, hi, tot[5], tot[6], tot[7], tot[8], first])
    return out if careful else dict(zip(_KEYS, out.tolist()))


def _row(p, check_on_host: bool):
    """_KEYS of one float 1-d piece, as a float64 tensor on its device."""
    if check_on_host and p.device.type == "cpu":
        return _row_numpy(p)
    n = p.numel()
    lo, hi = torch.aminmax(p)
    if check_on_host and math.isfinite(lo.item()) and math.isfinite(hi.item()):
        zero = torch.zeros((), dtype=torch.float64)
        return torch.stack([v.to(zero) for v in (zero + n, p.sum(), p.dot(p), lo, hi,
                            n - torch.count_nonzero(p), zero, zero, zero, zero - 1)])
    # Exact path with nan_to_num and arithmetic only: on CPU isfinite/where and anything with a
    # bool output are several times slower. x - x == 0 for every finite x, so each difference
    # below is an exact 0/1 indicator.
    z = torch.nan_to_num(p, 0.0, 0.0, 0.0)
    bad = torch.nan_to_num(p, 1.0, 1.0, 1.0) - z
    nbad = torch.count_nonzero(bad)
    nan = torch.count_nonzero(torch.nan_to_num(p, 1.0, 0.0, 0.0) - z)
    posinf = torch.count_nonzero(torch.nan_to_num(p, 0.0, 1.0, 0.0) - z)
    lo = torch.nan_to_num(p, math.inf, math.inf, math.inf).amin()  # +inf when none finite
    hi = torch.nan_to_num(p, -math.inf, -math.inf, -math.inf).amax()
    first = torch.where(nbad > 0, bad.argmax(), -1)  # argmax gives the first maximum
    zeros = n - nbad - torch.count_nonzero(z)
    return torch.stack([v.to(torch.float64) for v in (
        n - nbad, z.sum(), z.dot(z), lo, hi, zeros, nan, posinf, nbad - nan - posinf, first)])


def _row_numpy(p):
    """The exact path of a CPU piece through numpy (zero-copy view): numpy's isnan/isfinite
    and count_nonzero are SIMD loops, ~30x faster here than torch's bool-producing CPU ops,
    and torch's aminmax takes a slow path on pieces holding NaN; so a tensor full of
    scattered NaNs costs a few light passes instead of a dozen. Single-threaded numpy also
    degrades gracefully on a loaded machine, where OpenMP reductions over many small pieces
    do not (measured: 0.18 s vs 3 s for 1e8 float32 with one NaN at load 2.5)."""
    a = p.numpy()
    n = a.size
    finite = np.isfinite(a)
    n_finite = int(np.count_nonzero(finite))
    nan = int(np.count_nonzero(np.isnan(a))) if n_finite < n else 0
    posinf = int(np.count_nonzero(np.isposinf(a))) if n_finite < n else 0
    neginf = n - n_finite - nan - posinf
    first = int(np.argmin(finite)) if n_finite < n else -1
    vals = a[finite] if n_finite < n else a
    if n_finite:
        lo, hi = float(vals.min()), float(vals.max())
        total = float(vals.sum(dtype=np.float64))
        with np.errstate(over="ignore"):  # float32 overflow: the caller redoes it in float64
            sq = float(np.dot(vals, vals))  # BLAS dot, in the piece's own precision like _fast
        zeros = n_finite - int(np.count_nonzero(vals))
    else:
        lo, hi, total, sq, zeros = math.inf, -math.inf, 0.0, 0.0, 0
    return torch.tensor([n_finite, total, sq, lo, hi, zeros, nan, posinf, neginf, first],
                        dtype=torch.float64)


def _centred(p, mean):
    """Σ(x-μ)² over the finite x of a piece, in float64 (no overflow for float32 data)."""
    d = torch.nan_to_num(p.to(torch.float64) - mean, 0.0, 0.0, 0.0)
    return d.dot(d)


def _pieces(x, size: int = PIECE):
    """Views of x, in row-major order, of at most `size` elements each; nothing is copied."""
    if x.dim() == 0 or x.is_contiguous():
        x = x.reshape(-1)
    if x.dim() == 1:
        yield from x.split(size)
        return
    row = x[0].numel()
    if row > size:
        for r in x.unbind(0):
            yield from _pieces(r, size)
    else:
        yield from x.split(max(1, size // row))


def _sample(x, k: int):
    """About k elements spread over all of x, as a strided view (no copy of x)."""
    if x.is_contiguous():
        flat = x.reshape(-1)
        return flat[:: -(-flat.numel() // k)]
    for d in range(x.dim()):  # thin every dimension about evenly
        over = x.numel() / k
        if over <= 1:
            break
        step = min(x.shape[d], math.ceil(over ** (1 / (x.dim() - d))))
        x = x[(slice(None),) * d + (slice(None, None, step),)]
    return x


def _small_values(t):
    if t.is_floating_point() and t.element_size() < 2:  # fp8 has no tolist
        t = t.to(torch.float32)
    return t.tolist()


def _is_fake(t) -> bool:
    try:
        from torch._subclasses.fake_tensor import is_fake
        return bool(is_fake(t))
    except Exception:
        return False


def nonfinite_counts(x) -> tuple:
    """Exact (nan, posinf, neginf) of a tensor or array; (0, 0, 0) for non-float data."""
    s = summary(x)
    return s.nan, s.posinf, s.neginf


def has_nonfinite(x) -> bool:
    """Any NaN/Inf in x: one aminmax pass (a NaN propagates into it)."""
    try:
        if torch is not None and isinstance(x, torch.Tensor):
            if x.numel() == 0 or x.device.type == "meta" or _is_fake(x):
                return False
            if x.is_floating_point() and x.layout == torch.strided and x.element_size() >= 2:
                with torch.no_grad():
                    lo, hi = torch.aminmax(x.detach())
                    return not bool(torch.isfinite(lo) & torch.isfinite(hi))
        return summary(x).nonfinite > 0
    except Exception:
        return False


# ---------------------------------------------------------------------------------- text
def _err(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text}"[:200].rstrip(": ")


def _num(v, integer: bool = False) -> str:
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
        parts.append(f"{label}[{_num(s.min, s.integer)}, {_num(s.max, s.integer)}]")
        parts.append(f"μ={_num(s.mean)}")
        if s.std is not None:
            parts.append(f"σ={_num(s.std)}")
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
        std = "" if s.std is None else f"  std {_num(s.std)}"
        lines.append(f"{indent}{what}: min {_num(s.min, s.integer)}  max {_num(s.max, s.integer)}"
                     f"  mean {_num(s.mean)}{std}")
    if s.nonfinite:
        first = "" if s.first_nonfinite is None else f"; first at {list(s.first_nonfinite)}"
        lines.append(f"{indent}non-finite: NaN {s.nan}  +Inf {s.posinf}  -Inf {s.neginf}{first}")
    if s.min is not None and not s.note.startswith(("sparse", "complex")):
        pct = 100 * s.zeros / max(s.numel, 1)
        lines.append(f"{indent}zeros: {s.zeros} ({pct:.1f}%)")
    if s.hist:
        sampled = f"  (sample of {sum(s.hist)})" if s.hist_sampled else ""
        lo, hi = s.hist_range
        lines.append(f"{indent}hist: {_num(lo, s.integer)} |{_hist_row(s)}| "
                     f"{_num(hi, s.integer)}{sampled}")
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


# ---------------------------------------------------------------------------------- describe
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


def _safe_repr(obj, limit: int) -> str:
    try:
        text = repr(obj)
    except Exception as e:
        return f"<repr failed: {_err(e)}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


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
            return _num(norm), ""
        s = summary(p)
        marks = [f"{m}!{c}" for m, c in (("NaN", s.nan), ("+Inf", s.posinf),
                                         ("-Inf", s.neginf)) if c]
        return _num(norm), " ".join(marks) or "overflow"
    except Exception as e:
        return "?", f"unavailable: {_err(e)}"
