"""What the debugger's Variables / Watch / hover views show for tensors and arrays.

Used by the pydevd plugin (`pydevd_plugins/extensions/pydevd_plugin_mldebug_tensors.py`)
and by `panel`. Every value is mldebug's one-line summary, on a time budget
(mldebug/summaries/budgeted.py): a summary that is not ready in time shows as its header
until it is; the client is then told to refresh (DAP `invalidated` event) and the next
look shows it all.

Public names
    is_tensor(x), summary_within(x, budget), header(x)   (from summaries.budgeted)
    value_line(x, budget=VALUE_BUDGET_S) -> str     the one-line value
    children(x) -> list[(name, value, evaluate_suffix_or_None)]   bounded, for the tree
    preview(x) -> (label, nested list)   the first few values (a corner), never the whole
"""
from __future__ import annotations

import sys

from ..core.quiet import watch_suspended
from ..summaries import budgeted as _budgeted
from ..summaries.budgeted import PENDING_NOTE, VALUE_BUDGET_S, summary_within


def _torch():
    return sys.modules.get("torch")
from .pydevd_api import send_event

PREVIEW_ROWS = 4             # corner of the last two dims shown as `preview`
PREVIEW_COLS = 8


def _tell_client() -> None:
    """Ask the client to fetch the variables again (DAP `invalidated`)."""
    try:
        send_event("invalidated", {"areas": ["variables"]})
    except Exception:  # noqa: BLE001
        pass


# a summary the Variables view gave up waiting for is ready: the client looks again
_budgeted.on_late.append(_tell_client)


# -- what the tree shows -------------------------------------------------------------------
def value_line(x, budget: float = VALUE_BUDGET_S) -> str:
    summary, _ = summary_within(x, budget)
    return str(summary)


def _preview(x):
    """(label, nested list): the first PREVIEW_ROWS x PREVIEW_COLS corner of the last two
    dims at index 0 of the others; a 1-D tensor's first values; a 0-d tensor's value."""
    ndim = len(x.shape)
    if ndim == 0:
        return "value", x.item()
    index = [0] * max(0, ndim - 2)
    parts = [str(i) for i in index]
    if ndim >= 2:
        rows, cols = min(PREVIEW_ROWS, x.shape[-2]), min(PREVIEW_COLS, x.shape[-1])
        corner = x[tuple(index) + (slice(0, rows), slice(0, cols))]
        parts += [f":{rows}", f":{cols}"]
    else:
        cols = min(PREVIEW_ROWS * PREVIEW_COLS, x.shape[0])
        corner = x[:cols]
        parts.append(f":{cols}")
    torch = _torch()
    if torch is not None and isinstance(corner, torch.Tensor):
        corner = corner.detach()
        if corner.device.type != "cpu":
            corner = corner.cpu()
    return f"preview [{', '.join(parts)}]", corner.tolist()


def preview(x):
    """(label, nested list): the first PREVIEW_ROWS x PREVIEW_COLS corner of the last two
    dims at index 0 of the others; a 1-D tensor's first values; a 0-d tensor's value."""
    with watch_suspended():
        return _preview(x)


def children(x) -> list:
    """(name, value, evaluate suffix) of a tensor/array's children, in display order."""
    torch = _torch()
    is_torch = torch is not None and isinstance(x, torch.Tensor)
    summary, ready = summary_within(x)
    out = [("summary", str(summary), None),
           ("shape", tuple(x.shape), ".shape"),
           ("dtype", x.dtype, ".dtype")]
    if is_torch:
        out.append(("device", x.device, ".device"))
    if ready:
        stats = {"min": summary.min, "max": summary.max, "mean": summary.mean,
                 "std": summary.std, "nan": summary.nan, "+inf": summary.posinf,
                 "-inf": summary.neginf, "zeros": summary.zeros}
        if summary.first_nonfinite is not None:
            stats["first non-finite at"] = tuple(summary.first_nonfinite)
        if summary.note:
            stats["note"] = summary.note
    else:
        stats = PENDING_NOTE + " (look again in a moment)"
    out.append(("stats", stats, None))
    if is_torch:
        out.append(("requires_grad", x.requires_grad, ".requires_grad"))
        if x.grad_fn is not None:
            out.append(("grad_fn", x.grad_fn, ".grad_fn"))
        if x.is_leaf:
            out.append(("grad", x.grad, ".grad"))
    try:
        label, values = preview(x)
        out.append((label, values, None))
    except Exception as exc:  # noqa: BLE001 - sparse, meta, fake: no preview
        out.append(("preview", f"unavailable: {type(exc).__name__}", None))
    return out
