"""The catalogue of NaN/Inf causes: what a stop most likely comes from, in one plain
sentence, and how people usually fix it, with the line to change.

Each cause is a small named rule (`RULES`, tried in order, first match wins) that reads
named evidence and returns `(cause, fix)` (and the line to change when it is not the
stop's), or None:
- the stop itself (`Violation`): op, stage, autograd node, module type, the counts of
  the bad output, the summaries of the inputs, `data`;
- what `evidence.gather` read from the op's live inputs at the stop (masked rows, the
  divisor's zeros, values outside a function's domain, the op in float32, ...);
- what the watch knows when the stop is reported (`explain`): the optimizer's group and
  state, and what higher layers provide (`provide`): the step history's norms.
A rule says only what that evidence shows; when none matches, the stop has no hint.

`gather(...)` (evidence.py) runs in `verdict._judge` once it has decided to stop;
`explain(v, watch)` runs once per stop in `verdict._report`, the one funnel of every
violation: it sets `v.cause` (the rule's name), `v.hint` ('<cause>; fix at file:line:
<remedy>') and completes `v.evidence`. The message (`Violation.headline`), `why`, the
JSON report, the browser view and the VS Code panel all show `v.hint`.

Each cause has a program that makes it and the same program with the remedy applied,
which runs clean under mldebug: tests/programs_hints/, tests/remedies/test_hints.py.
"""
from __future__ import annotations

import contextlib
import io
import linecache
import math
import os
import re
import tokenize
from dataclasses import dataclass
from typing import Callable

from ..core.records import data_text
from .evidence import (DIVISION_OPS, EIGEN_NODES, SOFTMAX_OPS, STD_OPS, optimizer_evidence,
                       strict)
from .evidence import gather  # noqa: F401 - verdict._judge calls it through here

# diverged: a parameter's norm and its gradient's both grown GROWTH times over the
# recorded steps, or its gradient's alone GRAD_GROWTH times (healthy training may grow a
# small initial weight tenfold, rarely its gradient with it)
GROWTH = 10.0
GRAD_GROWTH = 1000.0

# who provides evidence from above the watch: {name: fn(violation) -> dict or None}
PROVIDERS: dict = {}


def provide(name: str, fn: Callable) -> None:
    """A higher layer (the step history) offers evidence under NAME to every stop."""
    PROVIDERS[name] = fn


def withdraw(name: str, fn: Callable) -> None:
    if PROVIDERS.get(name) is fn:
        del PROVIDERS[name]


@dataclass(frozen=True)
class Rule:
    name: str
    reads: str          # the evidence it reads (docs/watch.md lists it)
    test: Callable      # Facts -> (cause, fix[, line]) or None


RULES: list = []


def rule(name: str, reads: str):
    def register(fn):
        RULES.append(Rule(name, reads, fn))
        return fn
    return register


class Facts:
    """What the rules read, named: the stop and its evidence."""

    def __init__(self, v, evidence: dict):
        self.v, self.e = v, evidence
        parts = v.op.split(".")
        self.op = parts[1] if len(parts) > 2 else (parts[-1] if v.op else "")
        self.fn = self.op.lstrip("_").rstrip("_")          # '_softmax' -> 'softmax'
        self.at = f"{os.path.basename(v.file)}:{v.line}" if v.file else ""
        self.output = v.output if hasattr(v.output, "dtype") else None

    @property
    def made(self) -> bool:
        """This op made the NaN/Inf (from finite inputs, or a NaN from Infs)."""
        return bool(self.v.created)

    @property
    def only_inf(self) -> bool:
        return not self.v.nan and bool(self.v.posinf or self.v.neginf)

    def summary(self, label):
        return next((s for name, s in self.v.inputs if name == label and hasattr(s, "dtype")),
                    None)

    def tensor_inputs(self):
        return [(name, s) for name, s in self.v.inputs if hasattr(s, "dtype")]

    def line_text(self) -> str:
        return linecache.getline(self.v.file, self.v.line).strip() if self.v.file else ""


def explain(v, watch=None) -> None:
    """Complete V's evidence, find its cause in the catalogue, set `v.cause`, `v.hint`.
    Never raises: a rule that fails is skipped."""
    if v.kind not in ("nan", "inf") or v.reached:
        return
    evidence = dict(v.evidence or {})
    try:
        with watch._own_ops() if watch is not None else contextlib.nullcontext():
            found = optimizer_evidence(getattr(watch, "_optimizer", None), v, watch)
        if found:
            evidence["optimizer"] = found
    except Exception:  # noqa: BLE001 - evidence that cannot be read is left out
        pass
    for name, fn in list(PROVIDERS.items()):
        try:
            found = fn(v)
        except Exception:  # noqa: BLE001
            found = None
        if found:
            evidence[name] = found
    v.evidence = strict(evidence) or None
    facts = Facts(v, evidence)
    for r in RULES:
        try:
            found = r.test(facts)
        except Exception:  # noqa: BLE001 - a rule that cannot read its evidence: no match
            found = None
        if found:
            cause, fix, *line = found
            where = line[0] if line else facts.at
            v.cause = r.name
            v.hint = f"{cause}; fix{f' at {where}' if where else ''}: {fix}"
            return


# -- formatting -------------------------------------------------------------------------
def _num(x) -> str:
    """65,504; 86,561; 0.0625; 1.2e+20; -3e-08."""
    if x is None or not math.isfinite(x):
        return str(x)
    if x == int(x) and abs(x) < 1e15:
        return f"{int(x):,}"
    if 1e3 <= abs(x) < 1e9:
        return f"{x:,.0f}"
    if 1e-3 <= abs(x) < 1e3:
        return f"{x:.4g}"
    return f"{x:.3g}"


def _index(first) -> str:
    return "[" + ", ".join(str(i) for i in first) + "]" if first else ""


def _of(count: int, total: int, what: str) -> str:
    """'the row', 'all 4 rows', '1 of 8 rows'."""
    if total <= 1:
        return f"the {what}"
    return f"all {total} {what}s" if count == total else f"{count} of {total} {what}s"


# -- the catalogue, in the order the rules are tried -------------------------------------
@rule("nan_in_data", reads="data (the sample it came in with), created")
def _nan_in_data(f):
    if f.made or not f.v.data:
        return None
    what = "NaN" if f.v.kind == "nan" else "Inf"
    return (f"the {what} was in the data before any op made it: {data_text(f.v.data)}",
            "check that sample and the data pipeline (assert torch.isfinite(x).all() in "
            "the Dataset's __getitem__), then fix or drop it", "")


@rule("softmax_all_masked_row", reads="op, masked_rows (rows all -inf along dim), module type")
def _softmax_all_masked_row(f):
    m = f.e.get("masked_rows")
    if f.op not in SOFTMAX_OPS or not m or not f.v.nan:
        return None
    cause = (f"{_of(m['count'], m['of'], 'row')} of {m['input']} along dim {m['dim']} "
             f"{'is' if m['count'] == 1 else 'are'} all -inf (the first at "
             f"{_index(m['first'])}): a softmax over a fully masked row is 0/0, an "
             "all-masked or all-padded sample")
    if "Attention" in f.v.module_type:
        return (cause, "leave samples whose keys are all padding out of the batch (or keep "
                       "one key unmasked); a float mask with torch.finfo(dtype).min instead "
                       "of -inf also keeps the row finite")
    return (cause, "mask with torch.finfo(dtype).min instead of float('-inf'), or handle "
                   "rows with nothing unmasked", m.get("written_at") or f.at)


@rule("cross_entropy_all_ignored", reads="op, targets (counted vs ignore_index)")
def _cross_entropy_all_ignored(f):
    t = f.e.get("targets")
    if not t or t["counted"] or not f.made:
        return None
    return (f"every target is ignore_index ({t['ignore_index']}, {t['total']} of "
            f"{t['total']}): the mean over 0 counted targets is 0/0",
            "skip batches with no counted target, or use reduction='sum' and divide by "
            "(target != ignore_index).sum().clamp(min=1)")


@rule("empty_reduction", reads="op, input shapes")
def _empty_reduction(f):
    reduction = f.fn in ("mean", "nanmean", "var", "std", "var_mean", "std_mean") \
        or f.fn.endswith("_loss") or f.fn.endswith("_loss_forward")
    if not reduction or not f.made or not f.v.nan:
        return None
    empty = next(((name, s) for name, s in f.tensor_inputs() if s.numel == 0), None)
    if empty is None:
        return None
    name, s = empty
    return (f"{f.fn} over an empty tensor ({name} has shape {list(s.shape)}): a mean of "
            "nothing is 0/0",
            "skip it when the selection is empty (if x.numel(): ...), or sum and divide by "
            "max(count, 1)")


@rule("std_of_one_element", reads="op, reduced (elements per slice, correction)")
def _std_of_one_element(f):
    r = f.e.get("reduced")
    if f.op not in STD_OPS or not r or r["elements"] > r["correction"] or not f.made:
        return None
    n, c = r["elements"], r["correction"]
    return (f"{f.fn} with correction={_num(c)} over {n} element{'s' if n != 1 else ''} "
            f"divides by n - correction = {_num(n - c)}",
            "use correction=0 (the population statistic), or skip groups of fewer than "
            f"{_num(c + 1)} elements")


@rule("division_by_zero",
      reads="op, divisor (its zeros, 0/0), the divisor's producers and its text in the line")
def _division_by_zero(f):
    d = f.e.get("divisor")
    if f.op not in DIVISION_OPS or not d or not f.made or f.v.stage == "backward":
        return None
    kind, expression = _divisor_kind(f, d)
    name = f"`{expression}`" if expression else d["input"]
    if "scalar" in d:
        zeros = "is the number 0"
    elif d["numel"] == 1:
        zeros = "is 0"
    else:
        zeros = f"is 0 in {_of(d['zeros'], d['numel'], 'place')}"
        if d.get("first"):
            zeros += f" (the first at {_index(d['first'])})"
    form = "0/0" if d.get("zero_over_zero") else "x/0"
    what, why, fix = _DIVISORS[kind]
    cause = f"a division by zero ({form}): the divisor {name}{what} {zeros}{why}"
    return cause, fix


# kind -> (what the divisor is, why it is 0, the fix)
_DIVISORS = {
    "std": (", a standard deviation,", ": a constant column or a single sample",
            "add an eps to the divisor (/ (std + 1e-8)) or clamp it (std.clamp_min(1e-8)); "
            "use correction=0 for a single sample"),
    "var": (", a variance,", ": a constant column or a single sample",
            "add an eps to the divisor (/ (var + 1e-8)); use correction=0 for a single sample"),
    "norm": (", a norm,", ": an all-zero row",
             "use F.normalize(x, dim=...), which clamps the norm by an eps, or divide by "
             "x.norm(...).clamp_min(1e-12)"),
    "range": (", a range max - min,", ": a constant channel",
              "add an eps to the range (/ (max - min + 1e-8))"),
    "sum": (", a sum,", ": nothing selected, or every entry masked",
            "clamp it (.clamp(min=1) for a count, .clamp_min(1e-12) for a sum of weights), "
            "or handle the rows with nothing left"),
    "scalar": ("", "", "keep the divisor away from 0 (max(t, 1e-5)); for a temperature of 0 "
                       "take the argmax instead of sampling"),
    "other": ("", "", "add an eps to the divisor or clamp it away from 0, or handle the "
                      "case where it is 0"),
}
_PRODUCER_KINDS = (("Std", "std"), ("Var", "var"), ("Norm", "norm"), ("Sum", "sum"),
                   ("Mean", "sum"))
_TEXT_KINDS = (("std", "std"), ("var", "var"), ("norm", "norm"), ("sum", "sum"),
               ("count", "sum"), ("len(", "sum"))


def _divisor_kind(f, d):
    """('std'|'var'|'norm'|'range'|'sum'|'scalar'|'other', the divisor's text or '')."""
    expression = _divisor_text(f.line_text())
    tree = f.e.get("producers", {}).get(d["input"])
    if tree is not None:
        root, children = tree
        for key, kind in _PRODUCER_KINDS:
            if root.startswith(key):
                return kind, expression
        names = " ".join(child[0] for child in children)
        if root.startswith("Sub") and ("Max" in names or "Amax" in names):
            return "range", expression
    text = expression.lower()
    if "max" in text and "min" in text:
        return "range", expression
    for key, kind in _TEXT_KINDS:
        if key in text:
            return kind, expression
    if "scalar" in d:
        return "scalar", expression
    return "other", expression


def _divisor_text(line: str) -> str:
    """The operand right of the one `/` in LINE: `x.std(0)`, `(hi - lo)`, `temperature`;
    '' when the line has no `/` or several."""
    try:
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(line).readline)
                  if t.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT,
                                    tokenize.ENDMARKER, tokenize.INDENT, tokenize.DEDENT)]
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return ""
    slashes = [i for i, t in enumerate(tokens) if t.type == tokenize.OP and t.string == "/"]
    if len(slashes) != 1 or slashes[0] + 1 >= len(tokens):
        return ""
    depth, start, end = 0, tokens[slashes[0] + 1].start[1], None
    for t in tokens[slashes[0] + 1:]:
        if t.type == tokenize.OP and t.string in "([{":
            depth += 1
        elif t.type == tokenize.OP and t.string in ")]}":
            if depth == 0:
                break
            depth -= 1
        elif depth == 0 and t.type == tokenize.OP and t.string != ".":
            break          # the operand ends at the next operator outside brackets
        end = t.end[1]
    return line[start:end] if end is not None else ""


def _is_variance_by_cancellation(tree, depth=3) -> bool:
    """An autograd tree holding E[x²] − E[x]²: a Sub of a Mean (of a square) and a
    square (of a Mean)."""
    if tree is None or depth < 0:
        return False
    name, children = tree
    if name.startswith("Sub") and len(children) == 2:
        kinds = {child[0].split("Backward")[0] for child in children}
        if any(k.startswith("Mean") for k in kinds) and kinds & {"Pow", "Mul"}:
            return True
    return any(_is_variance_by_cancellation(child, depth - 1) for child in children)


@rule("variance_by_cancellation", reads="op, domain (negative inputs), producers")
def _variance_by_cancellation(f):
    d = f.e.get("domain")
    if not d or not d["outside"] or f.fn not in ("sqrt", "rsqrt", "pow", "log"):
        return None
    if not _is_variance_by_cancellation(f.e.get("producers", {}).get(d["input"])):
        return None
    return (f"{f.fn} of a variance computed as E[x²] - E[x]², which cancellation left "
            f"negative ({d['outside']} values, as low as {d.get('min', float('nan')):.4g})",
            "compute the variance with torch.var(x, dim, correction=0) or as "
            "((x - mean)**2).mean(), which cannot go negative")


@rule("log_of_underflowed_probability",
      reads="op or node (log), domain (zeros of the input), the input's producer or range")
def _log_of_underflowed_probability(f):
    if f.v.stage == "backward":
        return _log_backward_of_probability(f)
    d = f.e.get("domain")
    if f.fn not in ("log", "log2", "log10") or not d or d["outside"] or not d["at_edge"]:
        return None
    tree = f.e.get("producers", {}).get(d["input"])
    made_by = tree[0] if tree else ""
    if made_by.startswith("Softmax"):
        what, fix = "a softmax output", ("compute in log space: torch.log_softmax(logits, dim) "
                                         "instead of log(softmax(...)), or F.cross_entropy on "
                                         "the logits")
    elif made_by.startswith("Sigmoid"):
        what, fix = "a sigmoid output", ("compute in log space: F.logsigmoid(x) instead of "
                                         "log(sigmoid(x)), or BCEWithLogitsLoss on the logits")
    elif d.get("min", 0) >= 0 and d.get("max", 0) <= 1 and not made_by:
        what, fix = "probabilities", ("compute in log space (torch.log_softmax, F.logsigmoid, "
                                      "F.cross_entropy or BCEWithLogitsLoss on the logits)")
    else:
        return None
    return (f"log of {what} that underflowed to 0 ({d['at_edge']} zeros in {d['input']})",
            fix)


def _log_backward_of_probability(f):
    """Backward of log(softmax(x)): the derivative 1/x of a probability that underflowed
    (to 0, or to a subnormal like 2e-42) overflows."""
    if not f.v.node.startswith(("LogBackward", "Log2Backward", "Log10Backward")) or not f.made:
        return None
    for name, tree in f.e.get("producers", {}).items():
        what = {"Softmax": "a softmax output", "Sigmoid": "a sigmoid output"}.get(
            tree[0].split("Backward")[0])
        s = f.summary(name)
        if what and s is not None and s.min is not None:
            fix = ("compute in log space: torch.log_softmax(logits, dim) instead of "
                   "log(softmax(...)), or F.cross_entropy on the logits") if "softmax" in what \
                else "compute in log space: F.logsigmoid(x), or BCEWithLogitsLoss on the logits"
            return (f"log of {what} that underflowed (as small as {s.min:.3g}): the "
                    "derivative of log, 1/x, overflows there in backward", fix)
    return None


# forward function -> (its domain in words, the fix)
_DOMAIN_FIXES = {
    "sqrt": ("x >= 0", "clamp the input inside the domain (torch.sqrt(x.clamp_min(1e-12))), "
                       "or reformulate"),
    "rsqrt": ("x > 0", "add an eps inside (torch.rsqrt(x + 1e-12))"),
    "log": ("x > 0", "clamp the input by an eps (torch.log(x.clamp_min(1e-12))), or "
                     "reformulate in log space"),
    "log1p": ("x > -1", "clamp the input (x.clamp_min(-1 + 1e-6))"),
    "acos": ("-1 <= x <= 1", "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6)), "
                             "or use torch.atan2"),
    "asin": ("-1 <= x <= 1", "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "atanh": ("-1 < x < 1", "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "acosh": ("x >= 1", "clamp the input (x.clamp_min(1 + 1e-6))"),
    "pow": ("x >= 0 for a fractional power", "clamp the base (x.clamp_min(1e-12) ** p)"),
    "lgamma": ("x > 0", "clamp the input (x.clamp_min(1e-6))"),
    "digamma": ("x > 0", "clamp the input (x.clamp_min(1e-6))"),
}


@rule("outside_domain", reads="op, domain (inputs outside it or on its edge)")
def _outside_domain(f):
    d = f.e.get("domain")
    known = _DOMAIN_FIXES.get(f.fn) or _DOMAIN_FIXES.get(f.fn.rstrip("0123456789"))
    if not d or known is None or f.v.stage == "backward" or not f.made:
        return None
    domain, fix = known
    if d["outside"]:
        span = f"min {d.get('min'):.8g}, max {d.get('max'):.8g}" if "min" in d else "none finite"
        return (f"{f.fn} of {d['outside']} values outside its domain {domain} ({span})", fix)
    if d["at_edge"]:
        return (f"{f.fn} at the edge of its domain {domain}: {d['at_edge']} values there", fix)
    return None


# backward node -> (the forward function, its derivative, where that is infinite, fix)
_EDGE_NODES = {
    "Sqrt": ("sqrt", "1/(2·sqrt(x))", "x = 0", "add an eps inside the sqrt (torch.sqrt(x + 1e-12))"),
    "Rsqrt": ("rsqrt", "-1/(2·x^1.5)", "x = 0", "add an eps (torch.rsqrt(x + 1e-12))"),
    "Pow": ("pow", "p·x^(p-1)", "x = 0 for p < 1", "add an eps to the base ((x + 1e-12) ** p)"),
    "Acos": ("acos", "-1/sqrt(1 - x²)", "x = ±1",
             "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "Asin": ("asin", "1/sqrt(1 - x²)", "x = ±1",
             "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "Atanh": ("atanh", "1/(1 - x²)", "x = ±1",
              "clamp the input by an eps (x.clamp(-1 + 1e-6, 1 - 1e-6))"),
    "Log": ("log", "1/x", "x = 0", "add an eps (torch.log(x + 1e-12))"),
    "Log2": ("log2", "1/(x·ln 2)", "x = 0", "add an eps (torch.log2(x + 1e-12))"),
    "Log10": ("log10", "1/(x·ln 10)", "x = 0", "add an eps (torch.log10(x + 1e-12))"),
}


def _edge_node(f):
    """(function, its derivative in words, fix) when the stop's node is the backward of a
    function whose derivative is infinite at the edge of its domain."""
    return _EDGE_NODES.get(f.v.node.split("Backward")[0]) if f.v.node else None


_TORCH_NODE = re.compile(r"Backward\d+$")     # torch's formulas: AddmmBackward0


@rule("masked_branch_gradient",
      reads="stage, node, incoming (the gradient is 0 where the NaN is made)")
def _masked_branch_gradient(f):
    incoming = f.e.get("incoming")
    if f.v.stage != "backward" or not f.v.nan or not incoming or not incoming["zero_at_bad"]:
        return None
    fn = f.v.node.split("Backward")[0].lower() if f.v.node else "the op"
    if fn in ("where", "maskedfill", "index", "") or not _TORCH_NODE.search(f.v.node or ""):
        return None     # (an autograd.Function's backward, `SafeNormBackward`: the program's)
    return (f"the gradient reaching {f.v.node} is 0 wherever it makes NaN (0 × Inf or 0/0): "
            f"the value {fn} made there was discarded (torch.where, masked_fill or "
            f"indexing), but its gradient still flows through {fn}, whose derivative "
            "is infinite there",
            f"compute that branch on safe inputs, finite everywhere: e.g. "
            f"torch.{fn}(torch.where(mask, x, 1.0)) inside the torch.where")


@rule("derivative_at_domain_edge", reads="stage, node (the forward function's backward)")
def _derivative_at_domain_edge(f):
    if f.v.stage != "backward" or not f.made:
        return None
    edge = _edge_node(f)
    if edge is None:
        return None
    fn, derivative, edge, fix = edge
    at = "at" if f.e.get("divisor") else "at or near"
    return (f"the derivative of {fn}, {derivative}, is infinite at {edge}, and the forward "
            f"{fn} took an input {at} it", fix)


@rule("eigen_degenerate", reads="node (eigh/eig/svd backward), eigen_gaps")
def _eigen_degenerate(f):
    if f.v.node not in EIGEN_NODES:
        return None
    gaps = f.e.get("eigen_gaps")
    equal = (f": {gaps['equal']} pair{'s are' if gaps['equal'] != 1 else ' is'} equal"
             if gaps and gaps["equal"] else ", and equal ones make it infinite")
    what = "singular values" if "Svd" in f.v.node else "eigenvalues"
    return (f"the gradient of the eigenvectors divides by the gaps between {what}{equal}",
            f"separate the {what} (a tiny jitter: A + 1e-6 * torch.diag(torch.arange(n))), "
            f"or use only the {what} (torch.linalg.eigvalsh / svdvals), whose gradient is "
            "defined")


@rule("loss_scaler_overflow_stepped", reads="stage, loss_scaler (the gradients hold the "
      "overflow GradScaler found)")
def _loss_scaler_overflow_stepped(f):
    if f.v.stage != "optimizer" or not f.e.get("loss_scaler"):
        return None
    return ("the gradients hold the overflow GradScaler found, which `scaler.step()` skips "
            "the step for", "step with scaler.step(optimizer), then scaler.update()")


@rule("optimizer_eps_zero", reads="stage, optimizer (eps, and as the dtype of its state "
      "holds it; zeros of its second moment)")
def _optimizer_eps_zero(f):
    o = f.e.get("optimizer")
    if f.v.stage != "optimizer" or not o or 0 not in (o.get("eps"), o.get("eps_in_dtype")):
        return None
    zeros = (f", and {o['moment_zeros']} entries of its {o['moment']} are 0 (gradients "
             "that were 0)") if o.get("moment_zeros") else ""
    if o["eps"]:       # (not 0 as written: 0 in the state's dtype, 1e-8 in float16)
        return (f"{o['type']}'s eps={_num(o['eps'])} is 0 in {o['dtype']}, the dtype of "
                f"its parameters and state: it divides by the root of its second moment"
                f"{zeros}", "keep the parameters in float32 and train in half precision "
                "under torch.autocast (with torch.amp.GradScaler), or give "
                f"{o['type']} an eps that {o['dtype']} holds (1e-4) where it is made", "")
    return (f"{o['type']} with eps=0 divides by the root of its second moment{zeros}",
            f"give {o['type']} eps > 0 (the default 1e-8) where it is made", "")


@rule("diverging_training", reads="history (norm growth over the recorded steps), optimizer lr")
def _diverging_training(f):
    h = f.e.get("history")
    if not h:
        return None
    if h.get("growth", 0) >= GROWTH and h.get("grad_growth", 0) >= GROWTH:
        what = (f"‖{h['param']}‖ grew ×{_num(h['growth'])} and its gradient's norm "
                f"×{_num(h['grad_growth'])}")
    elif h.get("grad_growth", 0) >= GRAD_GROWTH:
        what = f"the gradient norm of {h['param']} grew ×{_num(h['grad_growth'])}"
    else:
        return None
    lr = f.e.get("optimizer", {}).get("lr")
    return (f"the training diverged: {what} over steps {h['steps'][0]}..{h['steps'][1]} "
            "before this",
            f"lower the learning rate{f' (lr={_num(lr)})' if lr is not None else ''}, add "
            "warm-up, or clip gradients (torch.nn.utils.clip_grad_norm_)", "")


@rule("half_precision_overflow", reads="output dtype, in_float32 (the op's values in float32)")
def _half_precision_overflow(f):
    out = f.output
    if out is None or out.dtype not in ("f16", "bf16") or not f.made or not f.only_inf:
        return None
    wide = f.e.get("in_float32")
    name = "float16" if out.dtype == "f16" else "bfloat16"
    if wide and wide["max"] > wide["dtype_max"]:
        reach = f"in float32 the values reach {_num(wide['max'])}, past {_num(wide['dtype_max'])}"
    elif out.dtype == "f16" and not wide:
        reach = "values past 65,504"
    else:
        return None
    if f.v.stage == "backward":
        fix = ("scale the loss with torch.amp.GradScaler (it skips the steps that overflow), "
               "or train in bfloat16")
    else:
        fix = ("run it in bfloat16 (torch.autocast(..., dtype=torch.bfloat16)) or in float32 "
               "for this op (.float()), or keep the values smaller (subtract the max before "
               "exp, scale q·k by 1/sqrt(d))")
    return f"{name} overflow: {reach}, {name}'s largest", fix


@rule("exp_overflow", reads="op, the input's largest value, its dtype")
def _exp_overflow(f):
    if f.fn not in ("exp", "exp2", "expm1") or not f.made or not f.v.posinf:
        return None
    s = next((s for _, s in f.tensor_inputs()), None)
    if s is None or s.max is None or s.dtype not in _LOG_MAX:
        return None
    limit = _LOG_MAX[s.dtype] / (math.log(2) if f.fn == "exp2" else 1.0)
    if s.max <= limit:
        return None
    return (f"{f.fn} of values up to {_num(s.max)} overflows {s.dtype} ({f.fn}(x) is Inf for "
            f"x > {limit:.2f})",
            "compute it on safe inputs: subtract the max first (torch.logsumexp, "
            "torch.softmax), F.softplus for log(1 + exp(x)), or clamp the input "
            "(x.clamp(max=80)); a torch.where that discards the Inf still sends NaN through "
            "its gradient")


_LOG_MAX = {"f32": math.log(3.4028234663852886e38), "f64": math.log(1.7976931348623157e308),
            "f16": math.log(65504.0), "bf16": math.log(3.3895313892515355e38)}
