"""trace(): one call with op-level detail (a TorchFunctionMode records the torch-level
calls between the module hooks); the tracer scan() builds on."""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import torch
import torch.nn.modules.module as _module_hooks
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..core import replay as _replay
from ..core.quiet import QUIET, own_call
from ..core.structs import tensors_in as _tensors
from .building import TRACING, _exception_now, _Recorder, attach_graph
from .model import Graph

_get_ident = threading.get_ident
_SKIP_OPS = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "stride", "is_floating_point",
    "is_complex", "__len__", "__bool__", "__index__", "__int__", "__float__", "item",
    "tolist", "data_ptr", "element_size", "is_contiguous", "get_device", "__repr__",
    "__format__", "__hash__", "__iter__", "storage_offset",
    "untyped_storage", "requires_grad_", "retain_grad", "register_hook", "backward",
    "__reduce_ex__", "__deepcopy__", "_is_view", "is_nonzero", "__contains__",
})


_DTYPES: dict = {}


class _OpMode(TorchFunctionMode):
    def __init__(self, tracer):
        super().__init__()
        self.tracer = tracer

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if QUIET[0]:
            return out
        name = getattr(func, "__name__", None) or str(func)
        if name not in _SKIP_OPS and _get_ident() == self.tracer.owner:
            try:
                if isinstance(out, Tensor) or _tensors(out):
                    self.tracer.op(name, args, kwargs, out)
            except Exception:
                pass
        return out


class Tracer:
    """Hooks for one traced region: every module call and (ops=True) torch call, with
    output-gradient norms (grads=True) recorded as backward runs."""

    def __init__(self, ops=True, grads=False, step=None):
        self.ops = ops
        self.grads = grads
        self.step = step
        self.owner = _get_ident()
        self.graph: Optional[Graph] = None
        self.graphs: list = []
        self._rec: Optional[_Recorder] = None
        self._handles: list = []
        self._mode = None
        self.module_listeners: list = []   # f(node, module, args, output)
        self.pass_listeners: list = []     # f(graph, root)
        self.pre_listeners: list = []      # f(root) when an outermost module starts

    def __enter__(self):
        TRACING[0] += 1
        try:
            self._handles = [_module_hooks.register_module_forward_pre_hook(self._pre)]
            try:
                self._handles.append(_module_hooks.register_module_forward_hook(
                    self._post, always_call=True, with_kwargs=True))
            except TypeError:
                self._handles.append(_module_hooks.register_module_forward_hook(self._post))
            if self.ops:
                self._mode = _OpMode(self)
                self._mode.__enter__()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        if self._mode is not None:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass
        for h in self._handles:
            h.remove()
        self._handles = []
        if TRACING[0]:
            TRACING[0] -= 1
        return False

    def _recorder(self, module):
        if self._rec is None or (not self._rec.stack and self._rec.graph.complete):
            self._rec = _Recorder(module, self.step, eager=True)
            self.graph = self._rec.graph
            self.graphs.append(self.graph)
        return self._rec

    def _pre(self, module, args):
        if _get_ident() != self.owner or QUIET[0] or _replay._depth:
            return None
        QUIET[0] += 1
        try:
            rec = self._recorder(module)
            if not rec.stack:
                for f in self.pre_listeners:
                    f(module)
            rec.pre(module, args)
        finally:
            QUIET[0] -= 1
        return None

    def _post(self, module, args, *rest):
        if _get_ident() != self.owner or self._rec is None or QUIET[0] or _replay._depth:
            return None
        QUIET[0] += 1
        try:
            return self._post_quiet(module, args, *rest)
        finally:
            QUIET[0] -= 1

    def _post_quiet(self, module, args, *rest):
        if len(rest) == 2:         # with kwargs: (kwargs, output)
            kwargs, output = rest
        else:                      # the exception path calls global hooks without kwargs
            kwargs, output = None, rest[0] if rest else None
        rec = self._rec
        stack_top = rec.stack[-1][1] if rec.stack and rec.stack[-1][0] is module else None
        if kwargs and stack_top is not None:
            rec._link_inputs(stack_top, tuple(kwargs.values()))
        exc = _exception_now() if output is None else None
        node = rec.post(module, output, exc)
        if node is None:
            return None
        if exc is None and self.grads:
            self._grad_hooks(node, output)
        for f in self.module_listeners:
            f(node, module, args, output)
        if not rec.stack and exc is None:
            for f in self.pass_listeners:
                f(rec.graph, module)
        return None

    def op(self, name, args, kwargs, out):
        if self._rec is None or (not self._rec.stack and self._rec.graph.complete):
            # an op outside any module (before the first module, or between passes)
            if self._rec is None:
                self._rec = _Recorder(torch.nn.Module(), self.step, eager=True)
                self._rec.graph.root_type = "ops"
                self.graph = self._rec.graph
                self.graphs.append(self.graph)
        self._rec.op(name, args, kwargs, out)

    def _grad_hooks(self, node, output):
        outs = [output] if isinstance(output, Tensor) else _tensors(output)
        for t in outs[:1]:
            if t.requires_grad:
                ref = weakref.ref(node)

                def hook(grad, ref=ref):
                    n = ref()
                    if n is not None and grad is not None:
                        with torch.no_grad():
                            n.grads += (float(torch.linalg.vector_norm(grad.detach().float())),)
                    return None
                try:
                    t.register_hook(hook)
                except Exception:
                    pass


@own_call   # mldebug's own pass: the NaN watch looks away (core/quiet.py)
def trace(model, *args, ops: bool = True, **kwargs) -> Graph:
    """Call `model(*args, **kwargs)` once and return its `Graph` (op-level detail unless
    ops=False). A model that raises: the exception propagates unchanged, with the graph up
    to the failure as `exc.mldebug_graph` (failing node marked)."""
    if not callable(model):
        raise TypeError(f"trace() needs a callable model, got {type(model).__name__}")
    tracer = Tracer(ops=ops)
    with tracer:
        try:
            model(*args, **kwargs)
        except Exception as exc:
            graph = tracer.graph or Graph(type(model).__name__)
            graph.error = graph.error or f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            attach_graph(exc, graph)
            raise
    return _finish(tracer, model)


def _finish(tracer, model) -> Graph:
    if tracer.graph is None:
        return Graph(type(model).__name__)
    # the pass of the model itself when several outermost calls happened
    for g in tracer.graphs:
        if g.roots and isinstance(model, torch.nn.Module) and g.root_type == type(model).__name__:
            return g
    return max(tracer.graphs, key=len)


def trace_expression(evaluate) -> tuple:
    """Run `evaluate()` (e.g. evaluating `model(x)` at the prompt) under a tracer; returns
    (graph or None, value, exception or None)."""
    tracer = Tracer(ops=True)
    value = exc = None
    with tracer:
        try:
            value = evaluate()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            exc = e
    graph = max(tracer.graphs, key=len) if tracer.graphs else None
    if exc is not None and graph is not None:
        attach_graph(exc, graph)
    return graph, value, exc
