"""Bad clients at the browser view's door (mldebug/view/server.py): binary junk, a 10 MB
line, half a request, a client that connects and never speaks, junk and a 10 MB message
on an authenticated websocket, several at once. The program (a script that started the
view, in a subprocess) is not harmed, nothing is printed on its terminal, and the right
client still gets the page and a Bokeh session.
"""
from __future__ import annotations

import asyncio
import os
import re
import socket
import subprocess
import sys
import threading
import types
import urllib.request

import pytest

from conftest import clean_env

PROGRAM = """
import sys
import torch
import mldebug
mldebug.view(0)
x = torch.arange(6.0)
sys.stdin.read()                      # until the test is done at the door
print("sum", x.sum().item(), flush=True)
"""


@pytest.fixture
def server(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROGRAM)
    proc = subprocess.Popen([sys.executable, str(prog)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env(), cwd=tmp_path)
    line = proc.stderr.readline()
    found = re.search(r"browser view at http://127\.0\.0\.1:(\d+)/\?token=(\S+)", line)
    assert found, line + proc.stderr.read()
    yield types.SimpleNamespace(proc=proc, port=int(found.group(1)), token=found.group(2))
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _page(server):
    """(cookie, Bokeh session token) of a right client's page load."""
    url = f"http://127.0.0.1:{server.port}/?token={server.token}"
    with urllib.request.urlopen(url, timeout=20) as r:
        assert r.status == 200
        cookie = r.headers["Set-Cookie"].split(";")[0]
        html = r.read().decode()
    return cookie, re.search(r'"token":"([^"]+)"', html).group(1)


async def _session(server, cookie, token, junk=None):
    """Open the page's websocket as Bokeh's client does; returns its first message, and
    what came after JUNK was sent (None: the server closed the socket)."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect
    request = HTTPRequest(f"ws://127.0.0.1:{server.port}/ws",
                          headers={"Origin": f"http://127.0.0.1:{server.port}",
                                   "Cookie": cookie})
    conn = await websocket_connect(request, subprotocols=["bokeh", token],
                                   max_message_size=64 << 20)
    first = await asyncio.wait_for(conn.read_message(), 20)
    after = None
    if junk is not None:
        await conn.write_message(junk, binary=isinstance(junk, bytes))
        after = await asyncio.wait_for(conn.read_message(), 20)
        if after is not None:   # an error reply: the server closes the socket next
            await asyncio.wait_for(conn.read_message(), 20)
    conn.close()
    return first, after


def _raw(server, data: bytes, shut=False) -> bytes:
    """Send DATA on a plain TCP connection; what the server answers before it closes."""
    conn = socket.create_connection(("127.0.0.1", server.port), timeout=20)
    try:
        try:
            conn.sendall(data)
            if shut:
                conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass                    # closed on us mid-send (a 10 MB line)
        got = b""
        try:
            while chunk := conn.recv(65536):
                got += chunk
        except OSError:
            pass
        return got
    finally:
        conn.close()


def test_bad_clients_harm_neither_the_view_nor_the_program(server):
    silent = socket.create_connection(("127.0.0.1", server.port), timeout=20)   # never speaks
    answers = {}

    def run(name, data, shut=False):
        answers[name] = _raw(server, data, shut)

    abusers = [threading.Thread(target=run, args=a) for a in (
        ("junk", os.urandom(4000)),
        ("huge line", b"GET /?token=" + b"A" * (10 << 20) + b" HTTP/1.1\r\n\r\n"),
        ("half", b"GET /?token=" + server.token.encode()[:5], True),
        ("no token", b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"))]
    for t in abusers:
        t.start()
    cookie, token = _page(server)          # the right client, while those are at the door

    async def websockets():
        return await asyncio.gather(
            _session(server, cookie, token, os.urandom(3000)),           # binary junk
            _session(server, cookie, token, "x" * (10 << 20)),           # a 10 MB message
            _session(server, cookie, token, '{"not": "bokeh"}'),
            _session(server, cookie, token))                             # a right one
    results = asyncio.run(websockets())
    for t in abusers:
        t.join(timeout=60)
    assert all('"msgtype": "ACK"' in first for first, _ in results)
    assert answers["no token"].startswith(b"HTTP/1.1 403")
    assert not answers["junk"].startswith(b"HTTP/1.1 200")
    assert not answers["huge line"].startswith(b"HTTP/1.1 200")
    assert answers["half"] == b""
    silent.close()
    # afterwards: the page and a Bokeh session still work, the program computes the same
    cookie, token = _page(server)
    first, _ = asyncio.run(_session(server, cookie, token))
    assert '"msgtype": "ACK"' in first
    out, err = server.proc.communicate("", timeout=60)
    assert server.proc.returncode == 0 and out == "sum 15.0\n"
    assert err == "", err           # nothing of the door's troubles on the terminal
