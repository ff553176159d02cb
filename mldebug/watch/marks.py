"""Non-finite constants the program writes on purpose, and where they must not go.

A program writes NaN and Inf on purpose: `x[mask] = float('nan')` marks missing values,
`scores.masked_fill(mask, float('-inf'))` masks attention or illegal actions,
`torch.full((n,), float('inf'))` starts a search for a minimum, beam scores start at
-inf, `torch.tensor([1.0, float('nan')])` is a literal. None of that is a stop where it
is written, nor where it flows on (`x * 2`, `cat`, `softmax` of a partly masked row,
`nan_to_num`, `nanmean`). It is a stop where such a value first reaches what it must not,
and the stop points at the line that wrote it (`Violation.file/line`; `reached` says
what it reached):
- a model call: a NaN among the arguments of an outermost module call (an Inf there is
  how an additive attention mask is passed, and stays allowed);
- the loss: a NaN/Inf in the tensor `backward()` starts from;
- a gradient: a NaN/Inf that backward computes from one (seen where backward runs op by
  op: `--watch exact`, a re-run of a flagged call, the loss region's dry run);
- a parameter or its optimizer state: written into one, or left there by a step.
A NaN that an op makes from such Infs (a softmax of a fully masked row) is made there:
a stop, as ever.

Written by the program: an op with a non-finite Python scalar argument (`fill_`,
`masked_fill`, `full`, `new_full`, `index_fill`, `torch.where(c, x, nan)`, `x * nan`),
and the tensor `aten.lift_fresh` makes from Python data when it is a literal: a 0-d
tensor (the value of `x[i] = nan`, `torch.tensor(nan)`), or a `torch.tensor(...)` call
whose argument, in the source at the call, is made of constants only. A tensor read from
a file, made from numpy data or by a DataLoader is not written: a NaN there came in with
the data and stops at the first op that reads it, as ever.

Bookkeeping, on top of the taint (verdict.py): `_marks` holds the `Mark` of each judged
storage whose non-finite values were written on purpose or flow from such a write;
`_nan_marks` those with a NaN. A root call looks its arguments up only while
`_nan_marks` is not empty, the loss only while `_marks` is not: nothing is added to a
step that writes no constant. On a device what the window holds is judged at the read:
an op there that writes a non-finite constant (or reads one marked) sets
`_constant_unread`, and the root calls and losses that follow look again from a judge
of that read (step.py `_call_marks_at_read`, `_loss_marks_at_read`).
"""
from __future__ import annotations

import ast
import dis
import linecache
import os
import torch
from torch import Tensor

from ..core import frames as _frames
from ..core.records import Violation
from ..core.structs import tensors_in
from . import checks as _checks
from .checks import _caller, _checkable, _counts, _isfinite, _summary, gradient_flows
from .native_check import nonfinite as _native_nonfinite
from .ops import LOG_AT_ZERO, MASKS_CAST, MASKS_SUMMED, NAN_FROM_INFS, ZERO_BY_ZERO
from .roots import call_kwargs, in_a_root

# ops whose value made on purpose is a mask, which a model may return (masked logits):
# a stop only where it reaches the loss (ops.MASKS_SUMMED, MASKS_CAST)
_MASK_MAKERS = ("aten.add", "aten._to_copy")
# the hint of a stop where a value an op made on purpose went (its aten name's prefix ->
# its cause and fix, at WHERE the op is)
_LEAVE_OUT = ("leave the masked entries out (torch.where(mask, 0, logp), "
              "torch.special.xlogy), or mask the NaN out (torch.nan_to_num, torch.nansum) "
              "before it goes on")
_MADE_HINTS = (
    (("aten.log",), "{made_by} is -Inf; fix at {where}: clamp the input by an eps "
     "(torch.log(x.clamp_min(1e-12))), or mask the -Inf out (torch.where) before it "
     "reaches the loss, a gradient or a parameter"),
    (("aten.mul",), "0 * -Inf is NaN; fix at {where}: " + _LEAVE_OUT),
    (("aten.sub",), "-Inf - -Inf is NaN; fix at {where}: " + _LEAVE_OUT),
    (("aten.div",), "0 / 0 is NaN; fix at {where}: keep the divisor from 0 (an eps, "
     "clamp(min=...)), or mask the NaN out (torch.where, torch.nan_to_num) before the "
     "model returns it"),
    (("aten.add",), "two masks at the dtype's lowest value summed are -Inf; fix at "
     "{where}: combine the masks with torch.minimum (or as booleans) before adding them, "
     "and keep a fully masked row out of softmax"),
    (("aten._to_copy",), "a mask cast to a dtype that cannot hold it is -Inf; fix at "
     "{where}: write the mask as torch.finfo(dtype).min of the dtype it is used in"),
)


def _made_hint(op: str, made_by: str, where: str) -> str:
    """The hint of a stop where the value that OP (aten name) made on purpose went."""
    return next((text.format(made_by=made_by, where=where) for prefixes, text in _MADE_HINTS
                 if op.startswith(prefixes)), "")


# names whose attribute `nan`/`inf` is a constant in a literal (`math.inf`, `np.nan`)
_CONSTANT_MODULES = frozenset({"math", "np", "numpy", "torch"})
_CONSTANT_NAMES = frozenset({"nan", "inf", "pi", "e"})
_ARRAY_CALLS = frozenset({"array", "asarray", "tensor", "as_tensor", "list", "tuple"})
_literal_cache: dict = {}      # (code, instruction) -> whether the call's data is a literal
_STORE_SUBSCR = dis.opmap["STORE_SUBSCR"]


class Mark:
    """Where a non-finite constant was written. WRITTEN: this is the written value itself
    (what its first reader sees); the values that flow from it carry `flowing()`. Once a
    stop was made of it (`stopped`), what flows from it descends from that stop."""

    __slots__ = ("file", "line", "function", "written", "origin", "_flowing", "_stopped",
                 "made_by", "op")

    def __init__(self, file, line, function, written=True, origin=None, made_by="", op=None):
        self.file, self.line, self.function = file, line, function
        self.written = written
        self.origin = origin or self
        self._flowing = None
        self._stopped = False
        # not a constant written but the op that made it where no gradient flows:
        # 'torch.log of 0' (ops.LOG_AT_ZERO), OP its (aten name, torch name); '' for a
        # constant
        self.made_by, self.op = made_by, op

    def flowing(self) -> "Mark":
        if not self.written:
            return self
        if self._flowing is None:
            self._flowing = Mark(self.file, self.line, self.function, written=False,
                                 origin=self)
        return self._flowing

    @property
    def stopped(self) -> bool:
        return self.origin._stopped

    def stop_made(self) -> None:
        self.origin._stopped = True

    def where(self) -> str:
        return f"{os.path.basename(self.file)}:{self.line}" if self.file else "its line"


def mark_here(frame) -> Mark:
    """A mark at the innermost user line at or above FRAME."""
    return Mark(*_frames.user_location(frame))


class WrittenMarks:
    """Methods of `Watch` for the constants the program writes (state in `Watch._marks`,
    `Watch._nan_marks`)."""

    def _mark_get(self, t):
        """The Mark of `t`'s current non-finite values when they were written on purpose
        or flow from such a write, and no stop was made of them since; else None."""
        if not self._marks:
            return None
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # noqa: BLE001 - no storage: nothing was marked
            return None
        rec = self._marks.get(ptr)
        if rec is None or rec[0]() is None:
            return None
        known = self._taint_get(t)
        if known is None or known[2]:
            return None       # written over since, or a stop was made of it (lineage)
        return rec[2]

    def _known_with_mark(self, t):
        """(has_nan, has_inf, lineage, Mark or None) judged of `t`, or None (`_taint_get`
        with the mark: what the device window keeps of an op's arguments)."""
        known = self._taint_get(t)
        if known is None:
            return None
        return (*known, self._mark_get(t) if self._marks else None)

    def _mark_at(self, address):
        """The Mark last judged of the memory at ADDRESS (its tensor may be gone)."""
        rec = self._marks.get(address) if self._marks else None
        return rec[2] if rec is not None else None

    def _forget_mark(self, ptr) -> None:
        self._marks.pop(ptr, None)
        self._nan_marks.pop(ptr, None)

    # -- the literal: aten.lift_fresh --------------------------------------------------
    def _lifted(self, out):
        """aten.lift_fresh returned OUT, a tensor made from Python data (`torch.tensor`,
        the scalar of `x[i] = v`): one that holds a NaN/Inf and is a literal is a
        constant the program wrote, marked (no stop here). Anything else is left as
        before: judged at the first op that reads it, as come in from outside. (Always
        on the CPU: read here, on every path.)"""
        if not isinstance(out, Tensor) or not out.is_floating_point() or not out.is_cpu \
                or not _checkable(out) or not out.numel():
            return out
        bad = _native_nonfinite(out)
        if bad is None:
            bad = not _isfinite(float(out.detach().double().sum()))
        if not bad:
            return out
        if not _checks.HOST_READS or self._win or self._ledger.holds_tensors():
            self._ledger.keep(out)   # (a window op reading it judges what it holds)
        caller = _caller(2)
        with self._own_ops():
            counts = _counts(out)
        if not _written_in_source(caller, out.dim() == 0):
            if not counts[0] and "inf-all" not in self.break_on:
                # an Inf from Python data (`torch.tensor(biases)`): no stop where it is
                # read, as come in from outside; known as such now, so that a device's
                # read judges an op that read it through a view gone since the same way
                self._taint_add(out, False, True, False)
            return out
        self._taint_add(out, counts[0] > 0, counts[1] + counts[2] > 0, False,
                        mark=mark_here(caller))
        return out

    # -- a value an op makes on purpose ------------------------------------------------
    def _inf_made_on_purpose(self, info, args, kwargs, out, posinf, stage, record, running):
        """What made OUT's Inf from finite inputs on purpose (a Mark's `made_by`), or "":
        two masks at the dtype's lowest value summed, or a mask cast to a dtype that
        cannot hold it (ops.MASKS_SUMMED, MASKS_CAST); log(0) = -inf inside a model where
        no gradient flows (ops.LOG_AT_ZERO); the
        optimizer's own arithmetic on a temporary (RAdam divides by a rectification term
        of 0 and takes the reciprocal), judged by what it leaves in the parameters and the
        state. RUNNING: the op runs now (not judged later from a device window)."""
        if stage == "optimizer":
            return "" if self._holds_state(out) else f"{info.torch_op} in the optimizer's step"
        if not posinf and info.short in MASKS_SUMMED and stage == "forward":
            with self._own_ops():
                summed = _masks_summed(args, kwargs, out)
            return f"{info.torch_op} of two masks at the dtype's lowest value" if summed \
                else ""
        if not posinf and info.short in MASKS_CAST and stage == "forward":
            with self._own_ops():
                cast = _mask_cast(args, out)
            dtype = str(out.dtype).replace("torch.", "")
            return f"the cast to {dtype} of a mask it cannot hold" if cast else ""
        if posinf or info.short not in LOG_AT_ZERO or stage != "forward" or record is None \
                or gradient_flows(out, args, kwargs, running):
            return ""
        self._made_marks = True
        return f"{info.torch_op} of {'-1' if 'log1p' in info.short else '0'}"

    def _nan_made_on_purpose(self, info, args, kwargs, out, nonfinite, stage, record,
                             running):
        """What made OUT's NaN from the Infs of NONFINITE (the judge's rows of its
        inputs) on purpose, or "": 0 * a -Inf written on purpose, or the difference of two,
        where no gradient flows (ops.NAN_FROM_INFS), outside modules or inside a call whose
        output the watch checks as it returns (a module outside the roots returns it
        unseen: made there is a stop); with no Inf among them, 0 / 0 where no gradient
        flows inside such a call (ops.ZERO_BY_ZERO)."""
        if info.short not in (NAN_FROM_INFS if nonfinite else ZERO_BY_ZERO) \
                or stage != "forward" or not all(r.mark for r in nonfinite) \
                or not (nonfinite if record is None else
                        self.exact or in_a_root(self._roots, record)) \
                or gradient_flows(out, args, kwargs, running):
            return ""
        self._made_marks = True
        if not nonfinite:
            return f"{info.torch_op} of 0 by 0 where no gradient flows"
        maker = nonfinite[0].mark
        source = f"of {maker.origin.made_by}" if maker.origin.made_by else "written on purpose"
        what = "0 and the -Inf" if "mul" in info.short else "the -Infs"
        return f"{info.torch_op} of {what} {source} at {maker.where()}"

    # -- where a mark must not go ------------------------------------------------------
    def _check_call_marks(self, module, args, kwargs=None, site=None, backwards=None) -> None:
        """An outermost module call: a NaN written on purpose among its arguments is a
        stop. Called as it starts (its pre-hook), and on a device where the read that
        judges what its arguments hold comes later, from that read (step.py).
        KWARGS None: the call's, read from the frame of the hook. SITE: (file, line,
        function) of the call, when it is not the running user frame's. BACKWARDS: the
        step's backwards when the call ran, when not now (its micro-batch)."""
        if not self._nan_marks:
            return
        if kwargs is None:
            kwargs = call_kwargs(_caller(2))
        if site is None:
            site = _frames.user_location(_caller(2))
        what = f"the model call {type(module).__name__} at {_short(site)}"
        self._marks_reach(tensors_in((args, kwargs)), what, True, backwards)

    def _check_output_marks(self, module, output) -> None:
        """An outermost module call returned (under the full watch: learning the roots,
        `exact`, a re-run): the -Inf a log(0) made inside it where no gradient flowed
        (ops.LOG_AT_ZERO) is a value while it stays inside, a stop once it is returned.
        The -Inf of two masks summed, or of a mask cast (ops.MASKS_SUMMED, MASKS_CAST),
        is returned as masked logits are: a mask like one written, a stop where it
        reaches the loss."""
        site = _frames.user_location(_caller(2))
        what = f"the output of the model call {type(module).__name__} at {_short(site)}"
        made = [t for t in tensors_in(output) if t.is_floating_point()
                and (m := self._mark_get(t)) is not None and m.origin.made_by
                and not m.origin.op[0].startswith(_MASK_MAKERS)]
        self._marks_reach(made, what, False, None)

    def _check_loss_marks(self, roots, site, backwards=None) -> None:
        """`backward()` starts from ROOTS: a NaN/Inf written on purpose in one is a stop.
        Called as backward starts, and on a device from the backward's judge at the read
        (BACKWARDS: the step's backwards before it, its micro-batch)."""
        if not self._marks:
            return
        what = f"the loss, whose backward starts at {_short(site)}" if site[0] else "the loss"
        self._marks_reach(roots, what, False, backwards)

    def _marks_reach(self, tensors, what, nan_only, backwards) -> bool:
        """A stop if one of TENSORS holds a value written on purpose (a NaN, with
        NAN_ONLY); True when one was reported. BACKWARDS: as `_micro_by_op`'s."""
        for t in tensors:
            if not isinstance(t, Tensor) or not t.is_floating_point():
                continue
            mark = self._mark_get(t)
            if mark is None or mark.stopped:
                continue
            with self._own_ops():
                counts = _counts(t)
            if nan_only and not counts[0]:
                continue
            if sum(counts) and self._report_mark(mark, what, t, counts, backwards):
                return True
        if nan_only and self._nan_marks:   # (none reached: drop those whose memory is gone)
            self._nan_marks = {k: r for k, r in self._nan_marks.items() if r() is not None}
        return False

    def _report_mark(self, mark, what, value, counts, backwards) -> bool:
        """MARK's value reached WHAT (a model call, the loss: forward): a stop at the line
        that wrote it (the pause stays in the frame running now). The value is then known
        as a stop's: what flows on from it is no new stop."""
        kind = "nan" if counts[0] else "inf"
        if kind not in self.break_on:
            return False
        self._taint_add(value, counts[0] > 0, counts[1] + counts[2] > 0, True)
        v = self._mark_violation(mark, what, value, counts, "forward",
                                 frame=_frames.user_frame(_caller(2)), backwards=backwards)
        self._report(v)
        return True

    def _mark_violation(self, mark, what, value, counts, stage, module="", module_type="",
                        param="", frame=None, op="", torch_op="", node="", inputs=(),
                        backwards=None):
        kind = "nan" if counts[0] else "inf"
        noun = "NaN" if kind == "nan" else "Inf"
        mark.stop_made()       # (what flows from it from now on descends from this stop)
        with self._own_ops():
            output = _summary(value) if isinstance(value, Tensor) else None
        made_by = mark.origin.made_by
        if made_by:
            where = mark.where()
            return Violation(
                kind=kind, op=mark.origin.op[0], torch_op=mark.origin.op[1], module=module,
                module_type=module_type, stage=stage, frame=frame, file=mark.file,
                line=mark.line, function=mark.function, nan=counts[0], posinf=counts[1],
                neginf=counts[2], created=True, output=output,
                inputs=list(inputs), param=param, node=node,
                step=self._steps if self._opt_seen else None, reached=what, made_by=made_by,
                micro_batch=self._micro_by_op(stage, backwards),
                text=(f"{made_by} is {'-' if kind == 'inf' and counts[2] else ''}{noun} "
                      f"at {where}: a value on its own (a log-space mask, a temporary), not "
                      f"a stop; it reaches {what}"),
                hint=_made_hint(mark.origin.op[0], made_by, where))
        return Violation(
            kind=kind, op=op, torch_op=torch_op, module=module, module_type=module_type,
            stage=stage, frame=frame, file=mark.file, line=mark.line,
            function=mark.function, nan=counts[0], posinf=counts[1], neginf=counts[2],
            created=False, culprit=f"a {noun} written on purpose at {mark.where()}",
            output=output, inputs=list(inputs), param=param, node=node,
            step=self._steps if self._opt_seen else None, reached=what,
            micro_batch=self._micro_by_op(stage, backwards),
            text=(f"the {noun} written on purpose at {mark.where()} (a non-finite constant "
                  f"the program wrote) reaches {what}; a constant written as a marker or "
                  "a mask must be cleaned (torch.nan_to_num, torch.where) or masked out "
                  "before it reaches a model call, the loss, a gradient or a parameter"))


def _masks_summed(args, kwargs, out) -> bool:
    """Whether every -Inf in OUT, the sum of ARGS, is where both operands are below half
    the lowest value of OUT's dtype (two finfo.min masks summed: ops.MASKS_SUMMED). An
    operand that is gone (judged later, on a device) tells nothing: False."""
    if len(args) < 2 or (kwargs and kwargs.get("alpha", 1) != 1) \
            or not out.is_floating_point():
        return False
    a, b = args[0], args[1]
    if not isinstance(a, Tensor) or not isinstance(b, (Tensor, float, int)):
        return False
    try:
        larger = torch.maximum(a, torch.as_tensor(b, dtype=a.dtype, device=a.device)
                               if not isinstance(b, Tensor) else b)
        if larger.shape != out.shape:
            return False
        return not bool((torch.isneginf(out) & (larger > torch.finfo(out.dtype).min / 2))
                        .any())
    except (RuntimeError, TypeError):
        return False


def _mask_cast(args, out) -> bool:
    """Whether every -Inf in OUT, ARGS[0] cast to a narrower dtype, comes from a value
    below twice the lowest that dtype holds (a mask: ops.MASKS_CAST). An input that is
    gone (judged later, on a device) tells nothing: False."""
    src = args[0] if args else None
    if not isinstance(src, Tensor) or not src.is_floating_point() \
            or not out.is_floating_point() or src.shape != out.shape \
            or torch.finfo(src.dtype).max <= torch.finfo(out.dtype).max:
        return False
    made = torch.isneginf(out)
    return not bool((made & (src.double() > -2 * torch.finfo(out.dtype).max)).any())


def _short(site) -> str:
    file, line, _ = site
    return f"{os.path.basename(file)}:{line}" if file else "its line"


def _written_in_source(frame, scalar: bool) -> bool:
    """Whether the instruction running in FRAME writes its data in the source: the value
    of `x[...] = v` (SCALAR: a Python number; a tensor value was made before), or a
    `torch.tensor(...)` call whose data is a literal: lists, tuples, numbers and named
    constants only (`float('nan')`, `math.inf`, `np.nan`), also inside `np.array(...)`.
    (`torch.from_numpy`, `torch.as_tensor` wrap data made elsewhere: not written.)"""
    if frame is None:
        return False
    code = frame.f_code
    try:
        if code.co_code[frame.f_lasti] == _STORE_SUBSCR:
            return scalar
    except IndexError:
        return False
    key = (code, frame.f_lasti)
    found = _literal_cache.get(key)
    if found is None:
        found = _literal_cache[key] = _literal_at(frame)
        if len(_literal_cache) > 4096:
            _literal_cache.clear()
    return found


def _literal_at(frame) -> bool:
    try:
        positions = frame.f_code.co_positions()     # (Python >= 3.11)
        for _ in range(frame.f_lasti // 2):
            next(positions)
        start, end, col, end_col = next(positions)
    except (AttributeError, StopIteration, ValueError):
        return False
    if None in (start, end, col, end_col):
        return False
    lines = linecache.getlines(frame.f_code.co_filename, frame.f_globals)[start - 1:end]
    if not lines:
        return False
    raw = [line.encode("utf-8") for line in lines]    # (offsets count UTF-8 bytes)
    raw[-1] = raw[-1][:end_col]
    raw[0] = raw[0][col:]
    try:
        node = ast.parse(b"".join(raw).decode("utf-8").strip(), mode="eval").body
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return False
    if not isinstance(node, ast.Call) or _call_name(node) != "tensor":
        return False
    data = node.args[0] if node.args else next(
        (k.value for k in node.keywords if k.arg == "data"), None)
    return data is not None and _constant(data)


def _constant(node) -> bool:
    if isinstance(node, ast.Constant):
        return isinstance(node.value, (int, float, bool))
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(_constant(e) for e in node.elts)
    if isinstance(node, ast.UnaryOp):
        return _constant(node.operand)
    if isinstance(node, ast.BinOp):
        return _constant(node.left) and _constant(node.right)
    if isinstance(node, ast.Name):
        return node.id in ("nan", "inf")
    if isinstance(node, ast.Attribute):
        return (node.attr in _CONSTANT_NAMES and isinstance(node.value, ast.Name)
                and node.value.id in _CONSTANT_MODULES)
    if isinstance(node, ast.Call):
        name = _call_name(node)
        if name == "float":
            return len(node.args) == 1 and isinstance(node.args[0], ast.Constant)
        if name in _ARRAY_CALLS:
            return len(node.args) == 1 and _constant(node.args[0])
    return False


def _call_name(node) -> str:
    func = node.func
    return func.id if isinstance(func, ast.Name) else (
        func.attr if isinstance(func, ast.Attribute) else "")
