"""`summary(x)`: one fast, total pass over a tensor or array (see tensor_summary.py
for the record and its format); `nonfinite_counts`, `has_nonfinite`."""
from __future__ import annotations

import math
import warnings
from typing import Optional

import numpy as np

try:
    import torch
except ImportError:  # numpy-only use: summaries keep shape/dtype, stats say unavailable
    torch = None

from ..core.quiet import own_call
from .tensor_summary import HIST_BINS, VALUES_MAX, TensorSummary, _err, keep_source, short_dtype

HIST_EXACT_MAX = 1 << 18   # above this many elements the histogram is of a strided sample ...
HIST_SAMPLE = 1 << 16      # ... of about this many elements
PIECE = 1 << 20            # elements converted to float64 at a time on the piecewise path (CPU:
PIECE_DEVICE = 1 << 24     # ~cache-sized; accelerators: big, as each piece costs kernel launches)
CANCEL = 1e-3              # Σx² - (Σx)²/n below this fraction of Σx²: recompute σ centred


# ---------------------------------------------------------------------------------- summary
@own_call     # (the NaN watch looks away: a look at a NaN is no stop, core/quiet.py)
def summary(x) -> TensorSummary:
    """Summarise a torch tensor, numpy array or numpy scalar. Never raises, never modifies x."""
    try:
        if torch is not None and isinstance(x, torch.Tensor):
            with torch.no_grad():
                s = _tensor_summary(x)
            keep_source(s, x)
            return s
        if isinstance(x, (np.ndarray, np.generic)):
            s = _array_summary(np.asarray(x))
            keep_source(s, x)
            return s
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
