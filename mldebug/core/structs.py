"""The tensors inside the arguments and outputs of module calls: one walk for the whole
engine (graph capture, watch, assertions, recording), so that they agree on the order."""
from __future__ import annotations

import dataclasses

from torch import Tensor

MAX_DEPTH = 3


def tensors_in(value, depth: int = 0) -> list:
    """Tensors in VALUE, depth first, in a stable order: a tensor, tuples and lists,
    dicts (transformers' ModelOutput is one), dataclasses; at most MAX_DEPTH levels
    below the value given."""
    if isinstance(value, Tensor):
        return [value]
    if depth > MAX_DEPTH:
        return []
    if isinstance(value, (tuple, list)):
        out = []
        for v in value:       # (a module's args: tensors, one call less each)
            if isinstance(v, Tensor):
                out.append(v)
            else:
                out.extend(tensors_in(v, depth + 1))
        return out
    if isinstance(value, dict):
        out = []
        for v in value.values():
            out.extend(tensors_in(v, depth + 1))
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = []
        for f in dataclasses.fields(value):
            out.extend(tensors_in(getattr(value, f.name, None), depth + 1))
        return out
    return []
