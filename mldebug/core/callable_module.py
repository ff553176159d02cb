"""A package that is also a function: `mldebug.watch(...)`, `mldebug.record(...)`,
`mldebug.view(...)`, `mldebug.assertions()`.

Importing a submodule binds the package attribute (`mldebug.watch`) to the module, and
`mldebug.__init__`'s lazy attribute would bind it to whatever `watch` is in there: so
the module itself is made callable, and `mldebug.watch(...)`,
`from mldebug.watch import watch; watch(...)` and `mldebug.watch.active_watch()` all
work, in any import order.
"""
from __future__ import annotations

import inspect
import sys
import types
from typing import Callable


def make_callable(module_name: str, fn: Callable) -> types.ModuleType:
    """Make the module MODULE_NAME callable as FN (with FN's signature); returns it."""

    class CallableModule(types.ModuleType):
        __doc__ = f"`{module_name}` is both this package and {fn.__name__}()."

        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    module = sys.modules[module_name]
    module.__class__ = CallableModule
    module.__signature__ = inspect.signature(fn)
    return module
