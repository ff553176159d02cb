"""`python -m mldebug attach [HOST:PORT] [--key-file FILE]`: the prompt of a rank whose
terminal cannot show it (remote_prompt.py serves it and prints the command).

The prompt's key is read from its connection file (core/prompt_key.py), which only the
job's user can read: run the command as that user, on the rank's host or on any host that
shares the home folder; elsewhere pass `--key-file` (a copy of the connection file, or a
file holding the key). Without HOST:PORT it attaches to the one prompt of yours that is
waiting, or lists them when there are several.

Lines typed here go to that prompt, what it prints comes here. The command ends when the
program goes on (the prompt closes), or on Ctrl-D / Ctrl-C here: the connection closes
and the program stays paused for the next attach.
"""
from __future__ import annotations

import codecs
import os
import socket
import sys
import threading

from .core import prompt_key
from .core.addresses import shown

USAGE = "usage: python -m mldebug attach [HOST:PORT] [--key-file FILE]"


def _parse(argv: list[str]):
    """(address or None, key file or None); raises ValueError with what is wrong."""
    address = key_file = None
    args = list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--key-file":
            if not args:
                raise ValueError("--key-file needs a FILE")
            key_file = args.pop(0)
        elif arg.startswith("--key-file="):
            key_file = arg.split("=", 1)[1]
        elif arg in ("-h", "--help"):
            raise ValueError("")
        elif address is None:
            host, sep, port = arg.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"expected HOST:PORT, got {arg!r}")
            address = (host.strip("[]") or "127.0.0.1", int(port))
        else:
            raise ValueError(f"unexpected argument {arg!r}")
    return address, key_file


def _the_waiting_prompt():
    """(host, port) of this user's one waiting prompt; raises ValueError otherwise."""
    found = prompt_key.waiting()
    if not found:
        raise LookupError("no prompt of yours is waiting (a rank's stop prints the "
                          "address to attach to)")
    if len(found) > 1:
        listing = "\n".join(f"  python -m mldebug attach {r['host']}:{r['port']}    "
                            f"rank {r.get('rank')} on {r.get('hostname')}: "
                            f"{str(r.get('message', ''))[:70]}" for r in found)
        raise LookupError(f"{len(found)} prompts of yours are waiting; name one:\n{listing}")
    return found[0]["host"], int(found[0]["port"])


def _read_line(conn: socket.socket, limit: int = 4096) -> str:
    data = b""
    while not data.endswith(b"\n") and len(data) < limit:
        chunk = conn.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace")


def attach_main(argv: list[str]) -> int:
    try:
        address, key_file = _parse(argv)
    except ValueError as exc:
        print(f"mldebug attach: {exc}\n{USAGE}" if str(exc) else USAGE, file=sys.stderr)
        return 2
    if address is None:
        try:
            address = _the_waiting_prompt()
        except LookupError as exc:
            print(f"mldebug attach: {exc}", file=sys.stderr)
            return 1 if "no prompt" in str(exc) else 2
    host, port = address
    where = shown(host, port)
    try:
        conn = socket.create_connection((host, port), timeout=10)
    except OSError as exc:
        print(f"mldebug attach: cannot connect to {where}: {exc.strerror or exc} (is the "
              "rank still paused? the address is printed at its stop)", file=sys.stderr)
        return 1
    try:
        key = prompt_key.read_key_file(key_file) if key_file else prompt_key.key_for(host,
                                                                                    port)
    except (OSError, ValueError) as exc:
        print(f"mldebug attach: cannot read the key from {key_file}: "
              f"{getattr(exc, 'strerror', None) or exc}", file=sys.stderr)
        conn.close()
        return 1
    try:
        nonce = prompt_key.parse_challenge(_read_line(conn))
        if nonce is None:
            print(f"mldebug attach: {where} is not an mldebug prompt", file=sys.stderr)
            return 1
        if key is None:
            print(f"mldebug attach: no key for {where}: run this as the job's user, where "
                  f"its connection file is ({prompt_key.attach_dir_hint()}), or pass "
                  f"--key-file FILE", file=sys.stderr)
            return 1
        conn.sendall((prompt_key.answer(key, nonce) + "\n").encode("ascii"))
        reply = _read_line(conn)
    except OSError as exc:
        print(f"mldebug attach: {where}: {exc.strerror or exc}", file=sys.stderr)
        conn.close()
        return 1
    if reply.strip() != prompt_key.ACCEPTED:
        print(reply.strip() or f"mldebug attach: {where} closed the connection",
              file=sys.stderr)
        conn.close()
        return 1
    conn.settimeout(None)
    return _relay(conn)


def _relay(conn: socket.socket) -> int:
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def relay_output():
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                data = b""
            if not data:
                # the prompt closed (the program went on): end here, not at the next
                # line typed (the main thread is blocked reading the terminal)
                sys.stdout.flush()
                os._exit(0)
            sys.stdout.write(decoder.decode(data))
            sys.stdout.flush()

    threading.Thread(target=relay_output, daemon=True).start()
    try:
        for line in sys.stdin:
            conn.sendall(line.encode("utf-8"))
    except (KeyboardInterrupt, OSError):
        pass
    finally:
        try:
            conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        threading.Event().wait(5)      # what the rank still prints (its thread exits us)
        conn.close()
    return 0
