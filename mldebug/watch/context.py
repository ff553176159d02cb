"""Where an op runs: module paths and parameter names, from a module record.

A record is a linked `(module, parent_record)`: the full watch's module hooks keep one
per call (`Watch._top`); outside the roots, where no hook runs, `module_record` reads it
off the Python stack at a stop. Names are computed lazily, only when a stop is reported.
"""
from __future__ import annotations

import weakref

import torch.nn as nn

from ..core.modnames import module_names

_CALL_CODE = nn.Module._call_impl.__code__


def module_record(frame):
    """The record of the module calls running at FRAME, read off the stack (the frames
    of `Module._call_impl` hold their module), or None outside every module."""
    calls = []
    while frame is not None:
        if frame.f_code is _CALL_CODE:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module):
                calls.append(module)
        frame = frame.f_back
    record = None
    for module in reversed(calls):
        record = (module, record)
    return record


class ModuleNames:
    """Dotted paths from the outermost module, computed once per root, cached weakly."""

    def __init__(self):
        self._params = weakref.WeakKeyDictionary()   # root -> {id(param): name}
        self.roots = weakref.WeakSet()               # outermost modules seen

    def path(self, record) -> tuple[str, str]:
        """(dotted path, class name) of the innermost module of a stack record."""
        if record is None:
            return "", ""
        chain = []
        while record is not None:
            chain.append(record[0])
            record = record[1]
        inner = chain[0]
        root = chain[-1]
        names = module_names(root)
        # innermost module known under the root; modules called that are not children
        # of the root (shared helpers) are named by their class after the known part
        for depth, module in enumerate(chain):
            name = names.get(id(module))
            if name is not None:
                suffix = [type(m).__name__ for m in reversed(chain[:depth])]
                return ".".join([p for p in [name] + suffix if p]), type(inner).__name__
        return type(inner).__name__, type(inner).__name__

    def param(self, tensor, optimizer=None) -> str:
        """The parameter's name in a model seen (or 'param_groups[g][i]'), '' if unknown."""
        key = id(tensor)
        for root in list(self.roots):
            params = self._params.get(root)
            if params is None:
                params = {}
                try:
                    for name, p in root.named_parameters(remove_duplicate=False):
                        params.setdefault(id(p), name)
                except Exception:
                    pass
                self._params[root] = params
            if key in params:
                return params[key]
        if optimizer is not None:
            for g, group in enumerate(getattr(optimizer, "param_groups", ())):
                for i, p in enumerate(group.get("params", ())):
                    if p is tensor:
                        return f"param_groups[{g}][{i}]"
        return ""

    def owner(self, param_name: str):
        """Module path and class of the module holding parameter `param_name`."""
        if not param_name or "." not in param_name or param_name.startswith("param_groups"):
            return "", ""
        path = param_name.rsplit(".", 1)[0]
        for root in list(self.roots):
            try:
                return path, type(root.get_submodule(path)).__name__
            except Exception:
                continue
        return path, ""
