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

import socket
import sys

from ..core.addresses import is_loopback
from ..core.ranks import this_rank
from ..core.threads import hide_from_debugger  # noqa: F401 - part of the face
from .pauser import DapPauser
from .pydevd_api import (client_connected, debugger_active, register_plugin,  # noqa: F401
                         send_event, treat_as_library)

DEFAULT_HOST = "127.0.0.1"


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
        host, port = parse_address(listen_to)
        rank = this_rank()
        if rank is not None and port:
            port += rank.rank     # one port a rank: rank R of a job listens on PORT+R
        host, port = listen((host, port))
        tag = rank.tag if rank is not None else ""
        print(f"{tag}mldebug: debugpy listens on {host}:{port}"
              + ("; waiting for a client to attach" if wait else ""),
              file=sys.stderr, flush=True)
        if not is_loopback(host):
            # debugpy asks its clients for no key: the address is the only guard
            print(f"{tag}mldebug: warning: any client that reaches {host}:{port} can run "
                  "code as you (debugpy asks for no key); listen on 127.0.0.1 and reach "
                  f"it through an ssh tunnel: ssh -L {port}:127.0.0.1:{port} "
                  f"{socket.gethostname()}", file=sys.stderr, flush=True)
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
    treat_as_library()
    register_plugin()
    session.pauser = DapPauser(session)
    return True
