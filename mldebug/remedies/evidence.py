"""The evidence a hint reads (hints.py) that a `Violation` does not carry: gathered once,
at the stop, from the op's live inputs and output (`verdict._judge` calls `gather`
after it has decided to stop), never on a healthy step.

`gather(info, args, kwargs, rows, bad, stage, live)` returns a small JSON-able dict; each
key is present only when it applies:

    producers     {label: [name, [children...]]}: the autograd nodes that made each
                  input, 3 levels deep ('SoftmaxBackward0', 'SubBackward0', ...)
    masked_rows   softmax family: {"input", "dim", "count", "of", "first", "written_at"}:
                  rows along the softmax's dim that are all -inf; `written_at` the line
                  that wrote the -inf, when the program wrote it (marks.py)
    divisor       division: {"input", "zeros", "numel", "first", "scalar", "zero_over_zero"}
    domain        log/sqrt/pow/acos/...: {"input", "outside", "at_edge", "low", "high",
                  "min", "max"}: how many input values lie outside the function's domain
                  [low, high] and how many on its edge
    in_float32    a float16/bfloat16 output that overflowed: {"max", "dtype", "dtype_max"},
                  the op recomputed in float32 (its largest finite |value|)
    targets       nll_loss: {"counted", "total", "ignore_index"}
    reduced       std/var: {"elements", "correction"} per reduced slice
    incoming      backward mul/div: {"zero_at_bad", "bad"}: whether the gradient that
                  reaches the node (its op's input 0) is 0 at every non-finite position
    eigen_gaps    eigh/eig backward: {"equal": pairs of equal eigenvalues, "smallest"}

`optimizer_evidence(optimizer, v, watch)`, read when the stop is reported (hints.py):
{"type", "lr", "eps", "moment", "moment_zeros"}: the optimizer's group of the stop's
parameter and the zeros of its second moment.

Everything is computed under `no_grad` on the values as they are (copies only for the
float32 recomputation), each piece in its own try: evidence that cannot be read is left
out, and gathering never raises.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

DEPTH = 3                  # levels of producers kept
MAX_RECOMPUTE = 1 << 24    # output elements (x4: input) above which float32 is not tried

SOFTMAX_OPS = frozenset({"_softmax", "softmax", "_log_softmax", "log_softmax",
                         "_safe_softmax"})
DIVISION_OPS = frozenset({"div", "div_", "true_divide", "true_divide_", "reciprocal",
                          "reciprocal_"})
# op -> (lower edge, upper edge, whether the edge itself is outside): values outside
# [low, high] (or at an open edge) make NaN/Inf
DOMAIN = {
    "log": (0.0, None), "log2": (0.0, None), "log10": (0.0, None), "log_": (0.0, None),
    "log1p": (-1.0, None), "sqrt": (0.0, None), "sqrt_": (0.0, None), "rsqrt": (0.0, None),
    "acos": (-1.0, 1.0), "asin": (-1.0, 1.0), "atanh": (-1.0, 1.0), "acosh": (1.0, None),
    "pow": (0.0, None), "pow_": (0.0, None), "lgamma": (0.0, None), "digamma": (0.0, None),
}
STD_OPS = frozenset({"std", "var", "std_mean", "var_mean"})
NLL_OPS = frozenset({"nll_loss_forward", "nll_loss2d_forward", "nll_loss", "nll_loss_nd"})
# what an optimizer divides by: its second-moment state
SECOND_MOMENTS = ("exp_avg_sq", "square_avg", "sum", "acc_delta")
EIGEN_NODES = {"LinalgEighBackward0": "_saved_eigenvalues",
               "LinalgEigBackward0": "_saved_eigenvalues",
               "LinalgSvdBackward0": "_saved_S", "SvdBackward0": "_saved_S"}


def gather(info, args, kwargs, rows, bad, stage, live) -> dict:
    """Evidence for a stop at the op of INFO (an `ops.OpInfo`) whose output BAD went
    non-finite. ROWS: `verdict._judge`'s of its inputs (`verdict.Input`: label, value,
    mark, ...). STAGE: 'forward', 'backward', ... LIVE: the op runs now (not judged at a
    later read): a backward op's autograd node is current."""
    short, func = info.short, getattr(info, "func", None)
    inputs = [(r.label, r.value, r.mark) for r in rows]
    live_node = torch._C._current_autograd_node() if live and stage == "backward" else None
    found: dict = {}
    tensors = [(label, value, mark) for label, value, mark in inputs
               if isinstance(value, Tensor)]
    with torch.no_grad():
        for name, piece in (("producers", lambda: _producers(tensors)),
                            ("masked_rows", lambda: _masked_rows(short, args, kwargs, tensors)),
                            ("divisor", lambda: _divisor(short, args, inputs, bad)),
                            ("domain", lambda: _domain(short, args, tensors)),
                            ("in_float32", lambda: _in_float32(short, func, args, kwargs, bad)),
                            ("targets", lambda: _targets(short, args, kwargs)),
                            ("reduced", lambda: _reduced(short, args, kwargs)),
                            ("incoming", lambda: stage == "backward"
                             and _incoming(short, args, bad)),
                            ("eigen_gaps", lambda: _eigen_gaps(live_node))):
            try:
                value = piece()
            except Exception:  # noqa: BLE001 - evidence that cannot be read is left out
                value = None
            if value:
                found[name] = value
    return found


# -- who made the inputs ----------------------------------------------------------------
def _tree(node, depth):
    if node is None:
        return None
    children = []
    if depth > 1:
        for child, _ in getattr(node, "next_functions", ()) or ():
            sub = _tree(child, depth - 1)
            if sub is not None and sub[0] != "AccumulateGrad":
                children.append(sub)
    return [node.name(), children]


def _producers(tensors):
    return {label: tree for label, value, _ in tensors
            if (tree := _tree(value.grad_fn, DEPTH)) is not None}


# -- softmax of a fully masked row --------------------------------------------------------
def _masked_rows(short, args, kwargs, tensors):
    if short not in SOFTMAX_OPS or not tensors:
        return None
    label, x, mark = tensors[0]
    if not x.is_floating_point() or x.dim() == 0 or x.numel() == 0:
        return None
    dim = args[1] if len(args) > 1 and isinstance(args[1], int) else kwargs.get("dim", -1)
    dim = dim % x.dim()
    all_masked = torch.isneginf(x).all(dim=dim)
    count = int(all_masked.sum())
    if not count:
        return None
    first = [int(i) for i in all_masked.nonzero()[0].tolist()]
    found = {"input": label, "dim": dim, "count": count, "of": all_masked.numel(),
             "first": first}
    if mark is not None and getattr(mark, "file", ""):
        found["written_at"] = mark.where()
    return found


# -- division by zero -------------------------------------------------------------------
def _divisor(short, args, inputs, bad):
    if short not in DIVISION_OPS or not inputs:
        return None
    if short.startswith("reciprocal"):
        (label, d, _), numerator = inputs[0], None
    elif len(inputs) > 1 and len(args) > 1:
        (label, d, _), numerator = inputs[1], args[0]
    else:
        return None
    if not isinstance(d, Tensor):
        if isinstance(d, (int, float)) and d == 0:
            return {"input": label, "scalar": float(d), "zeros": 1, "numel": 1}
        return None
    zero = d == 0
    zeros = int(zero.sum())
    if not zeros:
        return None
    found = {"input": label, "zeros": zeros, "numel": d.numel(),
             "first": [int(i) for i in zero.nonzero()[0].tolist()] if d.dim() else []}
    if isinstance(numerator, Tensor):
        try:
            shape = torch.broadcast_shapes(numerator.shape, d.shape)
            both = (numerator.expand(shape) == 0) & zero.expand(shape)
            found["zero_over_zero"] = int(both.sum())
        except RuntimeError:
            pass
    return found


# -- outside a function's domain ----------------------------------------------------------
def _domain(short, args, tensors):
    edges = DOMAIN.get(short)
    if edges is None or not tensors:
        return None
    label, x, _ = tensors[0]
    if not x.is_floating_point() or x.numel() == 0:
        return None
    if short.startswith("pow"):
        exponent = args[1] if len(args) > 1 else None
        if not isinstance(exponent, (int, float)) or float(exponent).is_integer():
            return None      # only a fractional power of a negative number is NaN
    low, high = edges
    outside, at_edge = x < low, x == low
    if high is not None:
        outside, at_edge = outside | (x > high), at_edge | (x == high)
    found = {"input": label, "outside": int(outside.sum()), "at_edge": int(at_edge.sum()),
             "low": low, "high": high}
    finite = x[torch.isfinite(x)]
    if finite.numel():
        found["min"], found["max"] = float(finite.min()), float(finite.max())
    return found


# -- float16 overflow -------------------------------------------------------------------
def _in_float32(short, func, args, kwargs, bad):
    if not isinstance(bad, Tensor) or bad.dtype not in (torch.float16, torch.bfloat16):
        return None
    if not bool(torch.isinf(bad).any()) or bad.numel() > MAX_RECOMPUTE or any(
            isinstance(a, Tensor) and a.numel() > 4 * MAX_RECOMPUTE for a in args):
        return None              # (a float32 copy of a large input costs too much memory)
    if func is None or short.endswith("_"):
        return None                 # an in-place op: its input is its output now

    def wide(x):
        if isinstance(x, Tensor) and x.dtype in (torch.float16, torch.bfloat16):
            return x.float()
        if isinstance(x, (list, tuple)):
            return type(x)(wide(y) for y in x)
        return x

    out = func(*wide(tuple(args)), **{k: wide(v) for k, v in (kwargs or {}).items()})
    if isinstance(out, (list, tuple)):
        out = next((o for o in out if isinstance(o, Tensor)), None)
    if not isinstance(out, Tensor) or not out.is_floating_point():
        return None
    finite = out[torch.isfinite(out)]
    if not finite.numel():
        return None
    return {"max": float(finite.abs().max()), "dtype": str(bad.dtype).replace("torch.", ""),
            "dtype_max": float(torch.finfo(bad.dtype).max)}


# -- cross-entropy with nothing to count --------------------------------------------------
def _targets(short, args, kwargs):
    if short not in NLL_OPS or len(args) < 2 or not isinstance(args[1], Tensor):
        return None
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    target = args[1]
    return {"counted": int((target != ignore).sum()), "total": target.numel(),
            "ignore_index": int(ignore)}


# -- std/var of too few elements ----------------------------------------------------------
def _reduced(short, args, kwargs):
    if short not in STD_OPS or not args or not isinstance(args[0], Tensor):
        return None
    x = args[0]
    dims = args[1] if len(args) > 1 else kwargs.get("dim")
    if dims is None:
        elements = x.numel()
    else:
        dims = [dims] if isinstance(dims, int) else list(dims)
        elements = math.prod(x.shape[d] for d in dims) if dims else x.numel()
    correction = kwargs.get("correction", 1)
    if correction is None:
        correction = 1
    unbiased = kwargs.get("unbiased")
    if unbiased is False:
        correction = 0
    return {"elements": int(elements), "correction": float(correction)}


# -- a zero gradient through an infinite derivative -----------------------------------
def _incoming(short, args, bad):
    if short not in ("mul", "div", "mul_", "div_") or len(args) < 2:
        return None
    grad = args[0]
    if not isinstance(grad, Tensor) or not isinstance(bad, Tensor):
        return None
    wrong = ~torch.isfinite(bad)
    count = int(wrong.sum())
    if not count:
        return None
    zero = torch.broadcast_to(grad == 0, bad.shape) if grad.shape != bad.shape else grad == 0
    return {"zero_at_bad": bool(zero[wrong].all()), "bad": count}


# -- repeated eigenvalues ------------------------------------------------------------------
def _eigen_gaps(node):
    if node is None:
        return None
    saved = EIGEN_NODES.get(node.name())
    if saved is None:
        return None
    values = getattr(node, saved, None)
    if not isinstance(values, Tensor) or values.numel() < 2:
        return None
    values = values.detach().real if values.is_complex() else values.detach()
    ordered = values.sort(dim=-1).values
    gaps = (ordered[..., 1:] - ordered[..., :-1]).abs()
    return {"equal": int((gaps == 0).sum()), "smallest": float(gaps.min())}


# -- the optimizer's group and state -------------------------------------------------------
def optimizer_evidence(optimizer, v, watch) -> Optional[dict]:
    """The optimizer's type, lr, eps and the zeros of its second moment for the stop's
    parameter (its first group when the stop is not about one)."""
    if optimizer is None:
        return None
    groups = list(getattr(optimizer, "param_groups", ()))
    if not groups:
        return None
    group, param = groups[0], None
    if v.param and watch is not None:
        for g in groups:
            for p in g.get("params", ()):
                if param is None and watch._names.param(p, optimizer) == v.param:
                    group, param = g, p
    found = {"type": type(optimizer).__name__}
    for key in ("lr", "eps"):
        if isinstance(group.get(key), (int, float)):
            found[key] = float(group[key])
    state = getattr(optimizer, "state", {}).get(param, {}) if param is not None else {}
    for key in SECOND_MOMENTS:
        moment = state.get(key)
        if moment is not None and hasattr(moment, "numel"):
            found["moment"], found["moment_zeros"] = key, int((moment == 0).sum())
            if found.get("eps") and moment.is_floating_point():
                # (eps as the step adds it, in the state's dtype: 1e-8 is 0 in float16)
                found["dtype"] = str(moment.dtype).replace("torch.", "")
                found["eps_in_dtype"] = float(torch.tensor(found["eps"], dtype=moment.dtype))
            break
    return found


def strict(value):
    """VALUE with every non-finite float written as a string ('inf', 'nan'): the report
    is strict JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value
