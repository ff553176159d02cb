"""The browser view: a Bokeh server inside the debugged process that shows what the
debugger sees — the stop, the inspect list (a heatmap of any 2-D slice, the image view,
histogram and stats, the gradient), the graph of the last step and the assertions — with
Continue / Step over buttons that act as `c` / `n` typed at the prompt.

    url = mldebug.view()            # start it (once) and get its URL (token in the query)
    mldebug.view(runs="runs")       # ... and list the runs recorded in runs/ (Timeline tab)
    mldebug.inspect(x)              # add x to the inspect list (starts the view if needed)
    mldebug.inspect(x, wait=True)   # ... and block the program until Continue in the page

Also `python -m mldebug --view [PORT] script.py`, and `view [PORT]` / `inspect EXPR` at
the prompt. The server binds 127.0.0.1 only, needs the per-process token for the page
and its websocket, and accepts websocket origins of its own host:port only
(`server.py`). Port: PORT, else 5006; 0 = any free port; a port in use gives a note and
a free one. Nothing here imports bokeh until a view starts.

Layout: `state` (the hub: inspect list, pause state, the buttons' command queue),
`prompt` (the prompt's input while a view runs), `server` (Bokeh/tornado thread,
security), `app` (the page), `timeline_panel` (its Timeline tab: recorded runs), `data`
(what the page draws, from the engine's records).
"""
from __future__ import annotations

import linecache
import sys as _sys
import threading
from typing import Optional

from ..core import session as _session
from ..core.callable_module import make_callable
from ..core.quiet import looking_away
from . import data as _data
from . import state as _state
from .prompt import prompt_loop as _prompt_loop
from .server import ViewServer, parse_port

__all__ = ["view", "start", "inspect", "running", "close", "url"]

_server = None
_lock = threading.Lock()


def running():
    """The running ViewServer, or None."""
    return _server


def url() -> Optional[str]:
    return _server.url if _server is not None else None


def _start(port=None, out=None):
    """(url, started_now). Raises ValueError for a bad port, server.ViewError when the
    server cannot start."""
    global _server
    with _lock:
        if _server is not None:
            return _server.url, False
        _server = ViewServer(parse_port(port), out=out)
        # every stop of the session reaches the banner, also those no prompt pauses for
        _session.current().add_listener(_show_stop)
        return _server.url, True


def _show_stop(stop) -> None:
    _state.hub().stop_recorded(stop.to_dict())


def start(port=None, runs=None) -> str:
    """`mldebug.view(port)`: start the browser view (once; later calls return the same URL) and return its URL,
    `http://127.0.0.1:PORT/?token=...`. PORT: None for 5006, 0 for any free port; a port
    in use gives a note and a free one. Prints the URL on stderr when it starts.
    RUNS: a directory of recorded runs (or a list of them) for the Timeline tab, added to
    those listed (also when the view already runs); the running `mldebug.record`'s
    run_dir is always listed."""
    if runs is not None:
        _data.add_run_dirs(runs)
    address, started = _start(port)
    if started:
        print(f"mldebug: browser view at {address}", file=_sys.stderr, flush=True)
    elif port not in (None, "", 0, "0") and str(port) != str(_server.port):
        print(f"mldebug: the browser view already runs on port {_server.port}",
              file=_sys.stderr, flush=True)
    return address


def inspect(x, name: Optional[str] = None, wait: bool = False):
    """Add X to the browser view's inspect list under NAME (default: the expression in
    the call, e.g. `model.fc.weight`) and return X unchanged. Starts the view when none
    runs (its URL is printed once). WAIT=True blocks the program until Continue is
    pressed in the page. A view that cannot start is a warning, never an exception in
    the program."""
    if name is not None and not isinstance(name, str):
        raise TypeError(f"mldebug.inspect: name must be a str, name={name!r}")
    caller = _sys._getframe(1)
    try:
        address = start() if _server is None else _server.url
    except Exception as exc:  # noqa: BLE001 - the program goes on without a view
        print(f"mldebug: warning: the browser view could not start: {exc}",
              file=_sys.stderr, flush=True)
        return x
    hub = _state.hub()
    with looking_away():     # (its summary of a NaN is no stop: core/quiet.py)
        hub.add(x, name or _call_argument(caller) or f"value {len(hub.entries) + 1}",
                "inspect")
    if wait:
        print(f"mldebug: waiting for Continue in the browser view: {address}",
              file=_sys.stderr, flush=True)
        hub.paused("wait", None, caller)
        try:
            hub.wait_for_continue()
        finally:
            hub.running()
    del caller
    return x


def close() -> None:
    """Stop the view's server (tests; the process's exit does it too)."""
    global _server
    with _lock:
        server, _server = _server, None
    if server is not None:
        session = _session.current_if_any()
        if session is not None:
            session.remove_listener(_show_stop)
        server.close()


# -- the prompt's side (debugger.py calls these) ---------------------------------------
def add_from_prompt(value, name: str) -> bool:
    """`inspect EXPR` at the prompt: also into the view's list when a view runs."""
    if _server is None:
        return False
    _state.hub().add(value, name, "prompt")
    return True


def do_view(debugger, arg: str) -> bool:
    """`view [PORT]` at the prompt: start the view or print its URL. True when it started
    now (the prompt then re-reads its input through the view)."""
    word = arg.strip()
    try:
        address, started = _start(word or None, out=debugger.stdout)
    except ValueError as exc:
        debugger.error(f"view: {exc}")
        return False
    except Exception as exc:  # noqa: BLE001 - the prompt must survive anything
        debugger.error(f"view: the browser view could not start: {exc}")
        return False
    debugger.message(f"browser view at {address}" if started else
                     f"the browser view runs at {address}")
    return started


def prompt_loop(debugger, intro=None):
    """The prompt's loop while a view runs (see prompt.py)."""
    return _prompt_loop(debugger, intro)


def _call_argument(frame) -> str:
    """The source text of the first argument of the `inspect(` call on FRAME's line."""
    try:
        line = linecache.getline(frame.f_code.co_filename, frame.f_lineno)
        start = line.find("inspect(")
        if start < 0:
            return ""
        text, depth = [], 0
        for ch in line[start + len("inspect("):]:
            if ch in "([{":
                depth += 1
            elif ch in ")]}":
                if depth == 0:
                    break
                depth -= 1
            elif ch == "," and depth == 0:
                break
            text.append(ch)
        result = "".join(text).strip()
        return result if 0 < len(result) <= 80 and "=" not in result else ""
    except Exception:  # noqa: BLE001
        return ""


# `mldebug.view(port)` starts the view: the package is also that function
view = make_callable(__name__, start)
