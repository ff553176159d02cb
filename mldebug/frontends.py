"""Which front end pauses a session that none was set up for.

A plain script (`with mldebug.watch():`, no CLI) or a plain debugpy session meets its
first stop with an empty pause slot: pause in the DAP client debugpy serves, else at
mldebug's prompt; where stdin is not a terminal (a scheduler's job, a closed stdin) nobody
can answer a prompt, and the stop ends the run with its report line and a `StopError`
(core/batch_end.py; an IPython kernel keeps the prompt: it reads input through its front
end). Registered as `Session.default_pauser` by mldebug/__init__.py, so the
session (the bottom layer) never imports a front end.
"""
from __future__ import annotations

from . import dap as _dap
from . import debugger as _debugger
from .core.batch_end import EndingPauser, prompt_answerable
from .core.session import Pauser, Session
from .dap.pauser import DapPauser


def default_pauser(session: Session) -> Pauser:
    if _dap.debugger_active():
        return DapPauser(session)
    if not prompt_answerable():
        return EndingPauser(session, hint="run it in a terminal, or under `python -m "
                                          "mldebug`, for mldebug's prompt there")
    return _debugger.get_debugger(session).pause_at
