"""The debugger's prompt while a browser view is up: one input fed by the terminal AND
the page's buttons.

While the view runs, every mldebug prompt (plain MLPdb or the IPython one) reads its
commands through `LineSource`, with cmd.Cmd's plain loop (`use_rawinput = False`):

- the page's Continue / Step over put `c` / `n` in the hub's queue; the line is echoed
  after the prompt (`c   # from the browser view`), so the transcript shows it;
- the terminal: `select()` on the stdin file descriptor with a short timeout, reading the
  descriptor itself (os.read), so Python's buffering cannot hide a typed line. Lines
  already in `sys.stdin`'s buffer when the view started (a pipe) are read first.
- end of input on a pipe or file (a closed pipe, `< /dev/null`) does not quit the program
  as it would in pdb: the page stays in charge (a note says so once). Ctrl-D at a
  terminal is pdb's EOF as usual; Ctrl-C works as in pdb.

On a terminal this trades IPython's prompt (colours, completion, history) for the plain
one while the view is on; the kernel's line editing still works. Decided so because
prompt_toolkit's prompt cannot be fed from another thread.
"""
from __future__ import annotations

import cmd
import os
import queue
import select
import sys

from . import state as _state

POLL_S = 0.05
FROM_PAGE = "   # from the browser view"


class LineSource:
    """A file-like `readline()` returning the next command from the page or the terminal."""

    def __init__(self, hub: _state.Hub, stdin=None, stdout=None, prompt: str = ""):
        self.hub = hub
        self.prompt = prompt    # drawn again after the end-of-input note
        self.stdin = stdin if stdin is not None else sys.stdin
        self.stdout = stdout if stdout is not None else sys.stdout
        self._lines: list[str] = []
        self._partial = b""
        self._eof = False
        self._told_eof = False
        try:
            self._fd = self.stdin.fileno()
        except (AttributeError, OSError, ValueError):
            self._fd = None    # a stream without a descriptor (StringIO): read it directly

    def readline(self) -> str:
        self._take_buffered()
        while True:
            try:
                line = self.hub.commands.get_nowait()
            except queue.Empty:
                line = None
            if line is not None:
                self._echo(line)
                return line + "\n"
            if self._lines:
                return self._lines.pop(0)
            if self._eof:
                self._note_eof()
                try:
                    line = self.hub.commands.get(timeout=0.25)
                except queue.Empty:
                    continue
                self._echo(line)
                return line + "\n"
            if self._fd is None:
                text = self.stdin.readline()
                if text:
                    return text
                self._eof = True
                continue
            self._read_fd()

    # -- the terminal ----------------------------------------------------------------
    def _read_fd(self) -> None:
        try:
            ready, _, _ = select.select([self._fd], [], [], POLL_S)
        except (OSError, ValueError):
            self._eof = True
            return
        if not ready:
            return
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            if os.isatty(self._fd) and not self._partial:
                self._lines.append("")      # Ctrl-D at a terminal: pdb's EOF, as usual
                return
            self._eof = True
            if self._partial:
                self._lines.append(self._decode(self._partial) + "\n")
                self._partial = b""
            return
        data = self._partial + data
        *complete, self._partial = data.split(b"\n")
        self._lines.extend(self._decode(part) + "\n" for part in complete)

    def _decode(self, raw: bytes) -> str:
        encoding = getattr(self.stdin, "encoding", None) or "utf-8"
        return raw.decode(encoding, errors="replace").rstrip("\r")

    def _take_buffered(self) -> None:
        """Lines a pipe already delivered into sys.stdin's buffer (the prompt read ahead
        before the view started) are invisible to select(): read them without blocking.
        Not on a terminal, whose descriptor is usually shared with stdout."""
        if self._fd is None or self._eof or self.stdin is not sys.stdin:
            return
        try:
            if os.isatty(self._fd):
                return
            was_blocking = os.get_blocking(self._fd)
        except OSError:
            return
        try:
            os.set_blocking(self._fd, False)
            for _ in range(10000):
                try:
                    line = self.stdin.readline()
                except (BlockingIOError, OSError, ValueError):
                    break
                if not line:
                    break
                self._lines.append(line if line.endswith("\n") else line + "\n")
        finally:
            try:
                os.set_blocking(self._fd, was_blocking)
            except OSError:
                pass

    def _echo(self, line: str) -> None:
        try:
            self.stdout.write(line + FROM_PAGE + "\n")
            self.stdout.flush()
        except Exception:  # noqa: BLE001
            pass

    def _note_eof(self) -> None:
        if self._told_eof:
            return
        self._told_eof = True
        try:
            # the note interrupts a prompt already drawn: draw it again below the note,
            # so the page's command reads as typed at a prompt, like any other
            self.stdout.write("\nmldebug: stdin is closed; waiting for the browser view "
                              "(Continue / Step over there, Ctrl-C here)\n" + self.prompt)
            self.stdout.flush()
        except Exception:  # noqa: BLE001
            pass


_sources: dict = {}


def _source_for(debugger, hub) -> LineSource:
    """One LineSource per debugger (it keeps lines read ahead for the next prompt)."""
    source = _sources.get(id(debugger))
    if source is None or source.hub is not hub:
        stdin = debugger.stdin if debugger.stdin is not sys.stdin else None
        source = _sources[id(debugger)] = LineSource(hub, stdin=stdin, stdout=debugger.stdout)
    source.prompt = debugger.prompt
    return source


def prompt_loop(debugger, intro=None):
    """cmd.Cmd's loop reading from the LineSource, with the page told that the program
    is paused here (and running again when the loop ends)."""
    hub = _state.hub()
    source = _source_for(debugger, hub)
    saved = debugger.stdin, debugger.use_rawinput
    debugger.stdin, debugger.use_rawinput = source, False
    stop = getattr(debugger, "_current_stop", None)
    hub.paused("prompt", stop.to_dict() if stop is not None else None,
               getattr(debugger, "curframe", None))
    try:
        return cmd.Cmd.cmdloop(debugger, intro)
    finally:
        debugger.stdin, debugger.use_rawinput = saved
        hub.running()
