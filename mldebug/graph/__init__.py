"""The forward graph: module calls with their shapes, dtypes and output stats, kept for
the most recent pass of every outermost module, and traced on request with op detail.

    g = mldebug.trace(model, x, mask=m)   # Graph of one call, op-level detail
    print(g.format(depth=3)); g.to_dict(); g.to_json(); g.to_dot()

`mldebug.scan()` (one training step with the assertions run on it) builds on the tracer
here and lives with the assertions (mldebug/assertions/scan.py).

Modules: `model` (Node, Graph and their text/dict/JSON/dot forms), `building` (the
recorder that turns module and op events into a Graph), `capture` (the always-on
capture), `trace` (one call with op detail).

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

from .building import MAX_NODES
from .building import attach_graph
from .capture import Capture, active_capture, last_graph
from .model import Graph, Node
from .trace import Tracer, trace, trace_expression

__all__ = ["Node", "Graph", "Capture", "Tracer", "trace", "trace_expression",
           "active_capture", "last_graph", "attach_graph", "MAX_NODES"]
