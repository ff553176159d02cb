"""pydevd (debugpy) plugin: torch tensors and numpy arrays in VS Code's Variables, Watch
and hover views show mldebug's one-line summary, and expand into shape, dtype, device,
stats (min/max/mean/std, NaN/Inf counts), grad and a bounded preview of the values.

pydevd loads every module named `pydevd_plugin*` in the `pydevd_plugins.extensions`
namespace package found on sys.path, so this works in any debugpy session where mldebug is
installed, with or without mldebug's CLI. It never blocks the UI on a large tensor: see
`mldebug.dap.variables` (budgeted summaries, finished in the background).

`pydevd_plugins/` and `pydevd_plugins/extensions/` have no `__init__.py` on purpose:
they are namespace contributions to debugpy's own (pkgutil-style) packages.
"""
import sys

from _pydevd_bundle.pydevd_extension_api import StrPresentationProvider, TypeResolveProvider


def _is_array_type(type_object) -> bool:
    # Never import torch/numpy here: a session that does not use them must not pay.
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if issubclass(type_object, torch.Tensor):
                return True
        except TypeError:
            return False
    np = sys.modules.get("numpy")
    if np is not None:
        try:
            return issubclass(type_object, np.ndarray)
        except TypeError:
            return False
    return False


def _variables():
    try:
        from mldebug.dap import variables
        return variables
    except Exception:  # noqa: BLE001 - mldebug broken or gone: pydevd's defaults
        return None


class MLDebugTensorStr(StrPresentationProvider):
    """The one-line value of a tensor/array, in every context (variables, watch, hover,
    repl, clipboard)."""

    def __init__(self):
        _prefer_ours()

    def can_provide(self, type_object, type_name):
        return _is_array_type(type_object)

    def get_str(self, val):
        return self.get_str_in_context(val, "variables")

    def get_str_in_context(self, val, context):
        variables = _variables()
        if variables is None:
            return None
        try:
            return variables.value_line(val)
        except Exception:  # noqa: BLE001 - None: pydevd falls back to repr
            return None


class MLDebugTensorChildren(TypeResolveProvider):
    """The children of a tensor/array in the Variables view (ordered, bounded)."""

    def can_provide(self, type_object, type_name):
        return _is_array_type(type_object)

    def get_contents_debug_adapter_protocol(self, obj, fmt=None):
        variables = _variables()
        if variables is None:
            return []
        try:
            return variables.children(obj)
        except Exception as exc:  # noqa: BLE001
            return [("error", f"{type(exc).__name__}: {exc}", None)]

    def get_dictionary(self, obj):
        return {name: value for name, value, _ in self.get_contents_debug_adapter_protocol(obj)}

    def resolve(self, obj, attribute):
        return self.get_dictionary(obj).get(attribute)


def _prefer_ours():
    """Put this plugin's resolver ahead of pydevd's own numpy resolver.

    pydevd asks resolvers in the order it loaded their modules, and its bundled
    `pydevd_plugin_numpy_types` comes first. The string providers are built after the
    resolvers (same extension manager, same list objects), so when ours is constructed the
    resolver list is complete and can be reordered in place.
    """
    try:
        from _pydevd_bundle import pydevd_extension_utils as utils
        handlers = utils.EXTENSION_MANAGER_INSTANCE.type_to_instance.get(TypeResolveProvider)
        if handlers:
            ours = [h for h in handlers if isinstance(h, MLDebugTensorChildren)]
            rest = [h for h in handlers if not isinstance(h, MLDebugTensorChildren)]
            handlers[:] = ours + rest
    except Exception:  # noqa: BLE001
        pass


__all__ = ["MLDebugTensorStr", "MLDebugTensorChildren"]
