"""The assertions driven by a graph source: `scan()` around one training step (a tracer
with op detail and output gradients, the staged assertions run on it), `run()` and the
CLI's `AlwaysOn` (the always-on graph capture with a Runner listening to it).

    with mldebug.scan() as s:             # one training step: forward graph with op
        loss = model(x).mean()            # detail, output gradients after backward,
        loss.backward(); opt.step()       # and the staged assertions run on it
    s.graph, s.violations
"""
from __future__ import annotations

from typing import Optional

from ..core.session import current
from ..graph import Capture, Graph, Tracer, attach_graph
from .runner import Runner

__all__ = ["Scan", "scan", "run", "AlwaysOn"]


class Scan:
    """`with mldebug.scan() as s:` around one training step: `s.graph` (forward with op
    detail, output gradient norms after backward), and the staged assertions run on the
    step (`s.violations`). The exception of a model that raises propagates unchanged."""

    def __init__(self, ops=True, assertions=True, on_violation=None):
        self._tracer = Tracer(ops=ops, grads=True)
        self._assertions = assertions
        self._on_violation = on_violation
        self._runner = None
        self.violations: list = []

    @property
    def graph(self) -> Optional[Graph]:
        t = self._tracer
        if not t.graphs:
            return None
        mods = [g for g in t.graphs if g.root_type != "ops"]
        return max(mods or t.graphs, key=len)

    @property
    def graphs(self) -> list:
        return list(self._tracer.graphs)

    def __enter__(self):
        if self._assertions:
            self._runner = Runner(on_violation=self._collect, source=self._tracer)
            self._runner.start()
        try:
            self._tracer.__enter__()
        except BaseException:
            if self._runner is not None:
                self._runner.close()
            raise
        return self

    def _collect(self, v):
        self.violations.append(v)
        if self._on_violation is not None:
            self._on_violation(v)
        else:
            current().on_violation(v)

    def __exit__(self, exc_type, exc, tb):
        try:
            self._tracer.__exit__(exc_type, exc, tb)
        finally:
            if self._runner is not None:
                self._runner.close()
        if exc is not None and isinstance(exc, Exception) and self.graph is not None:
            attach_graph(exc, self.graph)
        return False


def scan(ops: bool = True, assertions: bool = True, on_violation=None) -> Scan:
    """Capture one training step (forward with op detail, backward, optimizer step) and
    run the staged assertions on it. `on_violation(v)` defaults to the session's."""
    return Scan(ops=ops, assertions=assertions, on_violation=on_violation)


def run(on_violation=None) -> Runner:
    """Start running the assertions (always-on, as the CLI does); returns the Runner
    (close() it, or use it as a context manager)."""
    return Runner(on_violation=on_violation).start()


class AlwaysOn:
    """What the CLI runs: the graph capture (always) and a Runner (when assertions are
    wanted). `close()` closes both (idempotent)."""

    def __init__(self, assertions: bool = True):
        self.capture = Capture().start()
        self.runner = None
        try:
            if assertions:
                self.runner = Runner(source=self.capture).start()
        except BaseException:
            self.capture.close()
            raise

    def close(self) -> None:
        try:
            if self.runner is not None:
                self.runner.close()
        finally:
            self.capture.close()
