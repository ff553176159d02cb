"""Running the staged assertions while the program trains, without it calling us.

Where each stage comes from (all installed by `Runner.start()`, removed by `close()`,
idempotent, also when the program raised):
    FORWARD          the module listeners of the graph capture (the always-on `Capture`,
                     or the tracer of `scan()`): every module call, and the end of the
                     outermost one
    BEFORE_BACKWARD  `torch.autograd.backward` is wrapped (`Tensor.backward` calls it by
    BACKWARD         attribute, so `loss.backward()` goes through the wrapper); the original
                     is put back when the last runner closes
    BEFORE_STEP      global optimizer step pre/post hooks
    OPTIMIZER        (`torch.optim.optimizer.register_optimizer_step_pre_hook` / `post`)
    torch functions  a `TorchFunctionMode`, only while a FunctionAssertion targets one
    Python functions the target's name in its module rebound to a wrapper (restored)

A violation stops in the innermost user frame at the hook: the line that called the model
(or the user's forward calling the module), `loss.backward()` for backward checks (named
as the loss's line when a framework calls it: loss_site.py), `optimizer.step()` for step
checks. Each (assertion, target) stops once per run; all trips are in `violations`.
"""
from __future__ import annotations

import functools
import sys
import threading
import types
import warnings
import weakref

import torch
import torch.optim.optimizer as _optim_hooks
from torch import Tensor
from torch.overrides import TorchFunctionMode

from ..core import autograd_patch as _autograd_patch
from ..core import cuda_graphs as _cuda_graphs
from ..core import frames as _frames
from ..core import jit_trace as _jit_trace
from ..core import replay as _replay
from ..core.quiet import QUIET, own_work, watch_suspended
from ..core.records import Violation
from ..core.session import current
from ..core.structs import tensors_in
from ..graph import Capture, active_capture
from ..summaries.norms import l2_norms
from . import loss_site as _loss_site, registry as _registry
from .base import (BACKWARD, BEFORE_BACKWARD, BEFORE_STEP, FORWARD, OPTIMIZER, STOP_STAGE,
                   FunctionAssertion, ParamAssertion, TensorAssertion, TensorNodeAssertion)

_RUNNERS: list = []          # running runners; the innermost (last) one gets the events
_get_ident = threading.get_ident


def active_runner():
    return _RUNNERS[-1] if _RUNNERS else None


def _around_backward(proceed, tensors, grad_tensors, args, kwargs):
    runner = _RUNNERS[-1] if _RUNNERS else None
    if runner is None or not runner._listening():
        return proceed(tensors, grad_tensors, *args, **kwargs)
    roots = (tensors,) if isinstance(tensors, Tensor) else tuple(tensors)
    grads = (grad_tensors,) if isinstance(grad_tensors, Tensor) or grad_tensors is None \
        else tuple(grad_tensors)
    runner._loss_site = _loss_site.loss_site(roots)   # (read by this backward's stops)
    runner._before_backward(roots, grads)
    result = proceed(tensors, grad_tensors, *args, **kwargs)
    runner._after_backward(roots)
    return result


def _patch_backward() -> None:
    _autograd_patch.add(_around_backward)
    _jit_trace.add(_around_backward)      # (torch.jit.trace runs quiet: core/jit_trace.py)


def _unpatch_backward() -> None:
    _autograd_patch.remove(_around_backward)
    _jit_trace.remove(_around_backward)


_tensors = tensors_in   # (the engine's one walk: mldebug/structs.py)


class _FnMode(TorchFunctionMode):
    def __init__(self, runner, targets):
        super().__init__()
        self.runner = runner
        self.targets = targets

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self.targets and self.runner._listening():
            self.runner._on_function(func, args, kwargs, out)
        return out


class Runner:
    """Runs the registered assertions at their stages. `on_violation(v)` (default: the
    session's) gets each Violation that is worth a stop; `violations` keeps all of them,
    `step_violations` those of the current step."""

    def __init__(self, on_violation=None, source=None):
        self.on_violation = on_violation
        self._source = source
        self._own_capture = None
        self._handles: list = []
        self._started = False
        self._owner = None
        self._busy = 0
        self._fn_mode = None
        self.violations: list = []
        self.step_violations: list = []
        self.step = 0                   # optimizer steps seen
        self._opt_seen = False
        self._new_step = False
        self._stopped: set = set()      # (assertion, target) that stopped already
        self._roots = weakref.WeakKeyDictionary()      # root module -> [(name, param)]
        self._optimizers = weakref.WeakKeyDictionary()  # optimizer -> True
        self._pending: list = []        # backward checks of function/node assertions
        self._warned: set = set()
        self._last_root = None
        self._lists = None              # (registry version, lists by kind)
        self._patched: list = []        # (module, name, original, wrapper)

    # -- lifecycle ----------------------------------------------------------------------
    def start(self) -> "Runner":
        if self._started:
            return self
        self._owner = _get_ident()
        source = self._source
        if source is None:
            source = active_capture()
            if source is None:
                source = self._own_capture = Capture().start()
            self._source = source
        source.module_listeners.append(self._on_module)
        source.pre_listeners.append(self._on_pass_start)
        try:
            self._handles = [
                _optim_hooks.register_optimizer_step_pre_hook(self._optimizer_pre),
                _optim_hooks.register_optimizer_step_post_hook(self._optimizer_post),
            ]
            _RUNNERS.append(self)
            _patch_backward()
            self._refresh()
        except BaseException:
            self._started = True
            self.close()
            raise
        self._started = True
        return self

    def _refresh(self) -> None:
        """(Re)compute the torch functions targeted by FunctionAssertions; the function
        mode is entered when the first such target appears (called on registration)."""
        targets = {t for a in _registry.assertions() if isinstance(a, FunctionAssertion)
                   for t in a.function_targets()}
        python = {t for t in targets if isinstance(t, types.FunctionType)}
        targets -= python
        for fn in python:
            self._wrap_python_function(fn)
        if self._fn_mode is not None:
            self._fn_mode.targets = targets
        elif targets:
            self._fn_mode = _FnMode(self, targets)
            self._fn_mode.__enter__()

    def _wrap_python_function(self, fn) -> None:
        """A user's Python function as a target: its name in its module is rebound to a
        wrapper (calls through the module's global see it; `close()` puts it back).
        References taken before registration keep calling the original."""
        if any(p[2] is fn for p in self._patched):
            return
        module = sys.modules.get(getattr(fn, "__module__", None) or "")
        name = getattr(fn, "__name__", "")
        if module is None or getattr(module, name, None) is not fn:
            _frames.warn_at_user_line(f"mldebug: cannot watch calls of {fn!r}: it is not "
                                      "reachable as a module global")
            return
        runner = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            out = fn(*args, **kwargs)
            if runner._listening():
                runner._on_function(fn, args, kwargs, out)
            return out

        setattr(module, name, wrapper)
        self._patched.append((module, name, fn, wrapper))

    def close(self) -> None:
        """Remove every hook, the backward wrapper and the mode (idempotent)."""
        if not self._started:
            return
        self._started = False
        for h in self._handles:
            h.remove()
        self._handles = []
        src = self._source
        for lst, f in ((getattr(src, "module_listeners", None), self._on_module),
                       (getattr(src, "pre_listeners", None), self._on_pass_start)):
            if lst is not None and f in lst:
                lst.remove(f)
        if self in _RUNNERS:
            _RUNNERS.remove(self)
        if not _RUNNERS:
            _unpatch_backward()
        if self._fn_mode is not None:
            mode, self._fn_mode = self._fn_mode, None
            mode.targets = frozenset()       # inert, wherever it is on the stack
            try:
                n = torch._C._len_torch_function_stack()
                if n and torch._C._get_function_stack_at(n - 1) is mode:
                    mode.__exit__(None, None, None)
                else:
                    warnings.warn("mldebug assertions closed while another torch function "
                                  "mode is above theirs: it stays on the stack, inert",
                                  RuntimeWarning, stacklevel=2)
            except Exception:
                pass
        for module, name, fn, wrapper in reversed(self._patched):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, fn)
        self._patched = []
        if self._own_capture is not None:
            self._own_capture.close()
            self._own_capture = None
        self._pending = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.close()

    @property
    def started(self) -> bool:
        return self._started

    def _listening(self) -> bool:
        # only the innermost runner (scan() inside the CLI's) hears the events
        return (self._started and not self._busy and _get_ident() == self._owner
                and _RUNNERS and _RUNNERS[-1] is self and not _replay._depth
                and not QUIET[0]
                and not _cuda_graphs.step_aside("assertions", _cuda_graphs.ASSERTIONS_NOTE))

    # -- what is known ------------------------------------------------------------------
    def _params(self, optimizer=None) -> list:
        """[(name, param)]: of `optimizer` when given, else of every model and optimizer
        seen; names from the models (dotted), else 'param_groups[g][i]'."""
        names = {}
        for root in list(self._roots.keys()):
            named = self._roots.get(root)
            if named is None:
                try:
                    named = list(root.named_parameters())
                except Exception:
                    named = []
                self._roots[root] = named
            for name, p in named:
                names.setdefault(id(p), (name, p))
        if optimizer is not None:
            out = []
            for g, group in enumerate(getattr(optimizer, "param_groups", ())):
                for i, p in enumerate(group.get("params", ())):
                    out.append((names.get(id(p), (f"param_groups[{g}][{i}]", p))[0], p))
            return out
        out = list(names.values())
        seen = set(names)
        for opt in list(self._optimizers.keys()):
            for g, group in enumerate(getattr(opt, "param_groups", ())):
                for i, p in enumerate(group.get("params", ())):
                    if id(p) not in seen:
                        seen.add(id(p))
                        out.append((f"param_groups[{g}][{i}]", p))
        return out

    def _declared_unused(self) -> set:
        """ids of the parameters of a DistributedDataParallel(find_unused_parameters=True)
        model: the program said they may get no gradient."""
        ddp = getattr(sys.modules.get("torch.nn.parallel.distributed"), "DistributedDataParallel", ())
        return {id(p) for root in list(self._roots.keys()) if isinstance(root, ddp)
                and getattr(root, "find_unused_parameters", False) for _, p in self._roots.get(root) or ()}

    # -- events ---------------------------------------------------------------------------
    def _on_pass_start(self, root) -> None:
        if not self._listening():
            return
        if root not in self._roots:
            try:
                self._roots[root] = None
            except TypeError:
                pass
        self._last_root = weakref.ref(root)
        if self._new_step:
            self._new_step = False
            self.step_violations = []
            self._pending = []

    def _on_module(self, node, module, args, output) -> None:
        if not self._listening() or node.error:
            return      # (a call that raised has no output to judge)
        all_funcs, all_nodes, all_roots = self._module_lists()
        funcs = [a for a in all_funcs if a.matches_module(module)] if all_funcs else ()
        nodes = [a for a in all_nodes if a.applies(node.id)] if all_nodes else ()
        roots = all_roots if node.depth == 0 else ()
        if not (funcs or nodes or roots):
            if node.depth == 0:
                self._finish(FORWARD)
            return
        path, mtype = node.path, node.type
        with self._quiet():
            for a in funcs:
                if FORWARD in a.check_on:
                    self._run(a, FORWARD, lambda a=a: a.call_check(node.id, module, output,
                                                                   args, {}),
                              module=path, module_type=mtype, node=node.id)
                if BACKWARD in a.check_on:
                    self._defer(a, node.id, module, output, args, path, mtype)
            out = next(iter(_tensors(output)), None)
            for a in nodes:
                if FORWARD in a.check_on:
                    self._run(a, FORWARD, lambda a=a: a.check(node.id, out, None),
                              module=path, module_type=mtype, node=node.id)
                if BACKWARD in a.check_on and out is not None:
                    self._defer(a, node.id, None, out, (), path, mtype)
            for a in roots:
                for t in _tensors(output)[:8]:
                    if not self._run(a, FORWARD, lambda a=a, t=t: a.check(t, None),
                                     module=path, module_type=mtype, node=node.id):
                        break
        if node.depth == 0:
            self._finish(FORWARD)

    def _module_lists(self):
        """(function/module assertions, tensor-node assertions, forward tensor
        assertions), recomputed only when the registry changes."""
        key = _registry.VERSION[0]
        cached = self._lists
        if cached is None or cached[0] != key:
            active = _registry.active()
            cached = self._lists = (key, (
                [a for a in active if isinstance(a, FunctionAssertion)],
                [a for a in active if isinstance(a, TensorNodeAssertion)],
                [a for a in active if isinstance(a, TensorAssertion) and FORWARD in a.check_on]))
        return cached[1]

    def _on_function(self, func, args, kwargs, out) -> None:
        name = getattr(func, "__name__", str(func))
        inputs = tuple(args) + tuple(kwargs.values())
        with self._quiet():
            for a in _registry.active():
                if isinstance(a, FunctionAssertion) and func in a.targets:
                    if FORWARD in a.check_on:
                        self._run(a, FORWARD, lambda a=a: a.call_check(name, None, out,
                                                                       inputs, {}),
                                  node=name)
                    if BACKWARD in a.check_on:
                        self._defer(a, name, None, out, inputs, "", "")

    def _defer(self, a, node_id, module, output, inputs, path, mtype) -> None:
        """Hooks that collect the gradients reaching the call's output and inputs; the
        check runs after backward."""
        if len(self._pending) > 1000:
            return
        grads = {}
        entry = (a, node_id, module, output, inputs, grads, path, mtype)
        targets = [("output", t) for t in _tensors(output)[:1]]
        targets += [(f"input {i}", t) for i, t in enumerate(inputs) if isinstance(t, Tensor)]
        for key, t in targets:
            if t.requires_grad:
                def hook(g, key=key):
                    grads[key] = g
                try:
                    t.register_hook(hook)
                except Exception:
                    pass
        self._pending.append(entry)

    def _before_backward(self, roots, grads) -> None:
        with self._quiet():
            for a in _registry.active(BEFORE_BACKWARD):
                if isinstance(a, TensorAssertion):
                    for t, g in zip(roots, list(grads) + [None] * len(roots)):
                        if not self._run(a, BEFORE_BACKWARD, lambda a=a, t=t, g=g: a.check(t, g)):
                            break
            self._params_stage(BEFORE_BACKWARD, None)
        self._finish(BEFORE_BACKWARD)

    def _after_backward(self, roots) -> None:
        with self._quiet():
            for a in _registry.active(BACKWARD):
                if isinstance(a, TensorAssertion):
                    for t in roots:
                        if not self._run(a, BACKWARD, lambda a=a, t=t: a.check(t, None)):
                            break
            self._params_stage(BACKWARD, None)
            pending, self._pending = self._pending, []
            for a, node_id, module, output, inputs, grads, path, mtype in pending:
                if not grads:
                    continue        # that call was not part of this backward
                if isinstance(a, TensorNodeAssertion):
                    call = (lambda a=a, n=node_id, o=output, g=grads: a.check(n, o, g.get("output")))
                else:
                    call = (lambda a=a, n=node_id, m=module, o=output, i=inputs, g=grads:
                            a.call_check(n, m, o, i, dict(g)))
                self._run(a, BACKWARD, call, module=path, module_type=mtype, node=node_id)
        self._finish(BACKWARD)

    def _optimizer_pre(self, optimizer, args, kwargs):
        if not self._listening():
            return None
        try:
            self._optimizers[optimizer] = True
        except TypeError:
            pass
        with self._quiet():
            self._params_stage(BEFORE_STEP, optimizer)
        self._finish(BEFORE_STEP)
        return None

    def _optimizer_post(self, optimizer, args, kwargs):
        if not self._listening():
            return None
        with self._quiet():
            self._params_stage(OPTIMIZER, optimizer)
        self._finish(OPTIMIZER)
        self.step += 1
        self._opt_seen = True
        self._new_step = True
        if hasattr(self._source, "step"):
            self._source.step = self.step     # graphs of the next passes carry the step
        return None

    def _params_stage(self, stage, optimizer) -> None:
        active = [a for a in _registry.active(stage) if isinstance(a, ParamAssertion)]
        if not active:
            return
        scoped = self._params(optimizer) if optimizer is not None else None
        every = None
        norms = None
        declared = self._declared_unused() if any(getattr(a, "skips_declared_unused", False) for a in active) else ()
        if any(getattr(a, "wants_norms", False) for a in active):
            norms = _grad_norms(scoped if scoped is not None else self._params())
        for a in active:
            if scoped is None or getattr(a, "scope", "optimizer") == "all":
                if every is None:
                    every = self._params()
                params = every
            else:
                params = scoped
            a.grad_norms = norms or {}
            first = None
            failed = 0
            skip = declared if getattr(a, "skips_declared_unused", False) else ()
            for name, p in params:
                if not a.applies(name) or id(p) in skip:
                    continue
                ok = self._call(a, stage, lambda a=a, n=name, p=p: a.check(n, p, p.grad))
                if ok is None:
                    break
                if not ok:
                    failed += 1
                    if first is None:
                        first = (name, a.detail)
            if first is not None:
                name, detail = first
                more = f"{failed - 1} more parameter(s)" if failed > 1 else ""
                a.detail = "; ".join(part for part in (detail, more) if part)
                owner = name.rsplit(".", 1)[0] if "." in name and not name.startswith("param_groups") else ""
                self._report(a, stage, module=owner, param=name)

    def _finish(self, stage) -> None:
        """Assertions with a `finish()` judge what they gathered during the stage."""
        for a in _registry.active(stage):
            fin = getattr(a, "finish", None)
            if fin is None:
                continue
            with self._quiet():
                ok = self._call(a, stage, fin)
            if ok is False:
                where = getattr(a, "where", "")
                self._report(a, stage, module=where)

    # -- running one check ---------------------------------------------------------------
    def _call(self, a, stage, fn):
        """fn() -> bool; None when the assertion raised (then disabled, with a warning)."""
        a.stage = stage
        a.detail = ""
        try:
            return bool(fn())
        except Exception as exc:  # noqa: BLE001 - a broken check must not end the program
            if a.name not in self._warned:
                self._warned.add(a.name)
                first = (str(exc).splitlines() or [""])[0][:300]   # (torch's can be 100 lines)
                _frames.warn_at_user_line(f"mldebug: assertion {a.name!r} raised "
                                          f"{type(exc).__name__}: {first}; it is switched off")
            a.enabled = False
            return None

    def _run(self, a, stage, fn, module="", module_type="", node="") -> bool:
        ok = self._call(a, stage, fn)
        if ok is False:
            self._report(a, stage, module=module, module_type=module_type, node=node)
            return False
        return True

    def _report(self, a, stage, module="", module_type="", param="", node="") -> None:
        frame = _frames.user_frame(sys._getframe(1))
        site = getattr(self, "_loss_site", None) if stage in (BEFORE_BACKWARD, BACKWARD) else None
        file, line, function = site or _frames.location(frame)   # (it pauses in FRAME)
        if module and not module_type:
            module_type = self._module_type(module)
        v = Violation(kind="assertion", assertion=a.name, text=a.text(),
                      stage=STOP_STAGE.get(stage, "other"), module=module,
                      module_type=module_type, frame=frame, file=file, line=line,
                      function=function, param=param, node=node,
                      step=self.step if self._opt_seen else None)
        self.violations.append(v)
        self.step_violations.append(v)
        self._mark(a.name, module, node)
        key = (a.name, node or param or module)
        if key in self._stopped:
            return
        self._stopped.add(key)
        callback = self.on_violation
        if callback is None:
            session = current()
            if not session.wants("assertion"):
                return
            callback = session.on_violation
        self._busy += 1
        try:
            with watch_suspended():
                callback(v)
        finally:
            self._busy -= 1

    def _module_type(self, path) -> str:
        root = self._last_root() if self._last_root is not None else None
        if root is None:
            return ""
        try:
            return type(root.get_submodule(path)).__name__
        except Exception:
            return ""

    def _mark(self, name, module, node) -> None:
        """Put the violation's name on its node of the pass being captured."""
        src = self._source
        graph = src.current() if hasattr(src, "current") else getattr(src, "graph", None)
        if graph is None:
            return
        n = graph.nodes.get(node) if node else None
        if n is None and module:
            graph.mark(module, name)
        elif n is not None and name not in n.violations:
            n.violations += (name,)

    # -- quiet: our own ops are not the program's ----------------------------------------
    def _quiet(self):
        """mldebug's own work (QUIET, which `_listening` reads: our hooks ignore what we
        run): the graph capture and the watch look away; autograd keeps recording (a
        check may need a gradient)."""
        return own_work(keep_grad=True)


def _grad_norms(params) -> dict:
    """id(grad) -> float norm of every floating gradient (summaries.norms: one foreach
    norm and one transfer per (device, dtype) group instead of one sync per parameter)."""
    grads = [p.grad for _, p in params]
    grads = [g for g in grads
             if g is not None and g.is_floating_point() and g.layout == torch.strided]
    return dict(zip(map(id, grads), l2_norms(grads)))


def _refresh_runners() -> None:
    for runner in list(_RUNNERS):
        runner._refresh()


_registry.on_register(_refresh_runners)   # a (de)registration reaches the running runners
