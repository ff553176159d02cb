"""A small Debug Adapter Protocol client for tests: talks to the REAL debugpy adapter.

    with DapClient.start_adapter() as dap:           # `python -m debugpy.adapter` on stdio
        dap.initialize()
        dap.launch({"module": "mldebug", "args": [prog], ...})   # sends, does not wait
        dap.wait_event("initialized")
        dap.request("configurationDone")
        stopped = dap.wait_event("stopped")

    with DapClient.connect("127.0.0.1", port) as dap:   # the adapter `debugpy.listen` started

Messages are plain dicts. A reader thread parses `Content-Length` frames into a queue;
`request` waits for the matching response, `wait_event` for the first event of a name
(events seen while waiting are kept, so none is lost). Every wait has a timeout and says
what it saw when it gives up. Reverse requests from the adapter (`runInTerminal`) are
answered with a failure: the tests use `console: internalConsole`.
"""
from __future__ import annotations

import itertools
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

DEFAULT_TIMEOUT = 20.0


class DapError(AssertionError):
    """The adapter did not answer as expected (a test failure, with what was seen)."""


class DapClient:
    def __init__(self, reader, writer, process: Optional[subprocess.Popen] = None,
                 sock: Optional[socket.socket] = None, name: str = "dap"):
        self._reader = reader
        self._writer = writer
        self._process = process
        self._sock = sock
        self._name = name
        self._seq = itertools.count(1)
        self._write_lock = threading.Lock()
        self._inbox: "queue.Queue[Optional[dict]]" = queue.Queue()
        self._pending: list[dict] = []       # received, not yet taken by a wait
        self.log: list[tuple[str, dict]] = []   # ('->' | '<-', message), for failure reports
        self.output: list[str] = []          # text of every `output` event
        self.closed = False
        self._thread = threading.Thread(target=self._read_loop, name=f"{name}-reader",
                                         daemon=True)
        self._thread.start()

    # -- construction ------------------------------------------------------------------
    @classmethod
    def start_adapter(cls, env: Optional[dict] = None, log_dir: Optional[str] = None) -> "DapClient":
        """Start `python -m debugpy.adapter` speaking DAP on its stdin/stdout."""
        cmd = [sys.executable, "-m", "debugpy.adapter"]
        if log_dir:
            cmd += ["--log-dir", str(log_dir)]
        process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, env=env,
                                   start_new_session=True)
        return cls(process.stdout, process.stdin, process=process, name="adapter")

    @classmethod
    def connect(cls, host: str, port: int, timeout: float = DEFAULT_TIMEOUT) -> "DapClient":
        """Connect over TCP to an adapter that listens (e.g. the one `debugpy.listen` runs)."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                sock = socket.create_connection((host, port), timeout=2)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise DapError(f"cannot connect to {host}:{port}: {exc}") from None
                time.sleep(0.1)
        sock.settimeout(None)
        stream = sock.makefile("rwb", buffering=0)
        return cls(stream, stream, sock=sock, name=f"{host}:{port}")

    def __enter__(self) -> "DapClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- wire --------------------------------------------------------------------------
    def _read_loop(self) -> None:
        try:
            while True:
                headers = {}
                while True:
                    line = self._reader.readline()
                    if not line:
                        return
                    line = line.decode("ascii", "replace").strip()
                    if not line:
                        break
                    key, _, value = line.partition(":")
                    headers[key.strip().lower()] = value.strip()
                length = int(headers.get("content-length", "0"))
                body = b""
                while len(body) < length:
                    chunk = self._reader.read(length - len(body))
                    if not chunk:
                        return
                    body += chunk
                message = json.loads(body.decode("utf-8"))
                self.log.append(("<-", message))
                if message.get("type") == "event" and message.get("event") == "output":
                    self.output.append(message.get("body", {}).get("output", ""))
                if message.get("type") == "request":   # reverse request: not supported here
                    self._send({"type": "response", "request_seq": message["seq"],
                                "command": message.get("command"), "success": False,
                                "message": "not supported by the test client"})
                    continue
                self._inbox.put(message)
        except (OSError, ValueError):
            return
        finally:
            self._inbox.put(None)

    def _send(self, message: dict) -> None:
        message = dict(message, seq=next(self._seq))
        data = json.dumps(message).encode("utf-8")
        self.log.append(("->", message))
        with self._write_lock:
            self._writer.write(b"Content-Length: %d\r\n\r\n" % len(data) + data)
            self._writer.flush()
        return message["seq"]

    def _take(self, predicate: Callable[[dict], bool], timeout: float, what: str) -> dict:
        for i, message in enumerate(self._pending):
            if predicate(message):
                return self._pending.pop(i)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DapError(f"timed out after {timeout:.0f}s waiting for {what}; "
                               f"last messages:\n{self.transcript(12)}")
            try:
                message = self._inbox.get(timeout=left)
            except queue.Empty:
                continue
            if message is None:
                self._inbox.put(None)   # stay closed for the next waiter
                raise DapError(f"connection closed while waiting for {what}; "
                               f"last messages:\n{self.transcript(12)}")
            if predicate(message):
                return message
            self._pending.append(message)

    def transcript(self, last: int = 20) -> str:
        lines = []
        for direction, message in self.log[-last:]:
            text = json.dumps(message)
            lines.append(f"  {direction} {text[:400]}{'...' if len(text) > 400 else ''}")
        return "\n".join(lines)

    # -- requests and events -----------------------------------------------------------
    def send_request(self, command: str, arguments: Optional[dict] = None) -> int:
        """Send a request without waiting; returns its seq for `response`."""
        message = {"type": "request", "command": command}
        if arguments is not None:
            message["arguments"] = arguments
        return self._send(message)

    def response(self, seq: int, timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> dict:
        message = self._take(lambda m: m.get("type") == "response" and m.get("request_seq") == seq,
                             timeout, f"the response to request {seq}")
        if check and not message.get("success"):
            raise DapError(f"request {message.get('command')} failed: {message.get('message')}; "
                           f"body={message.get('body')}")
        return message

    def request(self, command: str, arguments: Optional[dict] = None,
                timeout: float = DEFAULT_TIMEOUT, check: bool = True) -> dict:
        """Send a request and return its response body (the whole response if check=False)."""
        response = self.response(self.send_request(command, arguments), timeout, check)
        return response.get("body", {}) if check else response

    def wait_event(self, event: str, timeout: float = DEFAULT_TIMEOUT,
                   predicate: Optional[Callable[[dict], bool]] = None) -> dict:
        """The body of the first event named EVENT (and matching PREDICATE on its body)."""
        ending = {"exited", "terminated"} - {event}

        def match(m):
            if m.get("type") != "event":
                return False
            if m.get("event") in ending:   # the debuggee ended: waiting longer is pointless
                return True
            return m.get("event") == event and (predicate is None or predicate(m.get("body", {})))
        message = self._take(match, timeout, f"event {event!r}")
        if message.get("event") != event:
            self._pending.insert(0, message)
            raise DapError(f"the debuggee ended ({message.get('event')}) while waiting for "
                           f"event {event!r}; its output:\n{''.join(self.output)[-3000:]}")
        return message.get("body", {})

    def has_event(self, event: str) -> bool:
        return any(m.get("type") == "event" and m.get("event") == event for m in self._pending)

    # -- the usual sequences -----------------------------------------------------------
    def initialize(self) -> dict:
        return self.request("initialize", {
            "clientID": "mldebug-tests", "clientName": "mldebug tests", "adapterID": "debugpy",
            "pathFormat": "path", "linesStartAt1": True, "columnsStartAt1": True,
            "supportsVariableType": True, "supportsRunInTerminalRequest": False,
            "supportsStartDebuggingRequest": False, "locale": "en-us"})

    def start(self, command: str, arguments: dict, exception_filters=("uncaught",),
              breakpoints: Optional[dict] = None) -> dict:
        """`launch`/`attach`, then the configuration phase; returns the launch response."""
        seq = self.send_request(command, arguments)
        self.wait_event("initialized")
        for path, lines in (breakpoints or {}).items():
            self.request("setBreakpoints", {"source": {"path": str(path)},
                                            "breakpoints": [{"line": n} for n in lines]})
        self.request("setExceptionBreakpoints", {"filters": list(exception_filters)})
        self.request("configurationDone")
        return self.response(seq, timeout=DEFAULT_TIMEOUT)

    def top_frame(self, thread_id: int) -> dict:
        frames = self.request("stackTrace", {"threadId": thread_id, "startFrame": 0,
                                             "levels": 20})["stackFrames"]
        if not frames:
            raise DapError("stackTrace returned no frames")
        return frames[0]

    def variables_of_frame(self, frame_id: int, scope: str = "Locals") -> dict:
        """{name: variable} of one scope of a frame."""
        scopes = self.request("scopes", {"frameId": frame_id})["scopes"]
        chosen = [s for s in scopes if s["name"].lower().startswith(scope.lower())] or scopes
        ref = chosen[0]["variablesReference"]
        return {v["name"]: v for v in self.request("variables", {"variablesReference": ref})["variables"]}

    def evaluate(self, expression: str, frame_id: int, context: str = "repl") -> dict:
        return self.request("evaluate", {"expression": expression, "frameId": frame_id,
                                         "context": context})

    # -- teardown ----------------------------------------------------------------------
    def close(self) -> None:
        """Disconnect (terminating a launched debuggee), then make sure the adapter is gone.
        The reader thread is never closed under its feet (that blocks on the stream's
        lock): the process exits or the socket is shut down, and it sees EOF."""
        if self.closed:
            return
        self.closed = True
        try:
            seq = self.send_request("disconnect", {"terminateDebuggee": True})
            self.response(seq, timeout=5, check=False)
        except (OSError, DapError, ValueError):
            pass
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        if self._process is not None:
            try:
                self._writer.close()
            except OSError:
                pass
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                _kill_group(self._process)
        self._thread.join(timeout=5)


def _kill_group(process: subprocess.Popen) -> None:
    """Kill a process we started in its own session, and what it started."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        process.kill()
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
