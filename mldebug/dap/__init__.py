"""The DAP front end: mldebug under debugpy, for VS Code and any DAP client.

Public names
    setup(args, session) -> bool     the CLI's one call: `--listen`/`--wait-for-client`, then
                                     DAP mode on when debugpy is tracing this process
    debugger_active() -> bool        debugpy (pydevd) is tracing this process
    client_connected() -> bool       ... and a DAP client is attached to it
    listen(address) -> (host, port)  `debugpy.listen` on 127.0.0.1 unless a host is given
    parse_address(text) -> (host, port)   '5678' / 'HOST:5678' → ('127.0.0.1', 5678) / (...)
    hide_from_debugger(thread)       a thread mldebug starts is never traced nor suspended
    send_event(event, body) -> bool  a custom DAP event to the client (`mldebug.stop`, ...)
    register_plugin() -> bool        make pydevd load mldebug's tensor presentation plugin

How DAP mode differs from the terminal (see `setup`): no pdb prompt, `breakpoint()` and
uncaught exceptions are debugpy's, and every NaN/Inf/assertion stop goes through
`pauser.DapPauser`, which stops the client in the user's frame with the stop's message in
the exception widget. `panel` answers the VS Code panel's `evaluate` requests with JSON.

Nothing here imports debugpy at import time: `import mldebug.dap` is free.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

DEFAULT_HOST = "127.0.0.1"


# -- is debugpy here? -----------------------------------------------------------------
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


# -- --listen ---------------------------------------------------------------------------
def parse_address(text: str) -> tuple[str, int]:
    """'5678' → ('127.0.0.1', 5678); 'HOST:5678' → ('HOST', 5678); '[::1]:5678' too.
    Raises ValueError naming the bad value."""
    text = str(text).strip()
    host, sep, port = text.rpartition(":")
    if not sep:
        host, port = DEFAULT_HOST, text
    host = host.strip("[]") or DEFAULT_HOST
    try:
        number = int(port)
    except ValueError:
        raise ValueError(f"--listen expects [HOST:]PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--listen port must be in 0..65535, got {number}")
    return host, number


def listen(address: tuple[str, int]) -> tuple[str, int]:
    """Start debugpy's adapter on ADDRESS; returns the address it listens on."""
    import debugpy

    endpoint = debugpy.listen(address)
    return tuple(endpoint) if isinstance(endpoint, (tuple, list)) else address


# -- the CLI's entry --------------------------------------------------------------------
def setup(args, session) -> bool:
    """Called once at the start of `cli.run`. Starts debugpy when `--listen` asks, waits for
    a client on `--wait-for-client`, and when debugpy traces the process installs the DAP
    pauser as `session.pauser` and returns True (DAP mode). Returns False otherwise (the
    terminal front end runs as usual). Raises ValueError for a bad `--listen` value.
    """
    listen_to = getattr(args, "listen", None)
    wait = getattr(args, "wait_for_client", False)
    if wait and not listen_to and not debugger_active():
        raise ValueError("--wait-for-client needs --listen [HOST:]PORT")
    if listen_to:
        host, port = listen(parse_address(listen_to))
        print(f"mldebug: debugpy listens on {host}:{port}"
              + ("; waiting for a client to attach" if wait else ""),
              file=sys.stderr, flush=True)
        if wait:
            import debugpy
            debugpy.wait_for_client()
    if not debugger_active():
        return False
    if getattr(args, "commands", None):
        print("mldebug: note: -c commands are ignored under debugpy (no pdb prompt)",
              file=sys.stderr, flush=True)
    if getattr(args, "stop_at_start", False):
        print("mldebug: note: --stop-at-start is ignored under debugpy; ask the client "
              "(VS Code: \"stopOnEntry\": true)", file=sys.stderr, flush=True)
    from .pauser import DapPauser

    treat_as_library()
    register_plugin()
    session.pauser = DapPauser(session)
    return True


# -- helpers for the rest of mldebug ----------------------------------------------------
class _NullContext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def watch_suspended():
    """The active watch's `suspended()` context, or a no-op: what the debugger evaluates
    while paused (summaries, the panel's JSON) must never be judged by the watch, or a
    NaN in a tensor being looked at would stop the program again, inside the request."""
    module = sys.modules.get("mldebug.watch")   # not imported: no watch can be active
    try:
        active = module.active_watch() if module is not None else None
        if active is not None and hasattr(active, "suspended"):
            return active.suspended()
    except Exception:  # noqa: BLE001
        pass
    return _NullContext()


def hide_from_debugger(thread: threading.Thread) -> threading.Thread:
    """Mark THREAD (before `start()`) so pydevd neither traces nor suspends it, nor lists
    it in `threads`: what pydevd does for its own daemon threads. Harmless without debugpy.
    Every thread mldebug starts (the Bokeh server, a recorder) goes through this."""
    thread.pydev_do_not_trace = True
    thread.is_pydev_daemon_thread = True
    return thread


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
