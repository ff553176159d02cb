"""mldebug in IPython and Jupyter: `%load_ext mldebug` registers

    %mldebug on|off|status [--break-on KINDS] [--allow PATTERN] [--watch on|off|exact]
    %%mldebug [options]      the same for one cell
    %inspect EXPR            the summary of a tensor, array, module or container

A NaN/Inf in a watched cell stops there: mldebug's prompt through the notebook's input
box where the front end allows input, else the cell ends with `StopInCell` naming the
stop; `mldebug.last_stop()` returns the Stop either way. Between cells nothing of
mldebug is installed (cell.py). A `TensorSummary` shows as HTML (summaries/html.py), a
Graph (`mldebug.trace(model, x)`) as the view's graph figure (display.py).
"""
from __future__ import annotations

from . import display as _display
from ..core import session as _session
from .cell import CellPauser, StopInCell  # noqa: F401
from .magics import MLDebugMagics, NotebookDebug

__all__ = ["load_ipython_extension", "unload_ipython_extension", "StopInCell"]

_STATES: dict = {}   # id(shell) -> NotebookDebug


def load_ipython_extension(shell) -> None:
    """`%load_ext mldebug`: register the magics and the Graph's display (idempotent);
    starts nothing."""
    if id(shell) in _STATES:
        return
    state = _STATES[id(shell)] = NotebookDebug(shell)
    shell.register_magics(MLDebugMagics(shell, state))
    # a watch the user starts in a cell (`with mldebug.watch():`) stops as %mldebug's
    # do: the prompt in the input box, or StopInCell, never a wait for input that
    # cannot come
    session = _session.current()
    if session.pauser is None:
        session.pauser = CellPauser(shell, session)
    _display.register(shell)         # mldebug.trace(...)'s Graph shows inline


def unload_ipython_extension(shell) -> None:
    """`%unload_ext mldebug`: `%mldebug off`, and the magics go."""
    state = _STATES.pop(id(shell), None)
    if state is None:
        return
    state.turn_off()
    _display.unregister(shell)
    magics = shell.magics_manager.magics
    for kind, names in (("line", ("mldebug", "inspect")), ("cell", ("mldebug",))):
        for name in names:
            magics[kind].pop(name, None)
