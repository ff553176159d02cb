"""The Bokeh server of the browser view: its own daemon thread and tornado IOLoop, bound
to 127.0.0.1 only, guarded by a per-process token.

Safety
    - the sockets are bound to 127.0.0.1 (never another interface);
    - every Bokeh endpoint behind authentication (the page, its websocket, the session
      metadata and autoload script) needs the token: as `?token=` on the page, which
      then sets an HttpOnly, SameSite=Strict cookie named after the port that the page's
      websocket carries; without it the answer is 403 before anything else runs;
    - websocket origins: only http://127.0.0.1:PORT and http://localhost:PORT (checked
      here as well as by Bokeh, so BOKEH_ALLOW_WS_ORIGIN cannot widen it);
    - Bokeh's session ids are signed with a per-process secret (`sign_sessions`);
    - the page has no way to send code: its only messages are widget values (a dim, an
      index, an entry of the list) and two button actions (hub.ACTIONS).

Under debugpy the server thread and the worker are marked as pydevd marks its own
daemon threads (`core.threads.hide_from_debugger`): never traced, never suspended, so the page
keeps answering while VS Code holds the program.
"""
from __future__ import annotations

import asyncio
import atexit
import errno
import hmac
import logging
import queue
import secrets
import socket
import sys
import threading
from typing import Callable, Optional

from ..core.threads import hide_from_debugger

HOST = "127.0.0.1"
DEFAULT_PORT = 5006
START_TIMEOUT_S = 60


class ViewError(RuntimeError):
    """The browser view could not start (the message says why)."""


def parse_port(value) -> Optional[int]:
    """None/'' -> None (the default port); '0' -> any free port; else 1..65535.
    Raises ValueError naming the bad value."""
    if value is None or value == "":
        return None
    try:
        port = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"the view's port must be a number in 0..65535, got {value!r}") from None
    if not 0 <= port <= 65535:
        raise ValueError(f"the view's port must be in 0..65535, got {port}")
    return port


def bind(port: Optional[int], out=None) -> tuple[list, int]:
    """Listening sockets on 127.0.0.1:PORT; a port in use gives a note on OUT and any
    free port instead. Returns (sockets, port)."""
    from tornado.netutil import bind_sockets

    out = out or sys.stderr
    wanted = DEFAULT_PORT if port is None else port
    try:
        sockets = bind_sockets(wanted, HOST, family=socket.AF_INET)
    except OSError as exc:
        if exc.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise ViewError(f"cannot listen on {HOST}:{wanted}: {exc.strerror or exc}") from None
        why = "in use" if exc.errno == errno.EADDRINUSE else "not allowed"
        sockets = bind_sockets(0, HOST, family=socket.AF_INET)
        got = sockets[0].getsockname()[1]
        print(f"mldebug: view: port {wanted} is {why}; using port {got} instead",
              file=out, flush=True)
    return sockets, sockets[0].getsockname()[1]


class ViewServer:
    """One Bokeh server serving `app.make_doc` at `/` on its own thread."""

    def __init__(self, port: Optional[int] = None, out=None):
        self.token = secrets.token_urlsafe(24)
        self._secret = secrets.token_bytes(32)
        sockets, self.port = bind(port, out)
        self.origins = {f"{HOST}:{self.port}", f"localhost:{self.port}"}
        self.cookie = f"mldebug_view_{self.port}"
        self.url = f"http://{HOST}:{self.port}/?token={self.token}"
        self.loop = None
        self._error: Optional[BaseException] = None
        self._ready = threading.Event()
        self._jobs: "queue.Queue[Optional[Callable]]" = queue.Queue()

        self.thread = hide_from_debugger(threading.Thread(
            target=self._serve, args=(sockets,), name="mldebug-view", daemon=True))
        self.worker = hide_from_debugger(threading.Thread(
            target=self._work, name="mldebug-view-worker", daemon=True))
        self.worker.start()
        self.thread.start()
        if not self._ready.wait(START_TIMEOUT_S) or self._error is not None:
            raise ViewError(f"the browser view did not start: {self._error or 'timeout'}")
        atexit.register(self.close)

    # -- the server thread ---------------------------------------------------------
    def _serve(self, sockets) -> None:
        try:
            asyncio.set_event_loop(asyncio.new_event_loop())
            # bokeh and tornado (and the app built on them) load when a view starts,
            # not when mldebug does
            from bokeh.application import Application
            from bokeh.application.handlers.function import FunctionHandler
            from bokeh.server.server import BaseServer
            from bokeh.server.tornado import BokehTornado
            from tornado.httpserver import HTTPServer
            from tornado.ioloop import IOLoop

            from . import app as _app

            _quiet_loggers()
            self.loop = IOLoop.current()
            tornado_app = BokehTornado(
                {"/": Application(FunctionHandler(lambda doc: _app.make_doc(doc, self)))},
                extra_websocket_origins=sorted(self.origins),
                secret_key=self._secret, sign_sessions=True, generate_session_ids=True,
                auth_provider=_token_auth(self), use_index=False, redirect_root=False,
                websocket_max_message_size_bytes=20 * 1024 * 1024)
            http = HTTPServer(tornado_app, xheaders=False)
            http.add_sockets(sockets)
            self._server = BaseServer(self.loop, tornado_app, http)
            self._server.start()
        except BaseException as exc:  # noqa: BLE001 - reported by the starting thread
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        self.loop.start()

    def check(self, handler) -> str:
        """Authentication of one request (tornado handler): the token, as `?token=` or the
        cookie, and for a websocket the origin. Raises HTTPError(403)."""
        from tornado.web import HTTPError

        request = handler.request
        is_websocket = request.headers.get("Upgrade", "").lower() == "websocket"
        if is_websocket:
            origin = request.headers.get("Origin", "")
            host = origin.split("://", 1)[-1].rstrip("/").lower()
            if host not in self.origins:
                raise HTTPError(403, reason="websocket origin not allowed")
        given = request.query_arguments.get("token", [b""])[-1].decode("utf-8", "replace")
        if given and hmac.compare_digest(given, self.token):
            if not is_websocket:
                handler.set_cookie(self.cookie, self.token, httponly=True, samesite="Strict",
                                   path="/")
            return "mldebug"
        cookie = handler.get_cookie(self.cookie) or ""
        if cookie and hmac.compare_digest(cookie, self.token):
            return "mldebug"
        raise HTTPError(403, reason="mldebug view: token missing or wrong; "
                                    "open the URL mldebug printed")

    # -- the worker: tensor slices and summaries off the IOLoop ---------------------
    def submit(self, fn: Callable[[], None]) -> None:
        self._jobs.put(fn)

    def _work(self) -> None:
        while True:
            fn = self._jobs.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # noqa: BLE001 - a job reports its own errors to its page
                pass

    # -- stopping --------------------------------------------------------------------
    def close(self) -> None:
        """Stop serving (idempotent). At exit: let a running job finish (a daemon thread
        inside a torch kernel at interpreter teardown aborts the process)."""
        while True:
            try:
                self._jobs.get_nowait()
            except queue.Empty:
                break
        self._jobs.put(None)
        loop = self.loop
        if loop is not None and self.thread.is_alive():
            def _stop():
                try:
                    self._server.stop()
                finally:
                    loop.stop()
            try:
                loop.add_callback(_stop)
            except RuntimeError:
                pass
            self.thread.join(timeout=5)
        if self.worker.is_alive() and self.worker is not threading.current_thread():
            self.worker.join(timeout=60)


def _token_auth(server: ViewServer):
    from bokeh.server.auth_provider import AuthProvider
    from tornado.web import HTTPError

    class TokenAuth(AuthProvider):
        @property
        def get_user_async(self):
            async def check(handler):
                return server.check(handler)
            return check

        @property
        def get_login_url(self):
            def refuse(handler):
                raise HTTPError(403, reason="mldebug view: token missing or wrong")
            return refuse

    return TokenAuth()


def _quiet_loggers() -> None:
    """Refused requests and clients that break Bokeh's protocol (junk on the websocket)
    are answered or closed, not printed on the user's terminal: neither through logging's
    last-resort handler nor through the stderr handler Bokeh installs on import when the
    program configured no logging. A program that configured logging still gets them."""
    for name in ("tornado.access", "tornado.application", "tornado.general", "bokeh"):
        logger = logging.getLogger(name)
        if not any(isinstance(h, logging.NullHandler) for h in logger.handlers):
            logger.addHandler(logging.NullHandler())
    try:
        from bokeh.util import logconfig
    except ImportError:
        return
    bokeh_default = getattr(logconfig, "default_handler", None)
    if bokeh_default is not None and bokeh_default in logging.getLogger("bokeh").handlers:
        server_logger = logging.getLogger("bokeh.server")
        if not server_logger.handlers:
            server_logger.addHandler(logging.NullHandler())
        server_logger.propagate = False
