"""The Recorder: hooks installed on recorded steps only, stats batched per step, one
SQLite transaction per recorded step. See `mldebug/record/__init__.py` for the API."""
from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn as nn
from torch.optim import optimizer as _optim_hooks

from ..core import cuda_graphs as _cuda_graphs
from ..core import replay as _replay
from ..core.compile import FLAG as _FLAG
from ..core.compile import dynamo_compiling as _dynamo_compiling
from ..core.ranks import this_rank
from ..core.errors import UsageError
from ..core.quiet import own_work
from ..core.structs import tensors_in
from . import block_graphs
from . import stats as _stats
from .capture_hooks import CaptureHooks, cuda_graph_aside
from .capture_spec import REDUCTIONS, WHAT, Capture, _select  # noqa: F401 - record's names
from .io_holding import IoHolding
from .step_writing import StepWriting
from .store import SCALAR_FLUSH_S, Writer, check_run_name, run_path

LOGS = ("io", "io_grad", "params", "params_grad")
SCALARS_HELD = 4096     # scalars waiting for a step's end at most: written beyond that
# capture points: torchfunc's ForwardPre, ForwardInput, ForwardOutput, BackwardInput,
# BackwardOutput
_ACTIVE: Optional["Recorder"] = None
_tensors = tensors_in   # (the engine's one walk: mldebug/core/structs.py)


def spare_core() -> bool:
    """Whether this process may use more cores than torch's intra-op threads take."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:       # (not on Linux)
        cores = os.cpu_count() or 1
    return cores > torch.get_num_threads()


def active_recorder() -> Optional["Recorder"]:
    return _ACTIVE


def _close_at_exit() -> None:
    """A program that ends without close(): write what is pending, mark the run closed."""
    if _ACTIVE is not None:
        _ACTIVE.close()


_EXIT_HOOKED = False


class Recorder(CaptureHooks, IoHolding, StepWriting):
    """A running recording. Context manager; `close()` removes every hook (idempotent).

    Attributes: run (name), path (the .sqlite file), step_index (the step in progress),
    recording (whether this step is recorded), closed.
    """

    def __init__(self, model: Optional[nn.Module], log=LOGS, every=1, modules=None,
                 children=None, condition: Optional[Callable] = None, capture=(),
                 run_dir: str = "runs", run: Optional[str] = None, note: str = "",
                 bins: int = 30, sample: int = 1024, clip: Optional[float] = 5.0,
                 batch_dim: Optional[int] = 0, training_only: bool = True,
                 if_exists: str = "replace", step: str = "optimizer", background: bool = True,
                 first_step: int = 0, to=None):
        if model is not None and not isinstance(model, nn.Module):
            raise UsageError(f"record: model must be a torch.nn.Module or None, "
                             f"got {type(model).__name__}")
        log = (log,) if isinstance(log, str) else tuple(log)
        bad = [x for x in log if x not in LOGS]
        if bad:
            raise UsageError(f"record: log entries must be among {', '.join(LOGS)}, "
                             f"got {bad[0]!r}")
        if isinstance(every, bool) or not (callable(every) or (isinstance(every, int) and every >= 1)):
            raise UsageError(f"record: every must be an int >= 1 or a callable(step) -> bool, "
                             f"every={every!r}")
        if not isinstance(bins, int) or isinstance(bins, bool) or bins < 1:
            raise UsageError(f"record: bins must be an int >= 1, bins={bins!r}")
        if not isinstance(sample, int) or isinstance(sample, bool) or sample < 0:
            raise UsageError(f"record: sample must be an int >= 0 (0: no histograms), "
                             f"sample={sample!r}")
        if clip is not None and not (isinstance(clip, (int, float)) and clip > 0):
            raise UsageError(f"record: clip must be a number > 0 or None, clip={clip!r}")
        if if_exists not in ("replace", "new", "error"):
            raise UsageError(f"record: if_exists must be 'replace', 'new' or 'error', "
                             f"if_exists={if_exists!r}")
        if isinstance(first_step, bool) or not isinstance(first_step, int) or first_step < 0:
            raise UsageError(f"record: first_step must be an int >= 0, first_step={first_step!r}")
        if step not in ("optimizer", "manual"):
            raise UsageError(f"record: step must be 'optimizer' or 'manual', step={step!r}")
        if condition is not None and not callable(condition):
            raise UsageError(f"record: condition must be callable(module, inputs, output) "
                             f"-> bool, condition={condition!r}")
        captures = [capture] if isinstance(capture, Capture) else list(capture or ())
        for c in captures:
            if not isinstance(c, Capture):
                raise UsageError(f"record: capture= takes mldebug.record.Capture(...) items, "
                                 f"got {c!r}")
        if captures and model is None:
            raise UsageError("record: capture= needs a model")
        self.model = model
        self.log = frozenset(log)
        self.every = every
        self.condition = condition
        self.bins, self.sample, self.clip, self.batch_dim = bins, sample, clip, batch_dim
        self.training_only = training_only
        self.manual = step == "manual"
        name = check_run_name(run) if run is not None else time.strftime("run-%Y%m%d-%H%M%S")
        rank = this_rank()
        if rank is not None:
            # the ranks of a job record side by side: one file a rank, never one shared
            name = (name.replace("{rank}", str(rank.rank)) if "{rank}" in name
                    else f"{name}-rank{rank.rank}")
        path = run_path(run_dir, name)
        if os.path.exists(path):
            if if_exists == "error":
                raise UsageError(f"record: run {name!r} exists in {run_dir!r} "
                                 f"(if_exists='replace' overwrites, 'new' adds a suffix)")
            if if_exists == "new":
                k = 2
                while os.path.exists(run_path(run_dir, f"{name}-{k}")):
                    k += 1
                name = f"{name}-{k}"
                path = run_path(run_dir, name)
        self.run, self.path, self.run_dir = name, path, run_dir
        # modules, parameters, captures
        self._mods: list = []
        self._params: list = []        # (name, module path, param)
        if model is not None:
            if modules is None and children is None:
                chosen = _select(model, True, "modules")
            else:
                chosen = []
                if modules is not None:
                    chosen += _select(model, modules, "modules")
                if children is not None:
                    chosen += _select(model, children, "children")
                seen = set()
                chosen = [x for x in chosen if not (id(x[1]) in seen or seen.add(id(x[1])))]
            self._mods = chosen
            for path_, m in chosen:
                for pname, p in m.named_parameters(recurse=False):
                    self._params.append((f"{path_}.{pname}" if path_ else pname, path_, p))
        self._captures: list = []      # (Capture, [(path, module)])
        for c in captures:
            self._captures.append((c, _select(model, c.modules, "modules")))
        self._param_ids = {id(p) for _, _, p in self._params} or (
            {id(p) for p in model.parameters()} if model is not None else set())
        self._owns = weakref.WeakKeyDictionary()
        self._io_keys: dict = {}       # (module path, kind, index) -> series keys
        meta = {
            "run": name, "created": time.strftime("%Y-%m-%d %H:%M:%S"),
            "model": type(model).__name__ if model is not None else None,
            "log": sorted(self.log), "every": every if isinstance(every, int) else "callable",
            "bins": bins, "sample": sample, "clip": clip, "batch_dim": batch_dim,
            "modules": len(self._mods), "note": note, "torch": torch.__version__,
            "step": "manual" if self.manual else "optimizer", "pid": os.getpid(),
            # which rank of a multi-process job recorded it (None: a single process)
            "rank": rank.rank if rank is not None else None,
            "world_size": rank.world_size if rank is not None else None}
        # the live copy (to=) opens before the store: a missing extra or a bad target
        # leaves an earlier run of this name as it was
        self._mirror = self._open_mirror(to, name, meta, background)
        try:
            self._writer = Writer(path, meta, background=background)
        except BaseException:
            self._close_mirror()
            raise
        # a step finished on the host is committed here when torch's threads take every
        # core: a writer thread then runs instead of them, not beside them, and its GIL
        # hand-offs cost the step more than the commit (~80 µs) does
        self._commit_here = not background or not spare_core()
        # the number of the first step recorded: a framework's global step when a resumed
        # run starts recording (the integrations' callbacks)
        self.step_index = first_step
        self._after_step = False
        # f(step, {param name: (norm, grad norm)}) after each recorded step (history.py)
        self.norm_listeners: list = []
        self.recording = False
        self.closed = False
        self._lock = threading.Lock()
        self._handles: list = []       # hooks of the recorded step
        self._global: list = []        # hooks for the whole recording
        self._opt_hooks: list = []     # the optimizer's (the automatic step boundary)
        self._scalars: list = []       # (step, name, value or tensor)
        self._notes: list = []
        self._last_flush = time.monotonic()
        self._warned: set = set()
        # on a device, io series seen unchanged from when they are recorded to the step's
        # end wait for it (`_add_io`); those seen changed in place are copied when seen
        self._unchanged: set = set()
        self._copy_now: set = set()
        self._in_compiled = False      # a module hook ran inside torch.compile's tracing
        self._reset_step()
        if note:
            self._notes.append((0, time.time(), note))

    # -- lifecycle -------------------------------------------------------------------
    def start(self) -> "Recorder":
        global _ACTIVE
        if _ACTIVE is not None and _ACTIVE is not self:
            self._writer.close()
            raise UsageError(f"record: run {_ACTIVE.run!r} is recording; close it before "
                             "starting another")
        _ACTIVE = self
        global _EXIT_HOOKED
        if not _EXIT_HOOKED:
            import atexit
            atexit.register(_close_at_exit)
            _EXIT_HOOKED = True
        try:
            if self.model is not None:
                # marks the start of a step's forward: scalars logged after
                # optimizer.step() and before it belong to the step that just ended
                self._global.append(self.model.register_forward_pre_hook(self._root_pre))
            # a capture in "global" mode forbids a read on any thread: the writer's
            # queue is drained before one begins
            self._global.append(_cuda_graphs.before_capture(self._writer.flush))
            if not self.manual and self.model is not None:
                self._opt_hooks = [
                    _optim_hooks.register_optimizer_step_pre_hook(self._opt_pre),
                    _optim_hooks.register_optimizer_step_post_hook(self._opt_post)]
            self._begin_step()
            self._listen_for_stops()
        except BaseException:
            self.close()
            raise
        if self._mirror is not None:   # closed before the exit hooks of what it opened
            import atexit               # (wandb's, registered since): the last step lands
            atexit.register(_close_at_exit)
        return self

    def close(self) -> None:
        """Write the step in progress (if it holds anything), remove every hook, close
        the store (idempotent; also the `with` block's exit, exception or not)."""
        global _ACTIVE
        if self.closed:
            return
        self.closed = True
        try:
            if cuda_graph_aside():
                pass     # closed inside a capture: nothing more is read (a sync breaks it)
            elif self.recording and (self._batch or self._entries or self._cap_store):
                self._finish_step()
            else:
                self._flush_scalars(force=True)
        except Exception as exc:  # noqa: BLE001 - closing never raises into the program
            self._warn("close", exc)
        finally:
            self._remove(self._handles)
            self._remove(self._global)
            self._remove(self._opt_hooks)
            self._tensor_hooks_off()
            self._stop_listening()
            if _ACTIVE is self:
                _ACTIVE = None
            self._writer.submit(lambda: self._writer.set_meta(status="closed",
                                                              steps=self.step_index))
            self._writer.close()
            self._close_mirror()
            if _ACTIVE is None:      # (every step read: no replay of a block graph in flight)
                block_graphs.GRAPHS.release()

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else f"step {self.step_index}"
        return f"<mldebug.record run={self.run!r} {state} -> {self.path}>"

    @staticmethod
    def _remove(handles: list) -> None:
        while handles:
            try:
                handles.pop().remove()
            except Exception:  # noqa: BLE001
                pass

    def _warn(self, where: str, exc: BaseException) -> None:
        if where not in self._warned:
            self._warned.add(where)
            self._say(f"mldebug.record: {where} failed ({type(exc).__name__}: {exc}); "
                      "the program goes on")

    # -- steps -----------------------------------------------------------------------
    def _wanted(self, step: int) -> bool:
        if isinstance(self.every, int):
            return step % self.every == 0
        try:
            return bool(self.every(step))
        except Exception as exc:  # noqa: BLE001 - the user's callable
            self._warn("every(step)", exc)
            return False

    def _reset_step(self) -> None:
        if not hasattr(self, "_pool"):   # copy blocks and buffers, reused from step to step
            self._pool, self._host_pool = _stats.BlockPool(), _stats.HostPool()
        self._batch = _stats.StepBatch(self.bins, self.clip, self.sample, self._pool,
                                       self._host_pool)
        self._entries: list = []      # (series key, meta, call, row)
        self._seen: dict = {}         # id(tensor) -> (weakref, version, row)
        self._copied: list = []       # (tensor or weakref, version, row): io copied when
        self._copied_numel = 0        # seen (`_add_io`), and their values
        self._grads: dict = {}        # id(tensor) -> (weakref, [targets])
        self._thooks: list = []       # tensor hook handles
        self._calls: dict = {}        # module path -> invocations this step
        self._cap_store: dict = {}    # (key, call) -> (Capture, tensor)
        self._params_done = False
        self._serial = getattr(self, "_serial", 0) + 1

    def _begin_step(self) -> None:
        """Decide whether the step in progress is recorded; hooks on only if it is."""
        self.recording = self._wanted(self.step_index)
        if self.recording and not self._handles and self.model is not None:
            self._install()
        elif not self.recording and self._handles:
            self._remove(self._handles)

    def _install(self) -> None:
        hooks = []
        try:
            if self.log & {"io", "io_grad"}:
                for path, m in self._mods:
                    hooks.append(m.register_forward_hook(self._make_fwd(path)))
            for cap, mods in self._captures:
                for path, m in mods:
                    if cap.what == "pre_input":
                        hooks.append(m.register_forward_pre_hook(self._make_pre(path, cap)))
                    else:
                        hooks.append(m.register_forward_hook(self._make_cap(path, cap)))
        except BaseException:
            self._remove(hooks)
            raise
        self._handles = hooks

    def step(self) -> None:
        """End the step in progress (write it if recorded) and start the next. The first
        call turns the automatic counting at optimizer.step() off."""
        if self.closed:
            raise UsageError("record: step() after close()")
        if not self.manual:
            self.manual = True
            self._remove(self._opt_hooks)
        if cuda_graph_aside():   # (a step captured runs at the replays: not one now)
            return
        self._end_step()

    def _end_step(self) -> None:
        try:
            if self.recording:
                self._finish_step()
            else:
                self._flush_scalars()
        except Exception as exc:  # noqa: BLE001 - recording never breaks the program
            self._warn(f"step {self.step_index}", exc)
            self._reset_step()
        self.step_index += 1
        self._after_step = True
        try:
            self._begin_step()
        except Exception as exc:  # noqa: BLE001
            self._warn("installing hooks", exc)

    # -- optimizer hooks (the default step boundary) -----------------------------------
    def records_norms_of(self, optimizer) -> bool:
        """Whether the step in progress gives the norms of every parameter OPTIMIZER
        updates, and of their gradients (recorded step, `params` and `params_grad`)."""
        if self.manual or not self._params or not (
                self.recording and {"params", "params_grad"} <= self.log):
            return False
        ids = self._param_ids      # (those of `_params`, which is not empty here)
        return all(id(p) in ids for g in optimizer.param_groups for p in g["params"])

    def _owned(self, optimizer) -> bool:
        owns = self._owns.get(optimizer)
        if owns is None:
            ids = self._param_ids
            owns = not ids or any(id(p) in ids for g in optimizer.param_groups
                                  for p in g["params"])
            try:
                self._owns[optimizer] = owns
            except TypeError:
                pass
        return owns

    def _opt_pre(self, optimizer, args, kwargs):
        if self.recording and not self._params_done and self._owned(optimizer) \
                and not cuda_graph_aside():
            try:
                self._record_params()
            except Exception as exc:  # noqa: BLE001
                self._warn("parameter stats", exc)
        return None

    def _root_pre(self, module, args):
        # (under torch.compile dynamo replays this attribute's store after the graph)
        self._after_step = False
        return None

    def _opt_post(self, optimizer, args, kwargs):
        # (a step captured into a CUDA graph is not one: its update runs at the replays)
        if self._owned(optimizer) and not cuda_graph_aside():
            self._end_step()
        return None

    # -- forward / backward hooks --------------------------------------------------------
    def _make_fwd(self, path: str):
        def hook(module, args, output):
            # dynamo traces this call: nothing of ours in its graph
            if _dynamo_compiling() or _FLAG._is_compiling_flag:
                self._in_compiled = True
                return None
            if _replay._depth or (self.training_only and not module.training) \
                    or (_cuda_graphs.MAYBE[0] and cuda_graph_aside()):
                return None  # (a watch's re-run of the call is not a new invocation)
            try:
                if self.condition is not None and not self.condition(module, args, output):
                    return None
                call = self._calls.get(path, 0)
                self._calls[path] = call + 1
                with own_work():
                    for i, t in enumerate(_tensors(args)):
                        self._io(path, "input", i, call, t)
                    for i, t in enumerate(_tensors(output)):
                        self._io(path, "output", i, call, t)
            except Exception as exc:  # noqa: BLE001 - never break the forward
                self._warn(f"recording {path or '(root)'}", exc)
            return None
        return hook

    def _io(self, path: str, kind: str, i: int, call: int, t: torch.Tensor) -> None:
        if not t.is_floating_point():
            return
        keys = self._io_keys.get((path, kind, i))
        if keys is None:      # the series keys of this slot, made once
            keys = self._io_keys[(path, kind, i)] = (f"{path}:{kind}[{i}]",
                                                     f"{path}:{kind}_grad[{i}]", kind + "_grad")
        if "io" in self.log:
            self._entries.append((keys[0], (path, kind, i, "", t.shape, t.dtype), call,
                                  self._row_of(t, keys[0])))
        if "io_grad" in self.log and t.requires_grad:
            self._watch_grad(t, (keys[1], (path, keys[2], i, "", t.shape, t.dtype), call))

    def _row_of(self, t: torch.Tensor, key: str) -> int:
        """Row of T now; the same tensor at the same version is computed once a step."""
        seen = self._seen.get(id(t))
        if seen is not None and seen[0]() is t and seen[1] == t._version:
            return seen[2]
        row = self._add_io(t, (key,))
        self._seen[id(t)] = (weakref.ref(t), t._version, row)
        return row

    def _watch_grad(self, t: torch.Tensor, target: tuple) -> None:
        got = self._grads.get(id(t))
        if got is not None and got[0]() is t:
            got[1].append(target)
            return
        targets = [target]
        self._grads[id(t)] = (weakref.ref(t), targets)
        serial = self._serial
        # a tensor hook, not a pre-hook on t.grad_fn (cheaper): that one would miss
        # torch.autograd.grad(loss, t), which never runs the node, and see the gradient
        # after the user's own hooks on T changed it
        self._thooks.append(t.register_hook(lambda g: self._on_grad(serial, targets, g)))

    def _on_grad(self, serial: int, targets: list, grad) -> None:
        if _replay._depth or (_cuda_graphs.MAYBE[0] and cuda_graph_aside()):
            return   # the watch's dry run of the loss's backward: the real pass follows
        if serial != self._serial or self.closed or grad is None:
            return None
        try:
            with own_work(), self._lock:
                row = self._add_io(grad, [target[0] for target in targets], self.batch_dim)
                for key, meta, call in targets:
                    self._entries.append((key, meta, call, row))
        except Exception as exc:  # noqa: BLE001
            self._warn("gradient stats", exc)
        return None

    def _tensor_hooks_off(self) -> None:
        self._remove(self._thooks)

    def _record_params(self) -> None:
        """The parameters and their gradients now, before the optimizer changes them: all
        at once (`StepBatch.add_many`: on a GPU one copy for them all)."""
        self._params_done = True
        keys, ts = [], []
        for name, path, p in self._params:
            if "params" in self.log and p.is_floating_point():
                keys.append((f"{name}:param", (path, "param", 0, name, p.shape, p.dtype), 0))
                ts.append(p)
            g = p.grad
            if "params_grad" in self.log and g is not None and g.is_floating_point() \
                    and g.layout == torch.strided:
                keys.append((f"{name}:param_grad", (path, "param_grad", 0, name, g.shape,
                                                    g.dtype), 0))
                ts.append(g)
        with own_work(), self._lock:
            rows = self._batch.add_many(ts, self.sample)
            self._entries += [key + (row,) for key, row in zip(keys, rows)]

    # -- named tensors, scalars, notes ---------------------------------------------------
    def log_tensor(self, name: str, t, role: str = "") -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"log_tensor: name must be a non-empty str, name={name!r}")
        if not isinstance(t, torch.Tensor):
            raise UsageError(f"log_tensor: expected a torch.Tensor for {name!r}, "
                             f"got {type(t).__name__}")
        if not self.recording or not t.is_floating_point() or t.numel() == 0 \
                or cuda_graph_aside():
            return
        try:
            call = self._calls.get(("tensor", name), 0)
            self._calls[("tensor", name)] = call + 1
            with own_work():
                key = f"{name}:tensor"
                self._entries.append((key, ("", "tensor", 0, name, t.shape, t.dtype, role),
                                      call, self._row_of(t, key)))
        except Exception as exc:  # noqa: BLE001
            self._warn(f"log_tensor {name}", exc)

    def log_scalar(self, name: str, value) -> None:
        if not isinstance(name, str) or not name:
            raise UsageError(f"log_scalar: name must be a non-empty str, name={name!r}")
        if isinstance(value, torch.Tensor):
            if value.numel() != 1:
                raise UsageError(f"log_scalar: {name!r} must be a number or a one-element "
                                 f"tensor, got a tensor of shape {list(value.shape)}")
            if cuda_graph_aside():
                return      # a tensor being captured has no value before a replay
            # read at the next write: no sync now; a copy, as the tensor may be written
            # over in place by then (a CUDA graph's static loss at every replay)
            value = value.detach().reshape(()).clone()
        elif not isinstance(value, (int, float, np.number)) or isinstance(value, bool):
            raise UsageError(f"log_scalar: {name!r} must be a number, got "
                             f"{type(value).__name__}")
        self._scalars.append((self._log_step(), name, value))
        if len(self._scalars) >= SCALARS_HELD and not cuda_graph_aside():
            self._flush_scalars(force=True)   # (no step ends: a loop of graph replays)

    def log_note(self, text: str) -> None:
        self._notes.append((self._log_step(), time.time(), str(text)))

    def _log_step(self) -> int:
        """The step a scalar or note belongs to: after optimizer.step() and before the
        model's next forward, still the step that just ended."""
        return self.step_index - 1 if self._after_step and self.step_index else self.step_index

    def _flush_scalars(self, force: bool = False) -> None:
        if not (self._scalars or self._notes):
            return
        now = time.monotonic()
        if not force and now - self._last_flush < SCALAR_FLUSH_S:
            return
        self._last_flush = now
        notes, self._notes = self._notes, []
        scalars, self._scalars = self._scalars, []
        step = self.step_index
        self._writer.submit(lambda: self._commit(step, None, None, scalars, notes, [],
                                                 recorded=False))
