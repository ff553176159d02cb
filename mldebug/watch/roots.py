"""The roots: which module calls the cheap check looks at, what it keeps of each call,
and how the roots are learned.

A root is a module called outside every other module call (the model, a loss module).
While the watch learns (from its start to the end of the first optimizer step, or to a
root's second call) the full watch runs, with global module hooks that see every call:
the outermost ones are the roots, and what each calls is noted (the parameters and the
buffers of the layers it uses but does not own; which buffers and arguments its call
writes in place). Then the global hooks go and each root gets a pre- and a post-hook of
its own (step.py's `_root_pre` and `_root_post`): every module below it runs on torch's
fast call path. A module first called later, outside every root, is checked op by op by
the per-op check, which is on outside the roots. A compiled root (`torch.compile(model)`)
keeps the global hooks (dynamo compiled it with them: without them it would compile it
again) and takes the same cheap path through them; its inner modules run compiled.
DDP's own module is no root: the module it wraps is (DDP's forward, its buffer broadcast,
runs outside, and a re-run never runs it).

A root call's record (RootCall) holds what a re-run needs (rerun.py): the arguments as
passed, the RNG and autocast, the buffers as the call started (copies of those a call
writes in place), the user's line of the call; and what its checks found.
"""
from __future__ import annotations

import weakref

import torch
import torch.nn as nn
from torch import Tensor

from .checks import version_of

_ScriptModule = torch.jit.ScriptModule

_get_state = torch._C.Generator.get_state
_MODULE_FILE = nn.Module._call_impl.__code__.co_filename
try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
except ImportError:  # noqa: BLE001 - a torch without distributed
    _DDP = ()


class RootInfo:
    """A root module, as its first call showed it (under the full watch, while the roots
    are learned): what its calls' checks read and what a re-run of one restores. Kept
    for the watch's life (the module weakly)."""

    __slots__ = ("ref", "wrapper", "used", "start", "calls", "modules", "params", "buffers",
                 "copied", "written", "copies_args", "collective", "compiled", "__weakref__")

    def __init__(self, module, wrapper=None):
        self.ref = weakref.ref(module)
        self.wrapper = wrapper       # the DDP around it (names start there)
        self.used: dict = {}         # id -> module called inside its first call
        self.start: dict = {}        # its first call: (id(module), name) -> (buffer,
                                     # version) as first seen; "args" -> their versions
        self.calls = 0               # calls seen while learning
        self.modules: list = []      # the modules its call runs: its own, and the layers
                                     # it calls but does not own
        self.params: list = []       # every parameter it may use (its own, and those of
                                     # the layers it calls but does not own)
        self.buffers: list = []      # (module, name) of the buffers of those modules
        self.copied: list = []       # indices into buffers that a call writes in place:
                                     # copied as each call starts, for a re-run
        self.written: list = []      # (module, name) of parameters a call writes in place
                                     # (a momentum encoder's): a re-run writes copies
        self.copies_args = False     # a call writes its argument in place: copied too
        self.collective = ""         # why a re-run would run a collective (FSDP2, ...)
        self.compiled = type(module).__name__ == "OptimizedModule" or \
            getattr(module, "_compiled_call_impl", None) is not None

    @property
    def module(self):
        return self.ref()

    def note(self, module) -> None:
        """MODULE runs inside the first call: its buffers as they are before it runs (the
        root's, as it starts: the parameters of all its modules too)."""
        if id(module) in self.used:
            return
        self.used[id(module)] = module
        start = self.start
        for name, b in module._buffers.items():
            if b is not None and (id(module), name) not in start:
                start[(id(module), name)] = (b, version_of(b))
        if len(self.used) > 1:
            return
        for m in module.modules():
            for name, p in m._parameters.items():
                if p is not None:
                    start[(id(m), name, "p")] = (p, version_of(p))

    def learned(self, args, kwargs) -> None:
        """The first call returned: the parameters and buffers of what it called, and
        what it wrote in place (copied as each next call starts)."""
        root = self.ref()
        modules = list(root.modules()) if root is not None else []
        seen = {id(m) for m in modules}
        modules += [m for k, m in self.used.items() if k not in seen]
        params, ids = [], set()
        for m in modules:
            for name, p in m._parameters.items():
                if p is not None and id(p) not in ids:
                    ids.add(id(p))
                    params.append(p)
                    before = self.start.get((id(m), name, "p"))
                    if before is not None and p is before[0] and before[1] is not None \
                            and version_of(p) != before[1]:
                        self.written.append((m, name))
            for name, b in m._buffers.items():
                if b is not None:
                    before = self.start.get((id(m), name))
                    if before is not None and b is before[0] and before[1] is not None \
                            and version_of(b) != before[1]:
                        self.copied.append(len(self.buffers))
                    self.buffers.append((m, name))
            self.collective = self.collective or _collective(m)
        self.modules, self.params = modules, params
        self.copies_args = _versions(args, kwargs) != self.start.get("args")
        self.used, self.start = {}, {}


def in_a_root(roots, record) -> bool:
    """Whether the outermost module call of RECORD (a module record, context.py) is one of
    ROOTS (id -> RootInfo): one whose output the watch checks as it returns."""
    while record[1] is not None:
        record = record[1]
    info = roots.get(id(record[0]))
    return info is not None and info.ref() is record[0]


def _collective(module) -> str:
    """Why re-running MODULE's forward on one rank alone would wait for the others."""
    kind = type(module)
    if any(c.__name__ == "FSDPModule" for c in kind.__mro__):
        return "FSDP2 gathers its parameters from every rank in its forward"
    if kind.__name__ == "SyncBatchNorm" and module.training:
        return "SyncBatchNorm reduces its statistics over every rank in its forward"
    return ""


class RootCall:
    """One call of a root: what its checks find and what a re-run of it needs."""

    __slots__ = ("info", "args", "kwargs", "arg_copies", "arg_versions", "cpu_rng",
                 "cuda_rng", "autocast", "grad", "buffers", "copies", "versions", "site",
                 "micro", "outs", "nodes", "grads", "stopped", "unfaithful",
                 "__weakref__")

    def __init__(self, info, args, kwargs):
        self.info = info
        self.args, self.kwargs = args, kwargs
        self.arg_copies = None       # (args, kwargs) copied as the call started
        self.arg_versions = None
        self.cpu_rng = self.cuda_rng = None
        self.autocast = ()
        self.grad = True             # grad mode of the call
        self.buffers: list = []      # the buffer objects as the call started (info.buffers)
        self.copies: dict = {}       # index -> copy, of those written in place
        self.versions: list = []     # their version counters as the call started
        self.site = ("", 0, "")      # the user's line of the call
        self.micro = 0               # the backward it feeds, counted within the step
        self.outs: list = []         # weakrefs to its floating outputs
        self.nodes: list = []        # (autograd node, output_nr, position) of those that
                                     # need a gradient, until its backward
        self.grads: dict = {}        # position -> gradient of that output (kept in backward)
        self.stopped = False         # a stop was made of it (what descends is no new stop)
        self.unfaithful = ""         # why a re-run may compute something else

    def outputs(self) -> list:
        return [o for o in (r() for r in self.outs) if o is not None]


class _KeepGrad:
    """Pre-hook on the autograd node of a root output: keeps the output's gradient for a
    re-run of the call's backward (the loss region's graph is gone by then)."""

    __slots__ = ("call", "pos", "index")

    def __init__(self, call, pos, index):
        self.call = weakref.ref(call)    # (the call keeps the node: no cycle)
        self.pos, self.index = pos, index

    def __call__(self, grad_outputs):
        call = self.call()
        if call is not None and self.index < len(grad_outputs):
            grad = grad_outputs[self.index]
            if grad is not None:
                call.grads[self.pos] = grad


class _RootHook:
    """A root's own hook (pre or post): a callable object, so that `copy.deepcopy` of the
    model (an EMA copy) keeps it as it is (the copy is no root of the watch's: ignored)
    and pickling the whole model leaves an inert hook."""

    __slots__ = ("fn",)

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, *args):
        return self.fn(*args)

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (_InertHook, ())


class _InertHook:
    """What a root's hook is in a model pickled while the watch ran: nothing."""

    def __call__(self, *args):
        return None


class _Backward:
    """One backward's check: what it checked, and what its judge needs."""

    __slots__ = ("calls", "checked", "kept", "params", "dry", "stopped", "nodes", "micro")


# -- capture ---------------------------------------------------------------------------
def rng_state():
    """(cpu state, cuda states or None): the generators' own `get_state` (C), not
    `torch.get_rng_state()` and `torch.cuda.get_rng_state_all()`: the same states,
    without their Python layers. CUDA's generators exist once it is initialized."""
    try:
        cuda = list(map(_get_state, torch.cuda.default_generators)) or None
    except Exception:  # noqa: BLE001 - no re-run of CUDA randomness then
        cuda = None
    return _get_state(torch.default_generator), cuda


def autocast_state():
    """((device, dtype), ...) of the devices where autocast is on."""
    state = []
    for device in ("cpu", "cuda"):
        try:
            if torch.is_autocast_enabled(device):
                state.append((device, torch.get_autocast_dtype(device)))
        except Exception:  # noqa: BLE001 - older torch: no per-device query
            pass
    return tuple(state)


def call_kwargs(start) -> dict:
    """The keyword arguments of the module call whose global hook is running: the
    `_call_impl` frame above the hook holds them (global hooks are not given them)."""
    f = start
    for _ in range(4):
        if f is None:
            break
        code = f.f_code
        if code.co_filename == _MODULE_FILE and code.co_name in ("inner", "_call_impl"):
            kwargs = f.f_locals.get("kwargs")
            return dict(kwargs) if isinstance(kwargs, dict) else {}
        f = f.f_back
    return {}


def _versions(args, kwargs):
    """Version counters of the tensors passed at the top level, or None (none, or
    inference tensors without one)."""
    out = []
    try:
        for a in args:
            if isinstance(a, Tensor):
                out.append(a._version)
        if kwargs:
            for a in kwargs.values():
                if isinstance(a, Tensor):
                    out.append(a._version)
    except RuntimeError:
        return None
    return out or None


def _copy_args(args, kwargs):
    """ARGS and KWARGS with their top-level tensors copied (one op)."""
    tensors = [a for a in args if isinstance(a, Tensor)] + \
        [a for a in kwargs.values() if isinstance(a, Tensor)]
    copies = _clone_all(tensors)
    for original, copy in zip(tensors, copies):
        if original.requires_grad:
            copy.requires_grad_(True)     # (a leaf of the re-run's backward, as it was)
    copies = iter(copies)
    args = tuple(next(copies) if isinstance(a, Tensor) else a for a in args)
    kwargs = {k: next(copies) if isinstance(a, Tensor) else a for k, a in kwargs.items()}
    return args, kwargs


def _clone_all(tensors) -> list:
    with torch.no_grad():
        try:
            return list(torch._foreach_clone(tensors))
        except (AttributeError, RuntimeError, TypeError):   # (an older torch)
            return [t.clone() for t in tensors]


def _wrapped_by(top, module):
    """The DDP whose inner module MODULE is called right now (TOP: the module stack)."""
    if top is not None and top[1] is None and _DDP and isinstance(top[0], _DDP) \
            and getattr(top[0], "module", None) is module:
        return top[0]
    return None


class Roots:
    """Methods of `Watch` (core.py): learning the roots, from the full watch's global
    module hooks (state in `Watch`: `_roots`, `_learning`, `_learning_root`)."""

    def _learn_pre(self, module, args, top, frame):
        """The full watch's pre-hook while the roots are learned (TOP: the module stack;
        FRAME: the hook's caller, whose frame holds the call's keyword arguments): the
        RootInfo of a root's call, else None."""
        wrapper = _wrapped_by(top, module)
        if top is not None and wrapper is None:
            root = self._learning_root
            if root is not None and root.calls == 1:
                root.note(module)       # (a module the root uses)
            return None
        if top is None and _DDP and isinstance(module, _DDP):
            return None                 # (its inner module is the root)
        info = self._roots.get(id(module))
        if info is None or info.ref() is not module:
            info = self._roots[id(module)] = RootInfo(module, wrapper)
            self._names.roots.add(module if wrapper is None else wrapper)
            if info.compiled:
                info.learned((), {})    # (its inner calls run compiled: unseen)
                return info
        if info.compiled:
            return info
        info.calls += 1
        if info.calls == 1:
            info.note(module)
            info.start["args"] = _versions(args, call_kwargs(frame))
        self._learning_root = info
        return info

    def _learn_post(self, module, args, frame):
        """The full watch's post-hook while the roots are learned."""
        info = self._learning_root
        if info is None or module is not info.ref():
            return
        self._learning_root = None
        if info.calls == 1:
            info.learned(args, call_kwargs(frame))
        else:
            self._learned = True        # (a second call of a root: the roots are known)

    def _end_learning(self):
        """The roots are known: the global module hooks go (every module below a root
        runs on torch's fast call path) and each root gets hooks of its own, unless one
        is compiled or a compiled function ran (dynamo compiled them with the global
        hooks, and would compile them again without: the global hooks stay, and take the
        cheap path)."""
        self._learning = False
        self._learning_root = None
        infos = [i for i in self._roots.values() if i.ref() is not None and not i.start]
        if any(info.compiled for info in infos) or self._compiled_seen \
                or not self._module_handles:
            return      # (dynamo compiled code with the global hooks: they stay)
        self._remove_module_hooks()
        for info in infos:
            module = info.ref()
            if isinstance(module, _ScriptModule):
                continue   # (takes no Python hooks: its ops are checked one by one)
            self._root_hooks += [
                module.register_forward_pre_hook(_RootHook(self._root_pre), with_kwargs=True,
                                                 prepend=True),
                module.register_forward_hook(_RootHook(self._root_post), with_kwargs=True,
                                             always_call=True)]
