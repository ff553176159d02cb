"""What mldebug's hooks need to stay invisible to torch.compile.

Dynamo inlines global module hooks into the graphs it traces. mldebug's hooks ask
`compiling()` first and return at once while dynamo traces (a constant to dynamo: no
graph break, no guard, nothing of ours in the compiled graph); a compiled module is then
seen at its boundary, whose hooks torch runs eagerly.

`OptimizedModule.__call__` warns on every call site while any global module hook exists
(its hooks "fire an extra time"); mldebug's do by design, so that one warning is
silenced while mldebug runs and nothing else is.
"""
from __future__ import annotations

import types
import warnings

import torch.compiler

compiling = torch.compiler.is_compiling

# The hot hooks' form of `compiling()`, one Python call instead of two (`is_compiling`
# asks `torch.jit.is_scripting` first), for the hooks that run at every module call:
#     if dynamo_compiling() or FLAG._is_compiling_flag: ...
# Dynamo folds `is_dynamo_compiling()` to a constant True while it traces (as it does
# `is_compiling()`), so nothing after it is traced; eagerly it returns False, and the
# flag `is_compiling()` reads (set by torch.export's non-strict tracing) is read as an
# attribute.
if callable(getattr(torch.compiler, "is_dynamo_compiling", None)) \
        and isinstance(getattr(torch.compiler, "_is_compiling_flag", None), bool):
    dynamo_compiling = torch.compiler.is_dynamo_compiling
    FLAG = torch.compiler
else:  # an older torch: the full check, and a flag that stays False
    dynamo_compiling = compiling
    FLAG = types.SimpleNamespace(_is_compiling_flag=False)

_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
_silenced = [False]


def silence_global_hook_warning() -> None:
    """Ignore torch's note that global module hooks fire once more for an OptimizedModule
    (idempotent; the user's other warning filters stay as they are)."""
    if not _silenced[0]:
        _silenced[0] = True
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING, category=UserWarning)
