"""L2 norms of many tensors at once (parameters, gradients): what `history` keeps per step
and what the gradient assertions judge, computed one way."""
from __future__ import annotations

import torch


def l2_norms(tensors) -> list:
    """The L2 norm of each tensor as a float (float32-rounded, as shown), in order: one
    `torch._foreach_norm` and one host read per (device, dtype) group instead of a sync
    per tensor; a group foreach cannot take falls back to one norm each."""
    tensors = list(tensors)
    groups: dict = {}
    for i, t in enumerate(tensors):
        groups.setdefault((t.device, t.dtype), []).append(i)
    out = [0.0] * len(tensors)
    with torch.no_grad():
        for index in groups.values():
            group = [tensors[i].detach() for i in index]
            try:
                values = torch.stack(torch._foreach_norm(group)).float().tolist()
            except Exception:  # noqa: BLE001 - a dtype or layout foreach does not take
                values = [float(torch.linalg.vector_norm(t.float())) for t in group]
            for i, v in zip(index, values):
                out[i] = v
    return out
