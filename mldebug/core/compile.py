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

import warnings

import torch.compiler

compiling = torch.compiler.is_compiling

_GLOBAL_HOOK_WARNING = r"Using `torch\.compile\(module\)` when there are global hooks on modules"
_silenced = [False]


def silence_global_hook_warning() -> None:
    """Ignore torch's note that global module hooks fire once more for an OptimizedModule
    (idempotent; the user's other warning filters stay as they are)."""
    if not _silenced[0]:
        _silenced[0] = True
        warnings.filterwarnings("ignore", message=_GLOBAL_HOOK_WARNING, category=UserWarning)
