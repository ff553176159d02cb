"""A rank's prompt where its terminal cannot show it: on a socket, for
`python -m mldebug attach HOST:PORT`, guarded by a key only the job's user can read.

Under torchrun every rank shares the launcher's terminal, and `--local-ranks-filter`,
`--redirects`, `--tee` or a plain `> train.log` send a rank's output to a file or nowhere:
a prompt opened there would look like a hang. When a rank of a multi-process job stops,
its stdin or stdout is not a terminal and no browser view runs (its buttons drive the
prompt), the prompt is served instead on a TCP port of this host (127.0.0.1 unless
MLDEBUG_ATTACH_HOST says otherwise). The program stays paused until a client attaches;
the prompt is mldebug's plain one (pdb's commands, `inspect`, `why`, ...).

The door (core/prompt_key.py): a random key per prompt, in a 0600 connection file that
`attach` finds when run by the same user; a connection that cannot answer the key's
challenge gets one line and runs nothing, and the prompt keeps waiting. While a client
is attached, any other connection is turned away with one line. A client that leaves
(Ctrl-D, a dropped ssh session) detaches: the prompt waits for the next attach, with the
same address and key; `c` goes on and `q` ends the program, as at any prompt.

Where the attach command is printed (`announce`): the launching shell's terminal (the
controlling terminal, else the launcher's own stderr through /proc when it is a terminal,
a pipe, or a file opened for appending), else this rank's own stderr. A file the launcher
writes without O_APPEND (`torchrun ... > train.log`) is never opened by path: a second
open would write at an offset of its own (and "w" would truncate it); this rank's own
stderr, which the launcher handed down, shares the launcher's offset, so the line lands in
order after everything the job printed.
"""
from __future__ import annotations

import os
import socket
import stat
import threading

from . import view as _view
from .core import prompt_key
from .core.addresses import is_loopback, shown
from .core.ranks import this_rank


def _terminal_usable() -> bool:
    try:
        return os.isatty(0) and os.isatty(1)
    except (OSError, ValueError):
        return False


# -- where the user sees a line ------------------------------------------------------
def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _opened_for_append(pid: int, fd: int) -> bool:
    try:
        with open(f"/proc/{pid}/fdinfo/{fd}", encoding="ascii") as info:
            for line in info:
                if line.startswith("flags:"):
                    return bool(int(line.split()[1], 8) & os.O_APPEND)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _open_launcher_stderr():
    """A new descriptor on the launcher's stderr when a line written there is seen and
    harms nothing: a terminal, a pipe, or a file it appends to; None otherwise (among
    them: a file that is also this rank's own stderr, written there instead)."""
    pid = os.getppid()
    path = f"/proc/{pid}/fd/2"
    try:
        theirs = os.stat(path)
    except OSError:
        return None
    try:
        if _same_file(theirs, os.fstat(2)):
            return None
    except OSError:
        pass
    kind = theirs.st_mode
    if stat.S_ISREG(kind) and not _opened_for_append(pid, 2):
        return None
    if not (stat.S_ISREG(kind) or stat.S_ISCHR(kind) or stat.S_ISFIFO(kind)):
        return None
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
    except OSError:
        return None
    if stat.S_ISCHR(kind) and not os.isatty(fd):     # /dev/null and the like
        os.close(fd)
        return None
    return fd


def _open_terminal():
    try:
        return os.open("/dev/tty", os.O_WRONLY | os.O_APPEND | os.O_NOCTTY)
    except OSError:
        return None


def announce(text: str) -> str:
    """Write TEXT where the user sees it (see the module's docstring); returns which
    place that was: 'terminal', 'launcher' or 'stderr'. Never truncates, never seeks."""
    for place, opener in (("terminal", _open_terminal), ("launcher", _open_launcher_stderr)):
        fd = opener()
        if fd is None:
            continue
        try:
            os.write(fd, text.encode("utf-8", "replace"))
            return place
        except OSError:
            continue
        finally:
            os.close(fd)
    prompt_key.tell(text)
    return "stderr"


# -- the connection's two ends, as the debugger's stdin and stdout ---------------------
class _Reader:
    """The debugger's stdin: lines of the attached client; when it leaves, the next."""

    def __init__(self, door: "_Door"):
        self.door = door

    def readline(self, size: int = -1) -> str:
        while True:
            try:
                line = self.door.reader.readline()
            except (OSError, ValueError):
                line = ""
            if line:
                return line
            self.door.detach()           # blocks until the next client has the key


class _Writer:
    """The debugger's stdout: the attached client's; output with no one there is lost,
    never an error in the paused program."""
    encoding = "utf-8"

    def __init__(self, door: "_Door"):
        self.door = door

    def write(self, text: str) -> int:
        try:
            self.door.writer.write(text)
        except (OSError, ValueError, AttributeError):
            pass
        return len(text)

    def flush(self) -> None:
        try:
            self.door.writer.flush()
        except (OSError, ValueError, AttributeError):
            pass

    def isatty(self) -> bool:
        return False


class _Door:
    """One served prompt: its listening socket, key and connection file, the attached
    client, and a thread that turns other connections away while one is attached."""

    def __init__(self, host: str, info, stop):
        self.host, self.info, self.stop = host, info, stop
        self.server = socket.create_server((host, 0), family=(
            socket.AF_INET6 if ":" in host else socket.AF_INET))
        self.port = self.server.getsockname()[1]
        self.key = prompt_key.new_key()
        try:
            self.file = prompt_key.ConnectionFile(host, self.port, self.key, rank=info.rank,
                                                  message=stop.message)
        except OSError:
            self.server.close()
            raise
        self.conn = self.reader = self.writer = None
        self._refusals = 0
        self._busy = threading.Event()
        self._away = None
        self.prompt = "(mldebug) "
        self.show_where = lambda: None     # the debugger's current line, to a new client

    # the announcement and the handshake
    def open(self) -> None:
        tag = self.info.tag
        address = shown(self.host, self.port)
        lines = [f"{tag}mldebug: {self.stop.message}",
                 f"{tag}mldebug: this rank's output is not on this terminal; its prompt: "
                 f"python -m mldebug attach {address}",
                 f"{tag}mldebug: (only you can attach: its key is in {self.file.path})"]
        if not is_loopback(self.host):
            lines.append(f"{tag}mldebug: (MLDEBUG_ATTACH_HOST={self.host}: what you type "
                         f"at this prompt crosses the network as plain text; an ssh "
                         f"tunnel to 127.0.0.1 is the usual answer: ssh -L "
                         f"{self.port}:127.0.0.1:{self.port} {socket.gethostname()})")
        announce("".join(line + "\n" for line in lines))
        self._accept()

    def _refused(self, why: str) -> None:
        self._refusals += 1
        if self._refusals <= prompt_key.MAX_REFUSALS_TOLD:
            prompt_key.tell(f"{self.info.tag}mldebug: the prompt refused {why} (no key)\n")

    def _accept(self) -> None:
        conn = prompt_key.await_client(self.server, self.key, self._refused)
        self.conn = conn
        self.reader = conn.makefile("r", encoding="utf-8", errors="replace", newline="\n")
        self.writer = conn.makefile("w", encoding="utf-8", errors="replace", buffering=1)
        self._busy.set()
        self._away = threading.Thread(target=self._turn_away, daemon=True,
                                      name="mldebug-prompt-door")
        self._away.pydev_do_not_trace = True
        self._away.is_pydev_daemon_thread = True
        self._away.start()

    def _turn_away(self) -> None:
        self.server.settimeout(0.2)
        while self._busy.is_set():
            try:
                other, _ = self.server.accept()
            except (socket.timeout, BlockingIOError, InterruptedError):
                continue
            except OSError:
                return
            try:
                other.settimeout(1.0)
                other.sendall(b"mldebug: refused: another client has this prompt\n")
            except OSError:
                pass
            other.close()

    def _drop_client(self, last_line: str = "") -> None:
        self._busy.clear()
        if self._away is not None:
            self._away.join()
            self._away = None
        for end in (self.writer, self.reader):
            try:
                if end is self.writer and last_line:
                    end.write(last_line)
                if end is not None:
                    end.close()
            except (OSError, ValueError):
                pass
        if self.conn is not None:
            try:
                self.conn.close()
            except OSError:
                pass
        self.conn = self.reader = self.writer = None

    def detach(self) -> None:
        """The client left without a command: wait for the next one, then show it where
        the program is."""
        self._drop_client("mldebug: detached; the program stays paused\n")
        prompt_key.tell(f"{self.info.tag}mldebug: the prompt's client left; the program "
                        f"stays paused for the next `python -m mldebug attach`\n")
        self._accept()
        self.writer.write(f"{self.info.tag}mldebug: {self.stop.message}\n")
        self.show_where()
        self.writer.write(self.prompt)
        self.writer.flush()

    def close(self) -> None:
        self._drop_client("mldebug: the program goes on; this prompt closes\n")
        try:
            self.server.close()
        except OSError:
            pass
        self.file.remove()


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
        try:
            door = _Door(self.host, info, stop)
        except OSError as exc:
            announce(f"{info.tag}mldebug: {stop.message}\n{info.tag}mldebug: this rank's "
                     f"prompt cannot be served ({exc.strerror or exc}); it reads this "
                     f"rank's stdin\n")
            return self.debugger.pause_at(stop, frame)
        try:
            door.open()
            self._pause_on(stop, frame, door)
        finally:
            door.close()

    def _pause_on(self, stop, frame, door: _Door) -> None:
        d = self.debugger
        saved = d.stdin, d.stdout, d.use_rawinput
        d.stdin, d.stdout, d.use_rawinput = _Reader(door), _Writer(door), False
        door.prompt = d.prompt

        def show_where():
            if getattr(d, "stack", None) and 0 <= d.curindex < len(d.stack):
                d.print_stack_entry(d.stack[d.curindex])
        door.show_where = show_where
        d.remote_prompt = True         # the plain cmd loop (debugger._cmdloop_of_frontend)
        try:
            d.pause_at(stop, frame)
        finally:
            d.stdin, d.stdout, d.use_rawinput = saved
            d.remote_prompt = False
