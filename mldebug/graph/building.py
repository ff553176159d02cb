"""Building a Graph from module pre/post events (and op events when tracing): the
recorder both the always-on capture and trace()/scan() use, and how a failing pass's
graph travels with its exception."""
from __future__ import annotations

import dataclasses
import sys
import weakref

from torch import Tensor

from ..core.modnames import module_names
from ..core.structs import tensors_in as _tensors
from ..summaries import summary as _tensor_summary
from .model import Graph, _meta, _short

MAX_NODES = 20000       # a pass with more module calls is cut (graph.truncated)
TRACING = [0]           # > 0 while trace() runs: the always-on capture looks away


class _Recorder:
    """Builds a Graph from module pre/post events (and op events when tracing)."""

    def __init__(self, root, step=None, names=None, eager=False):
        self.eager = eager               # summaries at capture time (trace/scan)
        self.graph = Graph(type(root).__name__, step)
        self.names = names if names is not None else module_names(root)
        self.stack: list = []            # [(module, node)]
        self.producer: dict = {}         # id(tensor) -> (weakref, node id)
        self.op_counts: dict = {}

    def _link_inputs(self, node, args):
        producer = self.producer
        metas = []
        for a in args:
            if type(a) is Tensor or isinstance(a, Tensor):
                metas.append((tuple(a.shape) if not a.is_nested else _meta(a)[0],
                              _short(a.dtype)))
                rec = producer.get(id(a))
                if rec is not None and rec[0]() is a:
                    self.graph._edge(rec[1], node.id)
            elif isinstance(a, (tuple, list, dict)) or (
                    dataclasses.is_dataclass(a) and not isinstance(a, type)):
                for t in _tensors(a, 1):
                    metas.append((tuple(t.shape) if not t.is_nested else _meta(t)[0],
                          _short(t.dtype)))
                    rec = producer.get(id(t))
                    if rec is not None and rec[0]() is t:
                        self.graph._edge(rec[1], node.id)
        if metas:
            node.inputs += tuple(metas)

    def _outputs(self, node, output):
        outs = [output] if isinstance(output, Tensor) else _tensors(output)
        refs = []
        metas = []
        producer = self.producer
        for t in outs:
            metas.append(_meta(t))
            try:
                r = weakref.ref(t)
            except TypeError:
                continue
            refs.append(r)
            producer[id(t)] = (r, node.id)
        node.outputs = tuple(metas)
        node._refs = tuple(refs)
        if self.eager:
            node._summaries = [_tensor_summary(t) for t in outs[:4]]
            node.nonfinite = any(s.nonfinite for s in node._summaries)
        return outs

    def pre(self, module, args, kwargs=None):
        g = self.graph
        if len(g.nodes) >= MAX_NODES:
            g.truncated = True
            self.stack.append((module, None))
            return None
        parent = self.stack[-1][1] if self.stack else None
        if parent is None and g.root_type == "ops":
            # ops ran before the first module (scan): the graph is named by that module
            g.root_type = type(module).__name__
            self.names = module_names(module)
        path = self.names.get(id(module))
        if path is None:
            path = (parent.path + "." if parent is not None and parent.path else "") + \
                type(module).__name__
        node = g._new(path, type(module).__name__, "module", parent)
        node._module = weakref.ref(module)
        self._link_inputs(node, args)
        if kwargs:
            self._link_inputs(node, tuple(kwargs.values()))
        self.stack.append((module, node))
        return node

    def post(self, module, output, exc=None):
        """Pop `module`; returns its node (None if it was not on the stack)."""
        stack = self.stack
        if not stack:
            return None
        if stack[-1][0] is not module:
            for i in range(len(stack) - 1, -1, -1):
                if stack[i][0] is module:
                    del stack[i + 1:]
                    break
            else:
                return None
        node = stack.pop()[1]
        if node is None:
            return None
        node.open = False
        if exc is not None:
            text = f"{type(exc).__name__}: {exc}".rstrip(": ")
            node.error = text.splitlines()[0][:200] if text else type(exc).__name__
            # innermost: no child already marked with this same exception
            node.failing = not any(self.graph.nodes[c].error for c in node.children
                                   if c in self.graph.nodes)
            if not stack:
                self.graph.error = node.error
        else:
            self._outputs(node, output)
            if not stack:
                self.graph.complete = True
        return node

    def op(self, name, args, kwargs, output):
        parent = self.stack[-1][1] if self.stack else None
        g = self.graph
        if len(g.nodes) >= MAX_NODES:
            g.truncated = True
            return
        base = parent.path if parent is not None else ""
        node = g._new(f"{base}/{name}", name, "op", parent)
        node.open = False
        ins = _tensors(list(args)) + (_tensors(list(kwargs.values())) if kwargs else [])
        self._link_inputs(node, ins)
        outs = self._outputs(node, output)
        in_ids = {id(t) for t in ins}
        node.inplace = any(id(t) in in_ids for t in outs)
        if parent is not None:
            parent.ops += (name,)


def _exception_now():
    exc = sys.exc_info()[1]
    return exc if isinstance(exc, Exception) else None


def attach_graph(exc, graph) -> None:
    if exc is not None and getattr(exc, "mldebug_graph", None) is None:
        try:
            exc.mldebug_graph = graph
        except Exception:
            pass
