"""Per-OpOverload decisions of the watch, computed once per overload and cached.

The dispatch mode's hot path does one dict lookup per op and reads these slots; nothing
here is evaluated per call.
"""
from __future__ import annotations

import fnmatch
import math

import torch

_increment_version = torch._C._increment_version

# Ops that hand out uninitialized memory (may hold NaN on healthy programs) or only
# change metadata/storage: never checked.
UNINITIALIZED = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "empty_permuted", "resize_", "resize_as_", "set_", "_local_scalar_dense",
    "_resize_output_", "record_stream",
})
SKIPPED_NAMESPACES = frozenset({"profiler"})
# Collectives run asynchronously: the tensor an all-gather or all-reduce returns is filled
# by the backend later, and is the program's only after `wait_tensor` (FSDP2's
# all_gather_into_tensor: its buffer read at once held uninitialized NaN bits, a false stop
# in a 2-rank job). Never checked when made; `wait_tensor`'s output is, as any op's.
ASYNC_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "_c10d_functional_autograd",
                                         "c10d"})
# Ops that make a collective's buffer: FSDP2's all_gather_copy_in copies this rank's shard
# into a buffer whose other ranks' parts hold uninitialized memory until the all-gather
# fills them (read at once: NaN bits now and then, a false stop in a 2-rank job's
# backward). Not checked; what is copied out of the buffer after the gather is.
COLLECTIVE_BUFFERS = frozenset({("fsdp", "all_gather_copy_in")})

# Ops that cannot make a NaN or an Inf from finite inputs, nor a NaN from Infs: their
# outputs are copies, selections or constants of their inputs (relu, max-pool, clone,
# cat, ...). While no non-finite value has been judged yet (`Watch._taint` empty) their
# outputs need no check: a NaN/Inf that merely passes through them is caught at the next
# checked op that reads it, as "came in from outside" — what it is. Once something was
# judged they are checked again, so that what flows on keeps its lineage.
# Not here on purpose: embedding/index/gather (a NaN from outside is best reported where
# it is looked up, naming the weight), native_dropout (x * 1/(1-p) can overflow), ops
# that sum (max-pool backward, scatter_add, index_put, embedding backward), softmax
# (finite → finite, but -inf → NaN must be judged where it happens).
SAFE_ALWAYS = frozenset({
    # copies and aliases
    "clone", "_unsafe_view", "alias", "detach_copy", "flip", "roll",
    "repeat", "select_backward", "slice_backward", "diagonal_backward",
    "triu", "tril", "triu_", "tril_",
    # selections
    "relu", "relu_", "threshold_backward", "max_pool1d", "max_pool2d", "max_pool3d",
    "max_pool2d_with_indices", "max_pool3d_with_indices", "adaptive_max_pool2d",
    "adaptive_max_pool3d", "amax", "amin", "sort", "topk", "kthvalue", "median",
    "nanmedian", "msort", "cummax", "cummin",
    # sign changes
    "neg", "neg_", "abs", "abs_", "sign", "sign_", "sgn", "sgn_",
    # constants 0/1
    "zero_", "zeros", "zeros_like", "ones", "ones_like", "new_zeros", "new_ones",
})
# Several float inputs, type promotion: safe unless the output is a low-precision
# float (an int64 input promoted to float16 can overflow): checked then.
SAFE_PROMOTING = frozenset({
    "cat", "stack", "maximum", "minimum", "fmax", "fmin", "max", "min",
})
SAFE_OVERLOADS_PROMOTING = frozenset({"aten.clamp.Tensor", "aten.where.self"})
# Safe while every scalar argument is finite (and |s| < 1e38: fits float32), and the
# output is not a low-precision float (1e5 into float16 is an Inf). A NaN or Inf
# written as a constant (fill_(nan), full(inf), masked_fill(-inf)) is always checked.
SAFE_SCALARS = frozenset({
    "clamp", "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_",
    "hardtanh", "hardtanh_", "hardtanh_backward", "threshold", "threshold_",
    "fill", "fill_", "full", "full_like", "new_full", "scalar_tensor", "masked_fill",
    "masked_fill_", "where", "constant_pad_nd",
})
SCALAR_OVERLOADS_EXCLUDED = frozenset({
    "aten.masked_fill.Tensor", "aten.masked_fill_.Tensor", "aten.fill.Tensor",
    "aten.fill_.Tensor", "aten.where.default", "aten.clamp.Tensor", "aten.clamp_.Tensor",
    "aten.clamp_min.Tensor", "aten.clamp_min_.Tensor", "aten.clamp_max.Tensor",
    "aten.clamp_max_.Tensor",
})
# Ops whose scalar argument is a value they write (`fill_(nan)`, `masked_fill(m, -inf)`,
# `full((n,), inf)`, `torch.where(c, x, nan)` through scalar_tensor, `F.pad(value=-inf)`):
# a non-finite one is a constant the program writes on purpose (marks.py), not a stop
# where it is written. (Arithmetic with a non-finite scalar, `x * nan`, is not here.)
CONSTANT_WRITERS = frozenset({
    "fill", "fill_", "masked_fill", "masked_fill_", "full", "full_like", "new_full",
    "scalar_tensor", "index_fill", "index_fill_", "constant_pad_nd",
})
# Ops whose outputs after the first are workspaces for their backward, partly
# uninitialized: `_ctc_loss`'s log_alpha is `empty` memory filled only up to each
# sample's lengths. Only the first output is a value.
WORKSPACE_OUTPUTS = frozenset({"_ctc_loss"})
# log(0) = -inf inside a model's forward where no gradient flows through it: a value the
# model makes on purpose (T5's relative-position buckets take the log of a distance of 0
# and cast it to an integer; a log-space mask), judged as a constant written (marks.py):
# a stop where it reaches the loss, a gradient or a parameter, or makes a NaN. Where a
# gradient flows its derivative is infinite, and in the program's own lines (a loss, a
# script) log(0) is the bug it usually is: a stop where it is made.
LOG_AT_ZERO = frozenset({"log", "log_", "log2", "log2_", "log10", "log10_", "log1p",
                         "log1p_"})
# 0 * -inf and -inf - -inf = NaN where no gradient flows, the -inf written on purpose (a
# masked logit's log-probability times its probability 0: the entropy of typical
# sampling, then `nansum`; `torch.where(p > 0, p * logp, 0)`; the difference of two
# masked log-probabilities in torch.distributions' KL of two Categoricals, then
# overwritten): a value made on purpose as well. Where a gradient flows its derivative
# is NaN: a stop where it is made.
NAN_FROM_INFS = frozenset({"mul", "mul_", "sub", "sub_"})
# 0 / 0 = NaN inside a model where no gradient flows, from finite values: a relative gap
# `(max - s) / max(|s|, max)` of a row of zeros (PhiMoE's sparsemixer router, on a padding
# token), only compared with a threshold then (NaN > eps is False: not masked). Judged as
# a value made on purpose (marks.py): a stop where it is returned from the model, reaches
# the loss, a gradient or a parameter, naming the division's line. Where a gradient
# flows, or in the program's own lines, 0/0 is a stop where it is made.
ZERO_BY_ZERO = frozenset({"div", "div_"})
# Two additive masks summed, each at the dtype's lowest value (finfo.min, as transformers
# writes them: a causal mask plus a padding mask, GPT-Neo's `where(causal, w, min)` plus
# the attention mask): their sum overflows to -inf, the same masked entry as either. A
# value made on purpose wherever a gradient flows (the derivative of a sum is 1), judged
# as a constant written (marks.py) when every -inf it makes is where both operands are
# below half the dtype's lowest value: a softmax of a fully masked row then makes a NaN,
# a stop there.
MASKS_SUMMED = frozenset({"add", "add_"})
# A mask far below what a narrower dtype holds, cast to it (-1e6 or -1e10 written in
# float32, cast to float16 for a softmax: Funnel's `softmax(..., dtype=float16)`,
# LongT5's `.type(scores.dtype)`): -inf, the same masked entry. Judged as a constant
# written when every -inf the cast makes comes from a value below twice the lowest the
# narrower dtype holds (an activation that overflows by rounding near it stays a stop).
MASKS_CAST = frozenset({"_to_copy"})
# Dtype conversions that cannot overflow: (source, destination) with destination
# floating. Same dtype is always safe; float16/bfloat16/float8 DOWNcasts are not.
_F8 = tuple(d for d in (getattr(torch, n, None) for n in (
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")) if d is not None)
SAFE_CASTS = frozenset(
    [(s, d) for s in (torch.bool, torch.uint8, torch.int8, torch.int16)
     for d in (torch.float16, torch.bfloat16, torch.float32, torch.float64)]
    + [(s, d) for s in (torch.int32, torch.int64) + tuple(
        d for d in (getattr(torch, n, None) for n in ("uint16", "uint32", "uint64"))
        if d is not None)
       for d in (torch.bfloat16, torch.float32, torch.float64)]
    + [(s, d) for s in _F8 for d in (torch.float16, torch.bfloat16, torch.float32,
                                     torch.float64)]
    + [(torch.float16, torch.bfloat16), (torch.float16, torch.float32),
       (torch.float16, torch.float64), (torch.bfloat16, torch.float32),
       (torch.bfloat16, torch.float64), (torch.float32, torch.float64)])
_isfinite_number = math.isfinite


def finite_scalars(args, kwargs) -> bool:
    """Every float/int argument finite and within ±1e38 (fits float32)."""
    for a in args:
        c = a.__class__
        if (c is float or c is int) and not -1e38 < a < 1e38:
            return False
    if kwargs:
        for a in kwargs.values():
            c = a.__class__
            if (c is float or c is int) and not -1e38 < a < 1e38:
                return False
    return True


def _number(x) -> bool:
    c = x.__class__
    return c is float or c is int


def mul_by_small(args, kwargs) -> bool:
    """x * s with 0 < |s| <= 1: |x * s| <= |x| (no overflow; never 0 * inf)."""
    return (len(args) == 2 and not kwargs and _number(args[1])
            and 0 < abs(args[1]) <= 1)


def div_by_large(args, kwargs) -> bool:
    """x / s with 1 <= |s| < inf: |x / s| <= |x|."""
    return (len(args) == 2 and not kwargs and _number(args[1])
            and 1 <= abs(args[1]) < math.inf)


def add_small(args, kwargs) -> bool:
    """x + alpha * s with |alpha * s| <= 1: rounds back to at most the largest finite
    value of any float dtype (the gap below it is far wider than 1)."""
    if len(args) != 2 or not _number(args[1]) or not abs(args[1]) <= 1:
        return False
    if kwargs:
        alpha = kwargs.get("alpha", 1)
        if len(kwargs) > 1 or not _number(alpha) or not abs(alpha) <= 1:
            return False
    return True


# op name -> guard: safe only with a bounded Python scalar as the second argument (the
# optimizers' `exp_avg_sq.mul_(beta2)`, `param.mul_(1 - lr * wd)`, `denom.add_(eps)`,
# attention's `q * scale`, a mean's backward `grad / n`)
SAFE_BOUNDED = {}
for _op in ("mul", "mul_"):
    for _ov in ("Tensor", "Scalar"):
        SAFE_BOUNDED[f"aten.{_op}.{_ov}"] = mul_by_small
for _op in ("div", "div_"):
    for _ov in ("Tensor", "Scalar"):
        SAFE_BOUNDED[f"aten.{_op}.{_ov}"] = div_by_large
for _op in ("add", "add_", "sub", "sub_"):
    for _ov in ("Tensor", "Scalar"):
        SAFE_BOUNDED[f"aten.{_op}.{_ov}"] = add_small


def widening_to_copy(args, kwargs) -> bool:
    """_to_copy to the same or a wider floating dtype (a cast that cannot overflow)."""
    dtype = kwargs.get("dtype") if kwargs else None
    if dtype is None:
        return True
    src = args[0].dtype if args and isinstance(args[0], torch.Tensor) else None
    return src is dtype or (src, dtype) in SAFE_CASTS


def widening_copy_(args, kwargs) -> bool:
    """copy_(self, src): src's dtype the same as self's or narrower."""
    if len(args) < 2 or not isinstance(args[1], torch.Tensor):
        return False
    src, dst = args[1].dtype, args[0].dtype
    return src is dst or (src, dst) in SAFE_CASTS


class OpInfo:
    """What the watch needs to know about one overload."""

    __slots__ = ("name", "short", "skip", "mutated", "argnames", "torch_op",
                 "op", "func", "safe", "guard", "promote", "prov", "lifted", "writes")

    def __init__(self, func):
        self.name = str(func)                         # 'aten.log.default'
        self.op = getattr(func, "_op", func)          # the C++ callable: skips __call__
        packet = getattr(func, "overloadpacket", None)
        self.short = getattr(packet, "__name__", self.name.split(".")[-2 if "." in self.name else 0])
        schema = getattr(func, "_schema", None)
        arguments = list(schema.arguments) if schema is not None else []
        self.argnames = tuple(a.name for a in arguments if not a.kwarg_only)
        # (position or name, schema name) of every argument the op writes to
        mutated = []
        positional = 0
        for a in arguments:
            if a.alias_info is not None and a.alias_info.is_write:
                mutated.append((a.name if a.kwarg_only else positional, a.name))
            if not a.kwarg_only:
                positional += 1
        self.mutated = tuple(mutated)
        returns_tensor = schema is None or any("Tensor" in str(r.type) for r in schema.returns)
        namespace = getattr(func, "namespace", "aten")
        self.skip = bool(
            getattr(func, "is_view", False)
            or namespace in SKIPPED_NAMESPACES
            or (namespace in ASYNC_COLLECTIVE_NAMESPACES and self.short != "wait_tensor")
            or (namespace, self.short) in COLLECTIVE_BUFFERS
            or self.short in UNINITIALIZED
            or (not returns_tensor and not self.mutated)
        )
        self.torch_op = torch_name(self.short)
        # the tensor torch.tensor(...) (or the scalar of `x[i] = v`) makes from Python
        # data: not checked, but a literal holding a NaN/Inf is marked (marks.py)
        self.lifted = self.name == "aten.lift_fresh.default"
        # its scalar argument is a value it writes (CONSTANT_WRITERS)
        self.writes = self.short in CONSTANT_WRITERS
        if self.mutated and self.short.startswith("_foreach_") and self.short.endswith("_"):
            self.op = _moving_versions(self.op, [key for key, _ in self.mutated])
        self._classify()

    def _classify(self):
        """Whether the output needs no check while nothing non-finite was judged.

        safe: 0 check, 1 no check, 2 no check when `guard(args, kwargs)` holds;
        promote: checked anyway when the (single Tensor) output is a low-precision float;
        prov: still record the backward provenance (its backward op can overflow)."""
        self.safe, self.guard, self.promote, self.prov = 0, None, False, False
        if self.skip:
            return
        short, name = self.short, self.name
        if not name.startswith("aten."):
            return
        in_place = short.endswith("_") and not short.endswith("__")
        if self.mutated and not in_place:
            return       # .out overloads: the out tensor's dtype may be narrower
        if short in SAFE_ALWAYS:
            self.safe = 1
            self.prov = short.startswith(("max_pool", "adaptive_max_pool"))
        elif name in SAFE_OVERLOADS_PROMOTING or (short in SAFE_PROMOTING and
                                                  name not in SCALAR_OVERLOADS_EXCLUDED):
            self.safe, self.promote = 1, True
        elif short in SAFE_SCALARS and name not in SCALAR_OVERLOADS_EXCLUDED:
            self.safe, self.guard, self.promote = 2, finite_scalars, True
        elif name in SAFE_BOUNDED:
            # promote: an int64 tensor times 0.5 in a float16 default dtype can overflow
            self.safe, self.guard, self.promote = 2, SAFE_BOUNDED[name], True
        elif name == "aten._to_copy.default":
            self.safe, self.guard, self.prov = 2, widening_to_copy, True
        elif name in ("aten.copy_.default", "aten.copy.default"):
            self.safe, self.guard, self.prov = 2, widening_copy_, True


def _moving_versions(op, written):
    """OP, an in-place foreach op writing the tensor lists at WRITTEN (positions or
    names), run as without a dispatch mode. Under any mode torch's CPU foreach kernels
    leave the version counters of what they write where they were (plain torch moves
    each once; its CUDA kernels move them themselves): autograd would then miss the write
    to a tensor saved for backward and compute a wrong gradient where plain torch raises
    "modified by an inplace operation" (a GAN's optimizer step between two backwards).
    Moved once here when the op did not."""
    def run(*args, **kwargs):
        lists = []
        for key in written:
            xs = args[key] if isinstance(key, int) and key < len(args) else (
                kwargs.get(key) if isinstance(key, str) else None)
            if isinstance(xs, (list, tuple)) and xs:
                lists.append((xs, _version_of(xs)))
        out = op(*args, **kwargs)
        for xs, before in lists:
            if before is not None and _version_of(xs) == before:
                _increment_version(xs)
        return out
    return run


def _version_of(tensors):
    """(index, version) of the first of TENSORS with a version counter, or None
    (inference tensors have none; `_increment_version` leaves them alone)."""
    for i, x in enumerate(tensors):
        try:
            return i, x._version
        except (RuntimeError, AttributeError):
            continue
    return None


def matches(patterns, names) -> bool:
    for pattern in patterns:
        for name in names:
            if name and fnmatch.fnmatchcase(name, pattern):
                return True
    return False


def torch_name(short: str) -> str:
    """Best-effort torch-level name derived from the aten name ('log' → 'torch.log').

    Derived, not observed: `F.linear` shows as 'torch.addmm', `x @ w` as 'torch.mm'.
    """
    if not short:
        return ""
    if short.startswith("_foreach_") or short.startswith("_fused_"):
        return f"torch.{short}"
    if short.endswith("_") and not short.endswith("__"):
        return f"Tensor.{short}"
    # 'nll_loss_forward', 'nll_loss2d_forward': F.nll_loss (F.cross_entropy calls it)
    forward = short[:-len("_forward")].removesuffix("2d") if short.endswith("_forward") else short
    for name in (short, short.lstrip("_"), forward):
        if hasattr(torch, name):
            return f"torch.{name}"
        if hasattr(torch.nn.functional, name):
            return f"torch.nn.functional.{name}"
        if hasattr(torch.Tensor, name):
            return f"Tensor.{name}"
    return ""


def argument_name(info: OpInfo, key, index=None) -> str:
    """'input 0 (self)', 'input 1 (other[3])', 'argument out'."""
    if isinstance(key, int):
        name = info.argnames[key] if key < len(info.argnames) else ""
        label = f"input {key}"
        if name:
            label += f" ({name}{'' if index is None else f'[{index}]'})"
        elif index is not None:
            label += f" [{index}]"
        return label
    return f"argument {key}{'' if index is None else f'[{index}]'}"
