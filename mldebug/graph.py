"""The forward graph: module calls with their shapes, dtypes and output stats, kept for
the most recent pass of every outermost module, and traced on request with op detail.

    g = mldebug.trace(model, x, mask=m)   # Graph of one call, op-level detail
    print(g.format(depth=3)); g.to_dict(); g.to_json(); g.to_dot()
    with mldebug.scan():                  # one training step: forward graph with op
        loss = model(x).mean()            # detail, output gradients after backward,
        loss.backward(); opt.step()       # and the staged assertions run on it

Nodes and ids
    A node is one module invocation (kind 'module') or, in traced graphs, one torch-level
    call (kind 'op': `torch.add`, `Tensor.add_`, `F.linear`, ...). Its id is stable across
    steps as long as the structure is the same: the dotted module path from the outermost
    module (the root's path is '') plus the invocation index within the pass, `h.0.attn#0`,
    `root#0`; a module called twice in one pass is `enc#0` and `enc#1`. Op ids are
    `{module path}/{op name}#{k}`. Edges go from the node that produced a tensor to the
    node that consumed it (matched by tensor identity); the hierarchy is `parent`/`children`.

What the always-on capture costs (and why)
    Two global module hooks (forward pre and post): per module call a few dict/list
    operations, shapes and dtypes read from the inputs and outputs, and for each output
    tensor a weak reference (no memory kept alive). Output summaries are computed ON
    DEMAND (`Node.summaries()`, the `graph` command) from those weak references: a full
    `summary()` while the output is alive (during the pass, at a stop inside forward or
    backward, whenever autograd or the user still holds it), and '(freed)' after. A
    per-output reduction in the hot path is not cheap: one `sum` per module output
    measured 1.14x on the ResNet-18-like CNN forward (CPU, 1 thread; 1.02x on the
    transformer), against ~1.03x for this whole capture, and on CUDA it would need a sync
    to be read; the summaries are read only when someone looks, so laziness wins.
    Non-finite markers come from the watch (its stops name the module, `Graph.mark`) and
    from the summaries; violation markers from the assertions. Gradient summaries per
    node: the norm of the module's own parameter gradients (read on demand after
    backward) and, in `scan()` graphs, the norm of the gradient reaching each module
    output (a tensor hook per module output, only inside scan()). `trace()`/`scan()`
    graphs compute their summaries eagerly (the outputs are gone when one looks).

Failures
    A model that raises: `trace()` re-raises the exception unchanged, with the graph up to
    the failure attached as `exc.mldebug_graph`; the innermost module open when it raised
    is marked `failing`, its enclosing modules carry the `error` text. The always-on
    capture attaches the pass's graph the same way (for `Exception`s: torch runs the
    always-call hooks only for those; after a BaseException such as KeyboardInterrupt
    the next call of the outermost module starts a fresh pass).
"""
from __future__ import annotations

import dataclasses
import json
import sys
import threading
import weakref
from typing import Optional

import torch
import torch.nn.modules.module as _module_hooks
from torch import Tensor
from torch.overrides import TorchFunctionMode

from .core import replay as _replay
from .core.modnames import module_names
from .core.structs import tensors_in
from .summaries import format_number, short_dtype
from .summaries import summary as _tensor_summary

__all__ = ["Node", "Graph", "Capture", "trace", "scan", "active_capture", "last_graph"]

_get_ident = threading.get_ident
_TRACING = 0            # > 0 while trace() runs: the always-on capture looks away
_ACTIVE: Optional["Capture"] = None
_SERIAL = [0]
QUIET = [0]             # > 0 while mldebug itself runs torch code (summaries, checks):
                        # the op recorder of trace()/scan() does not record it
MAX_NODES = 20000       # a pass with more module calls is cut (graph.truncated)
_SKIP_OPS = frozenset({
    "__get__", "__set__", "size", "dim", "numel", "stride", "is_floating_point",
    "is_complex", "__len__", "__bool__", "__index__", "__int__", "__float__", "item",
    "tolist", "data_ptr", "element_size", "is_contiguous", "get_device", "__repr__",
    "__format__", "__hash__", "__iter__", "storage_offset",
    "untyped_storage", "requires_grad_", "retain_grad", "register_hook", "backward",
    "__reduce_ex__", "__deepcopy__", "_is_view", "is_nonzero", "__contains__",
})


_DTYPES: dict = {}


def _short(dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = short_dtype(dtype)
    return name


_tensors = tensors_in   # (the engine's one walk: mldebug/structs.py)


def _meta(t: Tensor):
    return (tuple(t.shape), _short(t.dtype))


def _fmt_meta(metas) -> str:
    if not metas:
        return "-"
    parts = [f"[{', '.join(str(d) for d in shape)}] {dtype}" for shape, dtype in metas[:2]]
    if len(metas) > 2:
        parts.append(f"+{len(metas) - 2}")
    return ", ".join(parts)


class Node:
    """One module invocation or one op in a pass.

    Fields not given to the constructor are class-level defaults until set (the hot path
    sets seven attributes per node; the rest is written only when it happens)."""

    children: tuple = ()        # child node ids, in call order (tuples, not lists: fewer
    inputs: tuple = ()          # ((shape, dtype), ...)       objects per pass)
    outputs: tuple = ()         # ((shape, dtype), ...)
    ops: tuple = ()             # op names called directly in this module (traced graphs)
    error: str = ""             # 'ValueError: ...' when the call raised
    failing: bool = False       # innermost node open when it raised
    violations: tuple = ()      # assertion names found here
    grads: tuple = ()           # norms of the gradients reaching the outputs (scan)
    nonfinite: bool = False     # a watch stop or a summary saw NaN/Inf here
    inplace: bool = False       # op wrote into one of its inputs
    open: bool = True           # still running (a pause inside it)
    _refs: tuple = ()           # weak references to the output tensors
    _module = None              # weak reference to the module
    _summaries = None           # computed at capture time (traced graphs)

    def __init__(self, id, path, type_, kind, index, parent, depth):
        self.id = id
        self.path = path
        self.type = type_
        self.kind = kind                # 'module' or 'op'
        self.index = index              # invocation index of this path in the pass
        self.parent = parent            # parent node id or None
        self.depth = depth

    # -- lazy, on demand ----------------------------------------------------------------
    def output_tensors(self) -> list:
        """The outputs still alive (weak references), in order; None for freed ones."""
        return [r() for r in self._refs]

    def summaries(self) -> list:
        """`TensorSummary` of each output still alive, None for freed ones."""
        if self._summaries is not None:
            return self._summaries
        out = []
        for t in self.output_tensors():
            s = _tensor_summary(t) if t is not None else None
            if s is not None and s.nonfinite:
                self.nonfinite = True
            out.append(s)
        return out

    @property
    def module(self):
        return self._module() if self._module is not None else None

    def param_grad_norm(self, recurse: bool = True) -> Optional[float]:
        """Norm of the gradients of the module's parameters (read now), None if none."""
        m = self.module
        if m is None:
            return None
        try:
            grads = [p.grad for p in m.parameters(recurse=recurse) if p.grad is not None]
            if not grads:
                return None
            with torch.no_grad():
                return float(torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(g.detach().float()) for g in grads])))
        except Exception:
            return None

    def to_dict(self, stats: bool = False) -> dict:
        d = {"id": self.id, "path": self.path, "type": self.type, "kind": self.kind,
             "index": self.index, "parent": self.parent, "children": list(self.children),
             "depth": self.depth,
             "inputs": [{"shape": list(s), "dtype": d} for s, d in self.inputs],
             "outputs": [{"shape": list(s), "dtype": d} for s, d in self.outputs],
             "ops": list(self.ops), "error": self.error, "failing": self.failing,
             "violations": list(self.violations), "grads": list(self.grads),
             "nonfinite": self.nonfinite, "inplace": self.inplace}
        if stats:
            d["summaries"] = [s.to_dict() if s is not None else None for s in self.summaries()]
            d["param_grad_norm"] = self.param_grad_norm()
        return d

    def __repr__(self):
        return f"Node({self.id!r}, {self.type}, out={_fmt_meta(self.outputs)})"


class Graph:
    """The nodes of one pass (insertion order = call order), edges and hierarchy."""

    def __init__(self, root_type: str = "", step: Optional[int] = None):
        self.nodes: dict = {}         # id -> Node
        self.edges: list = []         # (producer id, consumer id), no duplicates
        self._edge_set: set = set()
        self.roots: list = []         # ids of outermost nodes (one for a module pass)
        self.root_type = root_type
        self.step = step
        self.complete = False         # the pass returned
        self.error = ""               # the exception that ended the pass, if any
        self.truncated = False
        self._counts: dict = {}       # path -> invocations so far
        _SERIAL[0] += 1
        self._serial = _SERIAL[0]     # creation order (which pass is the latest)

    # -- building ---------------------------------------------------------------------
    def _new(self, path, type_, kind, parent: Optional[Node]) -> Node:
        k = self._counts.get(path, 0)
        self._counts[path] = k + 1
        nid = f"{path or 'root'}#{k}"
        node = Node(nid, path, type_, kind, k, parent.id if parent is not None else None,
                    parent.depth + 1 if parent is not None else 0)
        self.nodes[nid] = node
        if parent is None:
            self.roots.append(nid)
        else:
            parent.children += (nid,)
        return node

    def _edge(self, src: str, dst: str) -> None:
        if src != dst and (src, dst) not in self._edge_set:
            self._edge_set.add((src, dst))
            self.edges.append((src, dst))

    # -- reading ----------------------------------------------------------------------
    def __len__(self):
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes.values())

    def __getitem__(self, key) -> Node:
        node = self.find(key)
        if node is None:
            raise KeyError(f"no node {key!r} in the graph (ids look like 'h.0.attn#0')")
        return node

    def find(self, key: str) -> Optional[Node]:
        """A node by id ('h.0#1') or by path (its first invocation; '' or 'root' = root)."""
        if key in self.nodes:
            return self.nodes[key]
        if key in ("", "root", "(root)"):
            return self.nodes.get(self.roots[0]) if self.roots else None
        return self.nodes.get(f"{key}#0")

    def mark(self, path: str, label: str) -> Optional[Node]:
        """Mark the (last open, else first) invocation of module `path`: 'nan'/'inf' set
        the non-finite marker, anything else is a violation name. Returns the node."""
        nodes = [n for n in self.nodes.values() if n.kind == "module" and n.path == path]
        if not nodes:
            return None
        node = next((n for n in reversed(nodes) if n.open), nodes[-1])
        if label in ("nan", "inf"):
            node.nonfinite = True
        elif label not in node.violations:
            node.violations += (label,)
        return node

    def mark_violation(self, violation) -> Optional[Node]:
        """Mark the module a session violation names: its NaN/Inf kind, or for an
        assertion the assertion's name. Nothing for None or a violation without module."""
        if violation is None or not violation.module:
            return None
        label = violation.kind if violation.kind != "assertion" else violation.assertion
        return self.mark(violation.module, label)

    def modules(self) -> list:
        return [n for n in self.nodes.values() if n.kind == "module"]

    def failing(self) -> Optional[Node]:
        return next((n for n in self.nodes.values() if n.failing), None)

    def to_dict(self, stats: bool = False) -> dict:
        return {"root_type": self.root_type, "step": self.step, "complete": self.complete,
                "error": self.error, "truncated": self.truncated, "roots": list(self.roots),
                "nodes": [n.to_dict(stats) for n in self.nodes.values()],
                "edges": [list(e) for e in self.edges]}

    def to_json(self, stats: bool = False, **kwargs) -> str:
        return json.dumps(self.to_dict(stats), default=str, **kwargs)

    def to_dot(self, max_depth: Optional[int] = None) -> str:
        """Graphviz DOT text: modules with children are clusters, leaves are boxes, ops
        ellipses; failing nodes red, non-finite or violating nodes orange."""
        lines = ["digraph mldebug {", '  rankdir=TB; node [fontname="Helvetica", fontsize=10];']
        shown = {nid for nid, n in self.nodes.items()
                 if max_depth is None or n.depth <= max_depth}

        def q(s):
            text = str(s).replace("\\", "\\\\").replace('"', '\\"')
            return '"' + text.replace("\n", "\\n") + '"'

        def label(n):
            name = n.path.rsplit(".", 1)[-1] if n.kind == "module" else n.type
            name = name or "(root)"
            if n.index:
                name += f" #{n.index}"
            lines = [name] + ([n.type] if n.kind == "module" else [])
            return "\n".join(lines + [f"out: {_fmt_meta(n.outputs)}"])

        def attrs(n):
            color = "red" if n.failing or n.error else (
                "orange" if n.nonfinite or n.violations else "black")
            shape = "ellipse" if n.kind == "op" else "box"
            return f"shape={shape}, color={color}"

        def emit(nid, indent):
            n = self.nodes[nid]
            kids = [c for c in n.children if c in shown]
            if kids:
                lines.append(f"{indent}subgraph {q('cluster_' + nid)} {{")
                lines.append(f"{indent}  label={q(label(n).replace(chr(10), ' | '))}; "
                             f"color={'red' if n.error else 'gray'};")
                lines.append(f"{indent}  {q(nid)} [label={q(label(n))}, {attrs(n)}, style=dashed];")
                for c in kids:
                    emit(c, indent + "  ")
                lines.append(f"{indent}}}")
            else:
                lines.append(f"{indent}{q(nid)} [label={q(label(n))}, {attrs(n)}];")

        for r in self.roots:
            if r in shown:
                emit(r, "  ")
        for src, dst in self.edges:
            if src in shown and dst in shown:
                lines.append(f"  {q(src)} -> {q(dst)};")
        lines.append("}")
        return "\n".join(lines) + "\n"

    def format(self, depth: int = 3, path: Optional[str] = None, ops: bool = False,
               stats: bool = True) -> str:
        """The module tree as text: path, type, output shapes, stats, markers.

        `path`: only that node's subtree (depth counted from it); `ops`: op nodes too."""
        if depth < 0:
            raise ValueError(f"depth must be >= 0, depth={depth}")
        if path is not None:
            start = self.find(path)
            if start is None:
                raise KeyError(f"no module {path!r} in the graph")
            starts = [start.id]
        else:
            starts = list(self.roots)
        rows = []

        def walk(nid, level):
            n = self.nodes[nid]
            if n.kind == "op" and not ops:
                return
            rows.append((n, level))
            if level < depth:
                for c in n.children:
                    walk(c, level + 1)

        for s in starts:
            walk(s, 0)
        table = []
        for n, level in rows:
            name = n.path if n.kind == "module" else n.id.rsplit("/", 1)[-1].split("#")[0]
            if n.kind == "module" and not n.path:
                name = "(root)"
            if n.index and n.kind == "module":
                name += f"#{n.index}"
            hidden = sum(1 for c in n.children if c in self.nodes
                         and (ops or self.nodes[c].kind == "module"))
            more = f" (+{hidden})" if level >= depth and hidden else ""
            stat = ""
            if stats:
                stat = _stat_text(n)
            marks = []
            if n.failing:
                marks.append(f"<-- raised {n.error}")
            elif n.error:
                marks.append("(raised)")
            if n.nonfinite:
                marks.append("NaN/Inf!")
            if n.violations:
                marks.append("! " + ", ".join(n.violations))
            if n.open and not n.error:
                marks.append("(running)")
            if n.grads:
                marks.append(f"‖∇out‖={format_number(n.grads[-1])}")
            elif stats and n.kind == "module":
                g = n.param_grad_norm(recurse=False)
                if g is not None:
                    marks.append(f"‖∇param‖={format_number(g)}")
            table.append(("  " * level + name + more, n.type, _fmt_meta(n.outputs), stat,
                          " ".join(marks)))
        head = ("path", "type", "output", "stats", "")
        widths = [max(len(r[i]) for r in table + [head]) for i in range(3)]
        out = []
        state = "complete" if self.complete else ("raised" if self.error else "in progress")
        step = f", step {self.step}" if self.step is not None else ""
        out.append(f"graph of {self.root_type or '?'} ({state}{step}): "
                   f"{len(self.modules())} module calls, {len(self.edges)} edges, "
                   f"depth {depth}")
        for r in [head] + table:
            line = "  ".join(r[i].ljust(widths[i]) for i in range(3))
            line = f"{line}  {r[3]}  {r[4]}".rstrip()
            out.append(line)
        return "\n".join(out)

    __str__ = format


def _stat_text(n: Node) -> str:
    num = format_number
    sums = n.summaries()
    if not sums:
        return ""
    s = sums[0]
    if s is None:
        return "(freed)"
    if s.min is None:
        text = s.note or "-"
    elif s.integer:
        text = f"x∈[{num(s.min, True)}, {num(s.max, True)}]"
    else:
        text = f"x∈[{num(s.min)}, {num(s.max)}] μ={num(s.mean)} σ={num(s.std)}"
    if s.nonfinite:
        bits = [f"NaN!{s.nan}" if s.nan else "", f"+Inf!{s.posinf}" if s.posinf else "",
                f"-Inf!{s.neginf}" if s.neginf else ""]
        text += " " + " ".join(b for b in bits if b)
    return text


# -- recording -----------------------------------------------------------------------
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
                metas.append((tuple(a.shape), _short(a.dtype)))
                rec = producer.get(id(a))
                if rec is not None and rec[0]() is a:
                    self.graph._edge(rec[1], node.id)
            elif isinstance(a, (tuple, list, dict)) or (
                    dataclasses.is_dataclass(a) and not isinstance(a, type)):
                for t in _tensors(a, 1):
                    metas.append(_meta(t))
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
            metas.append((tuple(t.shape), _short(t.dtype)))
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


def _attach(exc, graph) -> None:
    if exc is not None and getattr(exc, "mldebug_graph", None) is None:
        try:
            exc.mldebug_graph = graph
        except Exception:
            pass


# -- the always-on capture -------------------------------------------------------------
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
        if _TRACING or _replay._depth or _get_ident() != self._owner:
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
            import warnings
            warnings.warn(f"mldebug graph capture skipped a pass after an internal error: "
                          f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)

    def _post(self, module, args, output):
        if _TRACING or _replay._depth or _get_ident() != self._owner:
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
            _attach(exc, rec.graph)
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


# -- trace: one call, op-level detail -----------------------------------------------------
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


class _Tracer:
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
        global _TRACING
        _TRACING += 1
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
        global _TRACING
        if self._mode is not None:
            mode, self._mode = self._mode, None
            try:
                mode.__exit__(None, None, None)
            except Exception:
                pass
        for h in self._handles:
            h.remove()
        self._handles = []
        if _TRACING:
            _TRACING -= 1
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


def trace(model, *args, ops: bool = True, **kwargs) -> Graph:
    """Call `model(*args, **kwargs)` once and return its `Graph` (op-level detail unless
    ops=False). A model that raises: the exception propagates unchanged, with the graph up
    to the failure as `exc.mldebug_graph` (failing node marked)."""
    if not callable(model):
        raise TypeError(f"trace() needs a callable model, got {type(model).__name__}")
    tracer = _Tracer(ops=ops)
    with tracer:
        try:
            model(*args, **kwargs)
        except Exception as exc:
            graph = tracer.graph or Graph(type(model).__name__)
            graph.error = graph.error or f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            _attach(exc, graph)
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
    tracer = _Tracer(ops=True)
    value = exc = None
    with tracer:
        try:
            value = evaluate()
        except Exception as e:  # noqa: BLE001 - reported by the caller
            exc = e
    graph = max(tracer.graphs, key=len) if tracer.graphs else None
    if exc is not None and graph is not None:
        _attach(exc, graph)
    return graph, value, exc


# -- scan: one training step --------------------------------------------------------------
class Scan:
    """`with mldebug.scan() as s:` around one training step: `s.graph` (forward with op
    detail, output gradient norms after backward), and the staged assertions run on the
    step (`s.violations`). The exception of a model that raises propagates unchanged."""

    def __init__(self, ops=True, assertions=True, on_violation=None):
        self._tracer = _Tracer(ops=ops, grads=True)
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
            from .assertions.runner import Runner
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
            from .core.session import current
            current().on_violation(v)

    def __exit__(self, exc_type, exc, tb):
        try:
            self._tracer.__exit__(exc_type, exc, tb)
        finally:
            if self._runner is not None:
                self._runner.close()
        if exc is not None and isinstance(exc, Exception) and self.graph is not None:
            _attach(exc, self.graph)
        return False


def scan(ops: bool = True, assertions: bool = True, on_violation=None) -> Scan:
    """Capture one training step (forward with op detail, backward, optimizer step) and
    run the staged assertions on it. `on_violation(v)` defaults to the session's."""
    return Scan(ops=ops, assertions=assertions, on_violation=on_violation)
