"""Which front end pauses a session that none was set up for.

A plain script (`with mldebug.watch():`, no CLI) or a plain debugpy session meets its
first stop with an empty pause slot: pause in the DAP client debugpy serves, else at
mldebug's prompt. Registered as `Session.default_pauser` by mldebug/__init__.py, so the
session (the bottom layer) never imports a front end.
"""
from __future__ import annotations

from . import dap as _dap
from . import debugger as _debugger
from .core.session import Pauser, Session
from .dap.pauser import DapPauser


def default_pauser(session: Session) -> Pauser:
    if _dap.debugger_active():
        return DapPauser(session)
    return _debugger.get_debugger(session).pause_at
