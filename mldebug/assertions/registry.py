"""The process-wide table of assertions: the default library plus what the user registers.

    register_assertion(a)        an instance (or a class, instantiated); an assertion with
                                 the same name is replaced. Returns the instance.
    deregister_assertion(x)      by instance, class (all its instances) or name; returns
                                 the removed ones
    assertions()                 the registered assertions, library first
    get(name), set_enabled(name, flag)
"""
from __future__ import annotations

import threading

from ..core.errors import UsageError
from .base import VERSION, Assertion

_LOCK = threading.RLock()
_REGISTRY: list = []
_ON_REGISTER: list = []    # callables run after each registration (the runner module adds one)
_LOADED = False


def _ensure_library() -> None:
    global _LOADED
    if _LOADED:
        return
    with _LOCK:
        if _LOADED:
            return
        # the library (torch-level checks) loads with the first look at the registry,
        # not when a program imports mldebug.assertions to subclass a kind
        from .library import default_assertions
        names = {a.name for a in _REGISTRY}
        _REGISTRY[:0] = [a for a in default_assertions() if a.name not in names]
        _LOADED = True


def register_assertion(assertion) -> Assertion:
    """Add an assertion (instance or class) to the table; same name → replaced."""
    if isinstance(assertion, type) and issubclass(assertion, Assertion):
        assertion = assertion()
    if not isinstance(assertion, Assertion):
        raise UsageError("register_assertion() takes an Assertion (a subclass of one of "
                         "mldebug.assertions' kinds) or such a class, "
                         f"got {type(assertion).__name__}")
    _ensure_library()
    with _LOCK:
        for i, a in enumerate(_REGISTRY):
            if a.name == assertion.name:
                _REGISTRY[i] = assertion
                break
        else:
            _REGISTRY.append(assertion)
        VERSION[0] += 1
    for listener in list(_ON_REGISTER):
        listener()
    return assertion


def on_register(listener) -> None:
    """Call LISTENER() after each registration (the runner refreshes what it hooks)."""
    _ON_REGISTER.append(listener)


def deregister_assertion(assertion) -> list:
    """Remove by instance, class or name; returns what was removed (UsageError if none)."""
    _ensure_library()
    with _LOCK:
        if isinstance(assertion, str):
            removed = [a for a in _REGISTRY if a.name == assertion]
        elif isinstance(assertion, type):
            removed = [a for a in _REGISTRY if isinstance(a, assertion)]
        else:
            removed = [a for a in _REGISTRY if a is assertion]
        if not removed:
            raise UsageError(f"no registered assertion matches {assertion!r}")
        for a in removed:
            _REGISTRY.remove(a)
        VERSION[0] += 1
    return removed


def assertions() -> list:
    """The registered assertions (library ones included, also the ones that are off)."""
    _ensure_library()
    with _LOCK:
        return list(_REGISTRY)


def get(name: str):
    for a in assertions():
        if a.name == name:
            return a
    return None


def set_enabled(name: str, enabled: bool) -> Assertion:
    a = get(name)
    if a is None:
        known = ", ".join(x.name for x in assertions())
        raise UsageError(f"no assertion named {name!r}; registered: {known}")
    a.enabled = bool(enabled)
    return a


_ACTIVE_CACHE: dict = {}


def active(stage: str | None = None) -> list:
    """Enabled assertions checked here (not delegated), optionally for one stage.
    Cached until an assertion is registered, removed, or switched on or off."""
    key = (VERSION[0], stage)
    hit = _ACTIVE_CACHE.get(key)
    if hit is not None:
        return hit
    result = [a for a in assertions() if a.enabled and not a.delegate
              and (stage is None or stage in a.check_on)]
    if len(_ACTIVE_CACHE) > 64:
        _ACTIVE_CACHE.clear()
    _ACTIVE_CACHE[(VERSION[0], stage)] = result
    return result
