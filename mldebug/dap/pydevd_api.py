"""pydevd, debugpy's debugger core, as mldebug drives it: is it tracing this process, is
a client attached, a custom DAP event to the client, mldebug's frames counted as library
code, the tensor presentation plugin loaded. pydevd's internal APIs are wrapped here and
nowhere else; each answers False when the pydevd in hand is not one it knows.

Nothing here imports debugpy at import time.
"""
from __future__ import annotations

import sys
from typing import Optional


def _pydb():
    """pydevd's global debugger when debugpy (not some other pydevd) traces this process."""
    if "debugpy" not in sys.modules:
        return None
    pydevd = sys.modules.get("pydevd")
    if pydevd is None:
        return None
    try:
        from _pydevd_bundle.pydevd_constants import get_global_debugger
        return get_global_debugger()
    except Exception:  # noqa: BLE001 - a pydevd we do not know: not ours to drive
        return None


def debugger_active() -> bool:
    """True when debugpy traces this process: launched by a DAP client (`launch` with
    `"module": "mldebug"`), `python -m debugpy ... -m mldebug`, or `--listen`."""
    return _pydb() is not None


def client_connected() -> bool:
    if not debugger_active():
        return False
    try:
        import debugpy
        return bool(debugpy.is_client_connected())
    except Exception:  # noqa: BLE001
        return False


def send_event(event: str, body: Optional[dict] = None) -> bool:
    """Send a custom DAP event (e.g. 'mldebug.stop') to the attached client; False when
    there is no client or pydevd refuses. Wraps pydevd's internal `send_json_message`."""
    if not client_connected():
        return False
    try:
        import pydevd
        return bool(pydevd.send_json_message({"type": "event", "event": event,
                                              "body": body or {}}))
    except Exception:  # noqa: BLE001 - an internal API: never break the program for it
        return False


def treat_as_library() -> bool:
    """Make pydevd count mldebug's own files as library code, as it does for an ordinary
    install in site-packages: under `justMyCode` an editable install's frames (the CLI's
    `exec` of the program, the pauser) are then hidden and never stepped into. Internal
    pydevd API (FilesFiltering's library roots), wrapped: False when it is not there."""
    import os

    pydb = _pydb()
    if pydb is None:
        return False
    folder = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        filtering = pydb._files_filtering
        roots = list(filtering._get_library_roots())
        if not any(os.path.normcase(folder + os.sep).startswith(os.path.normcase(r)) for r in roots):
            filtering.set_library_roots(roots + [folder])
            pydb._clear_caches()
        return True
    except Exception:  # noqa: BLE001 - an unknown pydevd: frames just stay visible
        return False


def register_plugin() -> bool:
    """Make sure pydevd sees `pydevd_plugins/extensions/pydevd_plugin_mldebug_tensors.py`.

    An ordinary install puts it in site-packages, where pydevd's `pkgutil.extend_path`
    finds it. An editable install (setuptools' import hook) is no directory on sys.path, so
    here mldebug adds its own folder to `pydevd_plugins.extensions.__path__` and makes
    pydevd's extension manager load again if it already had. True when the plugin is in.
    """
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    folder = os.path.join(root, "pydevd_plugins", "extensions")
    try:
        import pydevd_plugins.extensions as extensions
        from _pydevd_bundle import pydevd_extension_utils as utils
    except Exception:  # noqa: BLE001
        return False
    try:
        manager = utils.EXTENSION_MANAGER_INSTANCE
        loaded = manager.loaded_extensions or []
        if any(getattr(m, "__name__", "").endswith("pydevd_plugin_mldebug_tensors") for m in loaded):
            return True
        if os.path.isdir(folder) and folder not in list(extensions.__path__):
            extensions.__path__.append(folder)
        if manager.loaded_extensions is not None:   # loaded before us: load again
            manager.loaded_extensions = None
            manager.type_to_instance.clear()
            from _pydevd_bundle import pydevd_xml
            handler = pydevd_xml._TYPE_RESOLVE_HANDLER
            handler._initialized = False
            handler._type_to_resolver_cache.clear()
            handler._type_to_str_provider_cache.clear()
        return True
    except Exception:  # noqa: BLE001
        return False
