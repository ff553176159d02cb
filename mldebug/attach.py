"""`python -m mldebug attach HOST:PORT`: the prompt of a rank whose terminal cannot show
it (remote_prompt.py prints the command). Lines typed here go to that prompt,
what it prints comes here; the command ends when the program goes on (the prompt closes)
or on Ctrl-D / Ctrl-C here (the connection closes; the rank reads that as end of input).
"""
from __future__ import annotations

import os
import socket
import sys
import threading

USAGE = "usage: python -m mldebug attach HOST:PORT"


def attach_main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(USAGE, file=sys.stderr)
        return 2
    host, sep, port = argv[0].rpartition(":")
    if not sep or not port.isdigit():
        print(f"mldebug attach: expected HOST:PORT, got {argv[0]!r}\n{USAGE}", file=sys.stderr)
        return 2
    try:
        conn = socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)),
                                        timeout=10)
    except OSError as exc:
        print(f"mldebug attach: cannot connect to {argv[0]}: {exc.strerror or exc} (is the "
              "rank still paused? the address is printed at its stop)", file=sys.stderr)
        return 1
    conn.settimeout(None)

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
            sys.stdout.write(data.decode("utf-8", errors="replace"))
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
