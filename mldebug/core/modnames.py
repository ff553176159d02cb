"""Dotted module paths from an outermost module, shared by the watch and the graph."""
from __future__ import annotations

import weakref

_NAMES = weakref.WeakKeyDictionary()     # root module -> {id(module): dotted path}


def module_names(root) -> dict:
    """{id(module): dotted path} for every module under ROOT, computed once per root and
    cached weakly; empty when the root's `named_modules()` fails."""
    names = _NAMES.get(root)
    if names is None:
        names = {}
        try:
            for name, module in root.named_modules(remove_duplicate=False):
                names.setdefault(id(module), _without_compile_wrapper(name))
        except Exception:  # noqa: BLE001 - a module whose named_modules() fails: no names
            pass
        try:
            _NAMES[root] = names
        except TypeError:  # a root that cannot be weakly referenced: not cached
            pass
    return names


def _without_compile_wrapper(name: str) -> str:
    """The user's path of a module inside `torch.compile(module)`'s OptimizedModule:
    '_orig_mod.fc' is 'fc', '_orig_mod' is the root ''."""
    if "_orig_mod" not in name:
        return name
    return ".".join(part for part in name.split(".") if part != "_orig_mod")
