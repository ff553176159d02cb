"""mldebug: a debugger that speaks machine learning.

Public API (all lazy, so `import mldebug` stays cheap and patches nothing):
    summary(x)            one-glance summary of a tensor / array (TensorSummary)
    describe(obj)         the multi-line text that `inspect` prints
    set_trace(frame=None) open mldebug's debugger here (PYTHONBREAKPOINT=mldebug.set_trace)
    watch(...)            break on the first NaN/Inf (context manager / handle with close())
    allow(*patterns)      exempt ops or modules from the watch
    record(model, ...)    record stats/histograms over training steps into runs/NAME.sqlite
    log_tensor / log_scalar / log_note   named tensors, KPIs, notes of the recording
    view(port=None)       start the browser view (once); returns its URL with the token
    inspect(x, name=None, wait=False)   add x to the browser view's inspect list; wait
                          blocks until Continue in the page (returns x)
    last_stop()           the Stop of the latest stop (None before any): `to_dict()` is
                          the --report JSON
    %load_ext mldebug     IPython/Jupyter: %mldebug on|off|status, %%mldebug, %inspect
"""
from __future__ import annotations

import logging as _logging

from .core.version import __version__  # noqa: F401

# One logger for the package (each module logs to `mldebug.<module>`), quiet unless the
# program configures logging or the CLI runs with -v: a library does not print.
_logging.getLogger(__name__).addHandler(_logging.NullHandler())

from .core.errors import MLDebugError, NonFiniteError, StopError, UsageError  # noqa: F401

# The summaries are imported eagerly: they need only numpy and torch, which every user
# of mldebug has loaded anyway.
from .summaries import TensorSummary, describe, summary  # noqa: E402,F401

from .core import session as _session_module  # noqa: E402
from .core.session import Session as _Session  # noqa: E402


def _default_pauser(session):
    # lazy: the prompt and debugpy's glue load only when a stop needs them, never at
    # `import mldebug`
    from .frontends import default_pauser
    return default_pauser(session)


_Session.default_pauser = _default_pauser

def last_stop():
    """The Stop of the process's latest stop (NaN/Inf, assertion, exception, breakpoint),
    or None before any; `last_stop().to_dict()` is its line of the --report JSON."""
    session = _session_module.current_if_any()
    return session.stops[-1] if session is not None and session.stops else None


def load_ipython_extension(shell):
    """`%load_ext mldebug` (mldebug/notebook): the magics, loaded only when asked."""
    from .notebook import load_ipython_extension as load
    load(shell)


def unload_ipython_extension(shell):
    from .notebook import unload_ipython_extension as unload
    unload(shell)


_LAZY = {
    "set_trace": ("debugger", "set_trace"),
    "post_mortem": ("debugger", "post_mortem"),
    "watch": ("watch", "watch"),
    "allow": ("watch", "allow"),
    # `mldebug.record` is the callable package (like `watch`): record(model, ...) and
    # record.open_run(...) both work
    "record": ("record", "record"),
    "log_tensor": ("record", "log_tensor"),
    "log_scalar": ("record", "log_scalar"),
    "log_note": ("record", "log_note"),
    "Stop": ("core.records", "Stop"),
    "Violation": ("core.records", "Violation"),
    "trace": ("graph", "trace"),
    "scan": ("assertions.scan", "scan"),
    "Graph": ("graph", "Graph"),
    "register_assertion": ("assertions", "register_assertion"),
    "deregister_assertion": ("assertions", "deregister_assertion"),
    "assertions": ("assertions", "assertions"),
    # the browser view; `view` is the (callable) package itself, as `watch` is
    "view": ("view", "view"),
    "inspect": ("view", "inspect"),
}


def __getattr__(name):
    try:
        module_name, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'mldebug' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(f".{module_name}", __name__), attr)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
