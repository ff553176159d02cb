"""A rank's prompt where its terminal cannot show it: on a socket, for
`python -m mldebug attach HOST:PORT`.

Under torchrun every rank shares the launcher's terminal, and `--local-ranks-filter`,
`--redirects` or `--tee` send a rank's output to a file or nowhere: a prompt opened there
would look like a hang. When a rank of a multi-process job stops, its stdin or stdout is
not a terminal and no browser view runs (its buttons drive the prompt), the prompt is
served instead on a TCP port of this host (127.0.0.1 unless MLDEBUG_ATTACH_HOST says
otherwise), and where is printed where the user sees it: the launching shell's terminal
(the controlling terminal, else the launcher's own stderr through /proc, the ranks
running in sessions of their own), else this rank's stderr. The program stays paused
until a client attaches; the prompt is mldebug's plain one (pdb's commands, `inspect`,
`why`, ...), and the connection closes when the program goes on.
"""
from __future__ import annotations

import os
import socket
import sys

from . import view as _view
from .core.ranks import this_rank


def _terminal_usable() -> bool:
    try:
        return os.isatty(0) and os.isatty(1)
    except (OSError, ValueError):
        return False


def _announce(text: str) -> str:
    """Write TEXT where the user sees it; returns which place that was."""
    for place in ("/dev/tty", f"/proc/{os.getppid()}/fd/2"):
        try:
            with open(place, "w") as out:
                out.write(text)
            return place
        except OSError:
            continue
    sys.__stderr__.write(text)
    sys.__stderr__.flush()
    return "stderr"


class RemotePrompt:
    """The session's pauser for a rank: the debugger's own prompt on the terminal when
    the rank can use it, else the same prompt served on a socket."""

    def __init__(self, debugger):
        self.debugger = debugger
        self.host = os.environ.get("MLDEBUG_ATTACH_HOST", "127.0.0.1")

    def __call__(self, stop, frame) -> None:
        info = this_rank()
        if info is None or _terminal_usable() or _view.running() is not None:
            # (a browser view drives the prompt with its buttons: the user reaches it there)
            return self.debugger.pause_at(stop, frame)
        with socket.create_server((self.host, 0)) as server:
            port = server.getsockname()[1]
            _announce(f"{info.tag}mldebug: {stop.message}\n"
                      f"{info.tag}mldebug: this rank's output is not on this terminal; its "
                      f"prompt: python -m mldebug attach {self.host}:{port}\n")
            conn, _ = server.accept()
        with conn, conn.makefile("r", encoding="utf-8", newline="\n") as reader, \
                conn.makefile("w", encoding="utf-8", buffering=1) as writer:
            self._pause_on(stop, frame, reader, writer)

    def _pause_on(self, stop, frame, reader, writer) -> None:
        d = self.debugger
        saved = d.stdin, d.stdout, d.use_rawinput
        d.stdin, d.stdout, d.use_rawinput = reader, writer, False
        d.remote_prompt = True         # the plain cmd loop (debugger._cmdloop_of_frontend)
        try:
            d.pause_at(stop, frame)
        finally:
            d.stdin, d.stdout, d.use_rawinput = saved
            d.remote_prompt = False
            try:
                writer.write("mldebug: the program goes on; this prompt closes\n")
            except OSError:
                pass

