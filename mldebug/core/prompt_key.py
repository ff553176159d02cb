"""The key of a rank's remote prompt: remote_prompt.py serves the prompt on a socket,
`python -m mldebug attach` (attach.py) is its client.

A prompt runs Python as the job's user, so only that user may reach it:
- Each prompt has a random key of 32 bytes, kept in a connection file, 0600, in a folder
  only the user can open (`user_files.private_dir("attach")`, under ~/.cache/mldebug by
  default), named after the prompt's process and port: `attach HOST:PORT` run by the
  same user finds it there (on another host too where the home folder is shared);
  another user cannot read it. This is a Jupyter kernel's connection file, for a prompt.
- The key never travels. The server sends a line `mldebug-attach 1 NONCE` (a fresh random
  challenge per connection); the client answers HMAC-SHA256(key, NONCE) in hex; the
  server compares in constant time and answers `mldebug-attach ok` or one line saying why
  not, then closes. What the user types after that travels as plain text.
- `await_client` handles every connection's handshake at once with a selector (one thread:
  the paused one), so a client that connects and never speaks, sends junk, a 10 MB line,
  or half a line cannot hold the door: each gets at most HANDSHAKE_S seconds and
  MAX_ANSWER bytes, then one line and the door closes on it; the prompt keeps waiting for
  the right client.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import selectors
import socket
import sys
import time
from typing import Callable, Optional

from . import user_files

PROTOCOL = "mldebug-attach 1"
ACCEPTED = "mldebug-attach ok"
HANDSHAKE_S = 10.0       # how long a connection may take to answer the challenge
MAX_ANSWER = 1024        # bytes: an answer is 64 hex digits and a newline
MAX_REFUSALS_TOLD = 5    # refused connections named on the rank's stderr, then silence


# -- the key and the handshake ---------------------------------------------------------
def new_key() -> str:
    return secrets.token_hex(32)


def answer(key: str, nonce: str) -> str:
    """The client's answer to the challenge NONCE."""
    return hmac.new(key.encode("ascii"), nonce.encode("ascii"), hashlib.sha256).hexdigest()


def challenge_line(nonce: str) -> bytes:
    return f"{PROTOCOL} {nonce}\n".encode("ascii")


def parse_challenge(line: str) -> Optional[str]:
    """NONCE of a server's first line, or None when it is not an mldebug prompt's."""
    head, _, nonce = line.strip().rpartition(" ")
    return nonce if head == PROTOCOL and nonce else None


class _Pending:
    __slots__ = ("conn", "address", "nonce", "deadline", "buffer")

    def __init__(self, conn, address):
        self.conn, self.address = conn, address
        self.nonce = secrets.token_hex(16)
        self.deadline = time.monotonic() + HANDSHAKE_S
        self.buffer = b""


def await_client(server: socket.socket, key: str,
                 refused: Callable[[str], None] = lambda why: None) -> socket.socket:
    """Block until a connection to SERVER answers the challenge with KEY; returns it
    (blocking mode). Every other connection gets one line and is closed; REFUSED(why)
    is told of each (the rank's stderr says someone tried)."""
    server.setblocking(False)
    pending: dict = {}
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ, None)

    def drop(p: _Pending, line: str, why: str = "") -> None:
        selector.unregister(p.conn)
        pending.pop(p.conn, None)
        try:
            p.conn.setblocking(True)
            p.conn.settimeout(1.0)
            p.conn.sendall(line.encode("utf-8") + b"\n")
        except OSError:
            pass
        p.conn.close()
        if why:
            refused(f"{why} from {p.address[0]}")

    try:
        while True:
            now = time.monotonic()
            for p in [p for p in pending.values() if p.deadline <= now]:
                drop(p, f"mldebug: refused: no answer to the key's challenge within "
                        f"{HANDSHAKE_S:.0f} s", "no answer")
            timeout = min((p.deadline for p in pending.values()), default=now + 3600) - now
            for item, _ in selector.select(max(0.0, timeout)):
                if item.data is None:
                    try:
                        conn, address = server.accept()
                    except (BlockingIOError, InterruptedError):
                        continue
                    p = _Pending(conn, address)
                    try:
                        conn.setblocking(True)
                        conn.settimeout(1.0)
                        conn.sendall(challenge_line(p.nonce))
                        conn.setblocking(False)
                    except OSError:
                        conn.close()
                        continue
                    pending[conn] = p
                    selector.register(conn, selectors.EVENT_READ, p)
                    continue
                p = item.data
                try:
                    data = p.conn.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if not data:
                    drop(p, "", "a connection closed before answering")
                    continue
                p.buffer += data
                line, newline, _ = p.buffer.partition(b"\n")
                if not newline:
                    if len(p.buffer) > MAX_ANSWER:
                        drop(p, "mldebug: refused: this prompt needs its key (use "
                                "`python -m mldebug attach`)", "a line that is no answer")
                    continue
                given = line.strip().decode("ascii", "replace")
                if not hmac.compare_digest(given.encode("ascii", "replace"),
                                           answer(key, p.nonce).encode("ascii")):
                    drop(p, "mldebug: refused: this prompt needs its key (run `python -m "
                            "mldebug attach HOST:PORT` as the job's user, or pass "
                            "--key-file)", "a wrong key")
                    continue
                selector.unregister(p.conn)
                del pending[p.conn]
                for other in list(pending.values()):
                    drop(other, "mldebug: refused: another client has this prompt")
                p.conn.setblocking(True)
                p.conn.sendall(f"{ACCEPTED}\n".encode("ascii"))
                return p.conn
    finally:
        for p in list(pending.values()):
            drop(p, "")
        selector.close()


# -- connection files ------------------------------------------------------------------
def attach_dir() -> str:
    """The folder of the connection files (0700); OSError when it cannot be private."""
    return user_files.private_dir("attach")


class ConnectionFile:
    """The 0600 file that keeps a served prompt's key, removed when the prompt closes."""

    def __init__(self, host: str, port: int, key: str, **about):
        self.record = dict(about, host=host, port=port, key=key, pid=os.getpid(),
                           hostname=socket.gethostname(), started=time.time())
        self.path = os.path.join(attach_dir(), f"prompt-{os.getpid()}-{port}.json")
        user_files.replace_atomically(self.path, json.dumps(self.record).encode("utf-8"),
                                      mode=0o600)

    def remove(self) -> None:
        try:
            os.remove(self.path)
        except OSError:
            pass


def _alive(record: dict) -> bool:
    if record.get("hostname") != socket.gethostname():
        return True                       # another host's: its process cannot be asked
    try:
        os.kill(int(record["pid"]), 0)
    except (OSError, KeyError, ValueError, TypeError):
        return False
    return True


def waiting() -> list[dict]:
    """The connection files of this user's prompts that are (as far as can be told)
    still served, oldest first, each with its 'path'."""
    try:
        folder = attach_dir()
        names = os.listdir(folder)
    except OSError:
        return []
    found = []
    for name in names:
        if not (name.startswith("prompt-") and name.endswith(".json")):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, encoding="utf-8") as fh:
                record = json.load(fh)
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "key" in record and _alive(record):
            found.append(dict(record, path=path))
    return sorted(found, key=lambda r: r.get("started", 0))


def key_for(host: str, port: int) -> Optional[str]:
    """The key of this user's prompt served at HOST:PORT, from its connection file: the
    same port, and the host it was served on, or any name of it (loopback for loopback,
    the node's name, or anything for a prompt served on every interface)."""
    loopback = {"127.0.0.1", "localhost", "::1"}
    for record in waiting():
        if int(record.get("port", -1)) != port:
            continue
        served = str(record.get("host", ""))
        if host == served or served in ("0.0.0.0", "::") \
                or (host in loopback and served in loopback) or host == record.get("hostname"):
            return record["key"]
    return None


def attach_dir_hint() -> str:
    """Where the connection files are, for a message (never raises)."""
    try:
        return attach_dir()
    except OSError as exc:
        return f"none: {exc}"


def read_key_file(path: str) -> str:
    """A key from PATH: a connection file (JSON with "key") or a file holding the key."""
    with open(path, encoding="utf-8") as fh:
        text = fh.read().strip()
    try:
        record = json.loads(text)
    except ValueError:
        return text
    if isinstance(record, dict) and isinstance(record.get("key"), str):
        return record["key"]
    raise ValueError(f"{path} holds no key")


def tell(text: str) -> None:
    """A line on the rank's own stderr (a refused connection): never raises."""
    try:
        sys.__stderr__.write(text)
        sys.__stderr__.flush()
    except (OSError, ValueError, AttributeError):
        pass
