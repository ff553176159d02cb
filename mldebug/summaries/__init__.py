"""The summaries layer, above `core` and below the engines: a tensor, an array, a module
or any object at a glance, computed once and rendered by every front end.

Public names
    summary(x) -> TensorSummary     torch tensor, numpy array or numpy scalar; never raises
    describe(obj, name=None) -> str the multi-line `inspect` text for ANY object
    nonfinite_counts(x) / has_nonfinite(x)   exact counts / any NaN/Inf
    short_dtype(dtype) -> str       'f32', 'bf16', 'i64', ...
    format_number(v)                a number as the one-line summaries print it
Modules: tensor_summary (the record and its text), compute (summary), describe,
slicing (slices and heatmaps of big tensors for the panels).
"""
from __future__ import annotations

from .compute import has_nonfinite, nonfinite_counts, summary
from .describe import describe
from .tensor_summary import TensorSummary, format_number, short_dtype

__all__ = ["TensorSummary", "summary", "describe", "nonfinite_counts", "has_nonfinite",
           "short_dtype", "format_number"]
