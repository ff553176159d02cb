"""The graph's data: `Node` (one module call or op) and `Graph` (one pass: nodes in call
order, edges from producer to consumer, the hierarchy), with their text, dict, JSON and
dot forms. No hooks in here: `building` fills a Graph, `capture` and `trace` drive it."""
from __future__ import annotations

import json
from typing import Optional

import torch
from torch import Tensor

from ..summaries import format_number, short_dtype
from ..summaries import summary as _tensor_summary

_SERIAL = [0]           # creation order of graphs (which pass is the latest)
_DTYPES: dict = {}


def _short(dtype) -> str:
    name = _DTYPES.get(dtype)
    if name is None:
        name = _DTYPES[dtype] = short_dtype(dtype)
    return name



def _meta(t: Tensor):
    if t.is_nested:    # (a strided nested tensor has no shape: -1 for each dimension)
        return ((-1,) * t.dim(), _short(t.dtype))
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
