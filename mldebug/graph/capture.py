"""The always-on capture: two global module hooks keep the graph of the latest pass of
every outermost module (what the `graph` command and the view show)."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch.nn.modules.module as _module_hooks

from ..core import replay as _replay
from ..core.compile import FLAG as _FLAG
from ..core.compile import dynamo_compiling as _dynamo_compiling
from ..core.compile import silence_global_hook_warning
from ..core.frames import warn_at_user_line
from .building import TRACING, _exception_now, _Recorder, attach_graph
from .model import Graph

_get_ident = threading.get_ident
_ACTIVE: Optional["Capture"] = None


class Capture:
    """Always-on module-level capture: the graph of the most recent pass of every outermost
    module (`graphs`, weakly keyed by the module; `last` the latest). `close()` removes
    both hooks (idempotent). Listeners (lists of callables): `module_listeners`
    f(node, module, args, output) after every module call, `pre_listeners` f(root) when
    an outermost module starts, `pass_listeners` f(graph, root) when it returned.
    A bug in the capture itself never reaches the program: it warns once and skips
    that pass."""

    def __init__(self):
        self.graphs = weakref.WeakKeyDictionary()
        self.last: Optional[Graph] = None
        self._rec: Optional[_Recorder] = None
        self._root = None
        self._handles: list = []
        self._owner = None
        self._started = False
        self.step: Optional[int] = None
        self.module_listeners: list = []
        self.pass_listeners: list = []
        self.pre_listeners: list = []

    def start(self) -> "Capture":
        global _ACTIVE
        if self._started:
            return self
        self._owner = _get_ident()
        silence_global_hook_warning()
        self._handles = [_module_hooks.register_module_forward_pre_hook(self._pre)]
        try:
            self._handles.append(_module_hooks.register_module_forward_hook(
                self._post, always_call=True))
        except TypeError:
            self._handles.append(_module_hooks.register_module_forward_hook(self._post))
        self._started = True
        if _ACTIVE is None:
            _ACTIVE = self
        return self

    def close(self) -> None:
        global _ACTIVE
        if not self._started:
            return
        self._started = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self._rec = None
        self._root = None
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @property
    def started(self) -> bool:
        return self._started

    def _pre(self, module, args):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or TRACING[0] or _replay._depth \
                or _get_ident() != self._owner:
            return None
        rec = self._rec
        try:
            if rec is None or not rec.stack or module is rec.stack[0][0]:
                # (the outermost module again while "open": a BaseException skipped the
                # post hooks of the last pass; recursion into the root is not supported)
                rec = self._rec = _Recorder(module, self.step)
                self._root = module
                self.last = rec.graph
                try:
                    self.graphs[module] = rec.graph
                except TypeError:
                    pass
                new = True
            else:
                new = False
            rec.pre(module, args)
        except Exception as exc:  # noqa: BLE001 - never break the user's forward
            self._internal_error(exc)
            return None
        if new:
            for f in self.pre_listeners:
                f(module)
        return None

    def _internal_error(self, exc) -> None:
        self._rec = None
        if not getattr(self, "_warned", False):
            self._warned = True
            warn_at_user_line(f"mldebug graph capture skipped a pass after an internal "
                              f"error: {type(exc).__name__}: {exc}")

    def _post(self, module, args, output):
        if _dynamo_compiling() or _FLAG._is_compiling_flag or TRACING[0] or _replay._depth \
                or _get_ident() != self._owner:
            return None
        rec = self._rec
        if rec is None:
            return None
        exc = _exception_now() if output is None else None
        try:
            node = rec.post(module, output, exc)
        except Exception as error:  # noqa: BLE001 - never break the user's forward
            self._internal_error(error)
            return None
        if node is None:
            return None
        if exc is not None and not rec.stack:
            attach_graph(exc, rec.graph)
        for f in self.module_listeners:
            f(node, module, args, output)
        if not rec.stack:
            self._rec = None
            if exc is None:
                for f in self.pass_listeners:
                    f(rec.graph, module)
        return None

    def current(self) -> Optional[Graph]:
        """The pass in progress, if any, else the latest."""
        return self._rec.graph if self._rec is not None else self.last

    def show(self) -> Optional[Graph]:
        """The graph the `graph` command shows: the pass in progress, else the latest pass
        of a module that has submodules (so a loss module called after the model does not
        hide it), else the latest."""
        if self._rec is not None:
            return self._rec.graph
        best = None
        for g in list(self.graphs.values()):
            if len(g) > 1 and (best is None or _order(g) > _order(best)):
                best = g
        return best or self.last


def _order(g) -> int:
    return g._serial


def active_capture() -> Optional[Capture]:
    return _ACTIVE


def last_graph() -> Optional[Graph]:
    """The graph the always-on capture would show (None when no capture runs)."""
    return _ACTIVE.show() if _ACTIVE is not None else None
