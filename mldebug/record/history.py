"""The short in-memory history the CLI keeps while it runs a program: for the last
`STEPS` optimizer steps, the L2 norm of every parameter and of its gradient, read just
before the optimizer updates them. At a NaN stop, `history` shows the culprit module's
rows (a weight norm climbing before the overflow).

Cost: one `torch._foreach_norm` over the values and one over the grads per recorded step,
one host transfer. The history measures its own time against the step time and records
every 2nd, 4th, ... step when it would take more than `budget` (default 1%) of the
program's time; the rows say which steps they are. `--history off` turns it off.

Names come from the graph capture (the outermost module of the latest forward pass);
parameters of other modules are named 'param N of optimizer M'.

One code path for rows, two sources: while `mldebug.record` records a step with the
`params` and `params_grad` logs and covers every parameter of the optimizer, the history
computes nothing for that step and takes the norms the recorder derives from its
summaries when the step is written (`Recorder.norm_listeners`); any other step it
computes itself. Both go through `_add`, in step order.
"""
from __future__ import annotations

import bisect
import collections
import math
import threading
import time
import weakref
from typing import Optional

import torch
from torch.optim import optimizer as _optim_hooks

from ..core import cuda_graphs as _cuda_graphs
from ..core.frames import warn_at_user_line
from ..core.quiet import own_work
from ..core.ranks import rank_tag, this_rank
from ..graph import active_capture, last_graph
from ..summaries.norms import l2_norms
from ..remedies import hints as _hints
from .recorder import active_recorder

_CUDA_GRAPH_NOTE = ("the step history does not count the steps captured into it (they run "
                    "at its replays, where no hook fires)")


STEPS = 20
BUDGET = 0.01
MAX_STRIDE = 64
MIN_COST_S = 250e-6   # below this per recorded step the history never thins out
WARMUP = 3            # recorded steps before the cost is judged (first calls are slow)
_ACTIVE: Optional["History"] = None


def active_history() -> Optional["History"]:
    return _ACTIVE


class History:
    """Ring buffer of parameter / gradient norms per optimizer step. `close()` removes
    its two optimizer hooks (idempotent)."""

    def __init__(self, steps: int = STEPS, budget: float = BUDGET):
        if steps < 1:
            raise ValueError(f"steps must be >= 1, steps={steps}")
        self.rows = collections.deque(maxlen=steps)   # (step, {name: (norm, grad_norm)})
        self.budget = budget
        self.stride = 1
        self.step = 0                 # optimizer steps completed
        self._handles: list = []
        self._names = weakref.WeakKeyDictionary()    # root module -> {id(param): name}
        self._opt_ids = weakref.WeakKeyDictionary()  # optimizer -> index
        self._last_post: Optional[float] = None
        self._own = 0.0               # seconds spent in this step's recording
        self._ratio = 0.0             # EMA of own time / step time, amortized
        self._warned = False
        self._lock = threading.Lock()  # rows arrive from the recorder's writer thread too
        self._awaited: dict = {}      # recorder step -> the history's step it is
        self._listening = None        # the recorder whose norms this history takes
        self.from_recorder = 0        # steps whose norms came from the recording
        self.computed = 0             # steps whose norms the history computed

    def start(self) -> "History":
        global _ACTIVE
        if not self._handles:
            self._last_post = None     # time away (closed) is not step time
            self._own = 0.0
            self._handles = [_optim_hooks.register_optimizer_step_pre_hook(self._pre),
                             _optim_hooks.register_optimizer_step_post_hook(self._post)]
            _ACTIVE = self
            _hints.provide("history", self.growth_before)   # (a stop's hint reads it)
        return self

    def close(self) -> None:
        global _ACTIVE
        while self._handles:
            self._handles.pop().remove()
        self._stop_listening()
        _hints.withdraw("history", self.growth_before)
        if _ACTIVE is self:
            _ACTIVE = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    # -- hooks -----------------------------------------------------------------------
    def _pre(self, optimizer, args, kwargs):
        if _cuda_graphs.MAYBE[0] and _cuda_graphs.step_aside("history", _CUDA_GRAPH_NOTE):
            return None     # (its norms are read to the host: a sync breaks a capture)
        rec = active_recorder()
        if rec is not None and rec.records_norms_of(optimizer):
            self._take_from(rec)
            return None
        if self.step % self.stride:
            return None
        t0 = time.perf_counter()
        try:
            self._record(optimizer)
        except Exception as exc:  # noqa: BLE001 - the history never breaks the program
            if not self._warned:
                self._warned = True
                warn_at_user_line(f"mldebug history: {type(exc).__name__}: {exc}; "
                                  "history is off for this run")
            self.close()
        self._own += time.perf_counter() - t0
        return None

    def _post(self, optimizer, args, kwargs):
        if _cuda_graphs.MAYBE[0] and _cuda_graphs.step_aside("history", _CUDA_GRAPH_NOTE):
            return None     # (a step captured runs at the replays: not one now)
        now = time.perf_counter()
        if self._last_post is not None and self._own and len(self.rows) > WARMUP:
            # amortized cost: this step's recording over `stride` steps of the program
            step_time = max(now - self._last_post - self._own, 1e-9)
            ratio = self._own / (step_time * self.stride)
            self._ratio = ratio if self._ratio == 0.0 else 0.7 * self._ratio + 0.3 * ratio
            if self._ratio > self.budget and self._own > MIN_COST_S and self.stride < MAX_STRIDE:
                self.stride *= 2
                self._ratio /= 2
            elif self._ratio < self.budget / 4 and self.stride > 1:
                self.stride //= 2
                self._ratio *= 2
        self._last_post = now
        self._own = 0.0
        self.step += 1
        return None

    def _param_names(self, optimizer) -> dict:
        root = _root_module()
        if root is None:          # no graph capture: the recording's model names them
            rec = active_recorder()
            root = rec.model if rec is not None else None
        names = self._names.get(root) if root is not None else None
        if names is None and root is not None:
            names = {id(p): n for n, p in root.named_parameters()}
            try:
                self._names[root] = names
            except TypeError:
                pass
        return names or {}

    # -- rows ----------------------------------------------------------------------------
    def _take_from(self, rec) -> None:
        """This step's norms come from the recording (when it writes the step)."""
        if self._listening is not rec:
            self._stop_listening()
            rec.norm_listeners.append(self._from_recorder)
            self._listening = rec
        with self._lock:
            self._awaited[rec.step_index] = self.step

    def _stop_listening(self) -> None:
        rec, self._listening = self._listening, None
        if rec is not None and self._from_recorder in rec.norm_listeners:
            rec.norm_listeners.remove(self._from_recorder)

    def _from_recorder(self, rec_step: int, row: dict) -> None:
        with self._lock:
            step = self._awaited.pop(rec_step, None)
        if step is not None:
            self.from_recorder += 1
            self._add(step, row)

    def _add(self, step: int, row: dict) -> None:
        """The one way a row enters: in step order (the recorder's may come late), a
        second optimizer's parameters of the same step merged into its row."""
        with self._lock:
            rows = self.rows
            if rows and rows[-1][0] == step:
                rows[-1][1].update(row)
            elif not rows or rows[-1][0] < step:
                rows.append((step, row))
            else:
                steps = [s for s, _ in rows]
                i = bisect.bisect_left(steps, step)
                if i < len(steps) and steps[i] == step:
                    rows[i][1].update(row)
                elif i > 0 or len(rows) < rows.maxlen:     # (older than all kept: dropped)
                    items = list(rows)
                    items.insert(i, (step, row))
                    rows.clear()
                    rows.extend(items[-rows.maxlen:])

    def _snapshot(self) -> list:
        with self._lock:
            return list(self.rows)

    def _record(self, optimizer) -> None:
        params = [p for g in optimizer.param_groups for p in g["params"]
                  if isinstance(p, torch.Tensor) and p.is_floating_point()
                  and p.layout == torch.strided]
        if not params:
            return
        names = self._param_names(optimizer)
        k = self._opt_ids.setdefault(optimizer, len(self._opt_ids))
        with_grad = [i for i, p in enumerate(params) if p.grad is not None
                     and p.grad.layout == torch.strided]
        with own_work():
            host = l2_norms(params + [params[i].grad for i in with_grad])
        grads = dict(zip(with_grad, host[len(params):]))
        row = {}
        for i, p in enumerate(params):
            name = names.get(id(p)) or f"param {i} of optimizer {k}"
            row[name] = (host[i], grads.get(i))
        self.computed += 1
        self._add(self.step, row)

    # -- reading -----------------------------------------------------------------------
    def params_of(self, module: str, rows=None) -> list:
        """Names of the recorded parameters under MODULE ('' = all), in first-seen order."""
        seen: dict = {}
        for _, row in (self._snapshot() if rows is None else rows):
            for name in row:
                if not module or name == module or name.startswith(module + "."):
                    seen.setdefault(name, None)
        return list(seen)

    def _growth(self, name: str, rows) -> float:
        vals = [r[name][0] for _, r in rows if name in r and r[name][0] is not None]
        if not vals:
            return 0.0
        if not all(math.isfinite(v) for v in vals):
            return math.inf
        return vals[-1] / vals[0] if vals[0] > 0 else (math.inf if vals[-1] > 0 else 0.0)

    def growth_before(self, stop) -> Optional[dict]:
        """For a stop's hint (remedies/hints.py): the parameter under the stop's module (the
        whole model when it names none) whose norm grew most over the recorded steps,
        {"param", "growth", "grad_growth", "steps": [first, last]}; None with fewer than
        3 recorded steps."""
        rows = self._snapshot()
        if len(rows) < 3:
            return None
        names = self.params_of(module_of_stop(stop), rows) or self.params_of("", rows)
        best = None
        for name in names:
            norms = [r[name] for _, r in rows if name in r]
            first = next(((v, g) for v, g in norms if _finite(v) and v > 0), None)
            if first is None or len(norms) < 3:
                continue
            last = norms[-1]
            growth = last[0] / first[0] if last[0] is not None else 0.0
            grad_growth = (last[1] / first[1] if _finite(first[1]) and first[1] > 0
                           and last[1] is not None else 0.0)
            if best is None or growth > best["growth"]:
                best = {"param": name, "growth": growth, "grad_growth": grad_growth,
                        "steps": [rows[0][0], rows[-1][0]]}
        return best

    def to_dict(self) -> dict:
        """JSON-able: {'steps': [...], 'stride': n, 'params': {name: {'norm': [...],
        'grad_norm': [...]}}, 'rank': R or None} (None where a step has no value)."""
        rows = self._snapshot()
        steps = [s for s, _ in rows]
        params: dict = {}
        for name in self.params_of("", rows):
            params[name] = {"norm": [_j(r.get(name, (None, None))[0]) for _, r in rows],
                            "grad_norm": [_j(r.get(name, (None, None))[1]) for _, r in rows]}
        info = this_rank()
        return {"steps": steps, "stride": self.stride, "params": params,
                "rank": info.rank if info is not None else None}

    def format(self, module: str, max_params: int = 3) -> str:
        """The table `history MODULE` prints (its first line starts with '[rank R] ' in
        a job of several ranks)."""
        info = this_rank()
        return rank_tag(info.rank if info is not None else None) + self._format(module, max_params)

    def _format(self, module: str, max_params: int) -> str:
        rows = self._snapshot()
        names = self.params_of(module, rows)
        label = module or "the model"
        if not module:   # the whole model: the fastest-growing parameters first
            names.sort(key=lambda name: self._growth(name, rows), reverse=True)
        if not rows:
            return "history: no optimizer step seen yet (the history records at optimizer.step())"
        if not names:
            return (f"history: no parameters under {label!r} were recorded "
                    f"(recorded: {', '.join(self.params_of('', rows)[:6]) or 'none'})")
        shown, more = names[:max_params], names[max_params:]
        steps = [s for s, _ in rows]
        lines = [f"history of {label}: steps {steps[0]}..{steps[-1]} "
                 f"(L2 norms read before each optimizer update; ∇ = gradient)"]
        if self.stride > 1:
            lines.append(f"  (recording every {self.stride} steps now, to stay under "
                         f"{self.budget:.0%} of the step time)")
        cols = []
        for n in shown:
            cols += [f"‖{n}‖", "‖∇‖"]
        widths = [max(12, len(c)) for c in cols]
        lines.append("  " + f"{'step':>6}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cols, widths)))
        for step, row in rows:
            cells = []
            for n in shown:
                v, g = row.get(n, (None, None))
                cells += [_fmt(v), _fmt(g)]
            lines.append("  " + f"{step:>6}  " + "  ".join(f"{c:>{w}}" for c, w in zip(cells, widths)))
        for n in shown:
            first = next((r[n][0] for _, r in rows if n in r and _finite(r[n][0])), None)
            last = next((r[n][0] for _, r in reversed(rows) if n in r), None)
            if first and last is not None and _finite(last) and first > 0 and last / first >= 2:
                lines.append(f"  ‖{n}‖ grew ×{last / first:.3g} over these steps")
            elif last is not None and not _finite(last):
                lines.append(f"  ‖{n}‖ is {_fmt(last)} at step {steps[-1]}")
        if more:
            lines.append(f"  (+{len(more)} more parameters: {', '.join(more[:4])}"
                         f"{' ...' if len(more) > 4 else ''}; `history NAME` shows one)")
        return "\n".join(lines)


def _finite(v) -> bool:
    return v is not None and math.isfinite(v)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if not math.isfinite(v):
        return "nan" if v != v else ("inf" if v > 0 else "-inf")
    if v != 0 and (abs(v) >= 1e5 or abs(v) < 1e-3):
        return f"{v:.3e}"
    return f"{v:.4f}"


def _j(v):
    return None if v is None or not math.isfinite(v) else v


def _root_module():
    """The outermost module of the latest forward pass with submodules (graph capture)."""
    cap = active_capture()
    g = cap.show() if cap is not None else last_graph()
    if g is None or not g.roots:
        return None
    node = g.nodes.get(g.roots[0])
    return node.module if node is not None else None


def module_of_stop(stop) -> str:
    """The module a stop points at: its module path, else its parameter's module."""
    if stop is None:
        return ""
    if getattr(stop, "module", ""):
        return stop.module
    param = getattr(stop, "param", "")
    if param:
        return param.rsplit(".", 1)[0] if "." in param else param
    return ""
