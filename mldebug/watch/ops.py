"""Per-OpOverload decisions of the watch, computed once per overload and cached.

The dispatch mode's hot path does one dict lookup per op and reads these slots; nothing
here is evaluated per call.
"""
from __future__ import annotations

import fnmatch

import torch

# Ops that hand out uninitialized memory (may hold NaN on healthy programs) or only
# change metadata/storage: never checked.
UNINITIALIZED = frozenset({
    "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
    "empty_permuted", "resize_", "resize_as_", "set_", "_local_scalar_dense",
    "_resize_output_", "record_stream",
})
SKIPPED_NAMESPACES = frozenset({"profiler"})


class OpInfo:
    """What the watch needs to know about one overload."""

    __slots__ = ("name", "short", "skip", "mutated", "argnames", "kwnames", "torch_op",
                 "op", "func")

    def __init__(self, func):
        self.name = str(func)                         # 'aten.log.default'
        self.op = getattr(func, "_op", func)          # the C++ callable: skips __call__
        packet = getattr(func, "overloadpacket", None)
        self.short = getattr(packet, "__name__", self.name.split(".")[-2 if "." in self.name else 0])
        schema = getattr(func, "_schema", None)
        arguments = list(schema.arguments) if schema is not None else []
        self.argnames = tuple(a.name for a in arguments if not a.kwarg_only)
        self.kwnames = tuple(a.name for a in arguments if a.kwarg_only)
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
            or self.short in UNINITIALIZED
            or (not returns_tensor and not self.mutated)
        )
        self.torch_op = torch_name(self.short)


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
    for name in (short, short.lstrip("_")):
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
