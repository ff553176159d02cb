"""Which sample a non-finite value came in with: the variable that holds the batch at the
user's line where it enters the model, the rows of the batch that carry it, and — for a
batch from a `torch.utils.data.DataLoader` — the dataset indices of those rows.

The bookkeeping (installed while a watch runs, removed when it closes):
- torch's DataLoader iterators draw each batch's sampler indices with `_next_index()`
  (the main process; workers only fetch). The patch appends them to a queue on the
  iterator; `__next__` takes the oldest one for the batch it returns. That pairing is
  torch's own order of delivery, whatever the sampler, shuffling, workers or prefetching,
  as long as `in_order=True` (the default). An iterator whose first indices were drawn
  before the watch started (or one with `in_order=False`) is not tracked: no index is
  better than a wrong one.
- the tensors of each returned batch (a tensor, or dicts, tuples, lists, namedtuples of
  them, as any collate_fn returns) are kept as weak references, with their indices, in a
  ring of the last RING batches: no copy, no tensor op. A few microseconds a batch.

At a stop whose value came in through an input (no op made it), `describe` matches that
input to a batch tensor (the same tensor, a view of it, or a copy with the same
non-finite positions: `x.to(device)`), finds the user's frame where the batch enters the
model (the innermost user frame outside every module call that holds it) and the name
there (`x`, `batch['pixel_values']`), and the rows along the batch dimension.
"""
from __future__ import annotations

import collections
import weakref
from collections.abc import Mapping
from types import FrameType
from typing import Optional

import torch
from torch import Tensor

from ..core import frames as _frames

RING = 16              # batches remembered (a framework may prefetch a few ahead)
MAX_TENSORS = 32       # tensors remembered per batch
_MAX_DEPTH = 3         # nesting searched in a batch or a frame's locals

_ring: collections.deque = collections.deque(maxlen=RING)
_generation = 0        # +1 at every install: queues of an earlier watch are not trusted
_saved: Optional[tuple] = None


class _Batch:
    __slots__ = ("indices", "tensors")

    def __init__(self, indices, tensors):
        self.indices = indices      # list of dataset indices, one index, or None
        self.tensors = tensors      # [(path inside the batch, weakref to the tensor)]


# -- the bookkeeping ------------------------------------------------------------------
def install() -> None:
    """Note the indices and tensors of every DataLoader batch from now on."""
    global _saved, _generation
    if _saved is not None:
        return
    from torch.utils.data import dataloader as _dl
    base = _dl._BaseDataLoaderIter
    orig_next, orig_index, orig_reset = (base.__dict__["__next__"],
                                         base.__dict__["_next_index"], base.__dict__["_reset"])
    _generation += 1
    generation = _generation

    def _reset(self, loader, *args, **kwargs):
        # a new epoch (or the iterator's start with workers): a fresh queue
        self._mldebug_indices = ((generation, collections.deque())
                                 if getattr(loader, "in_order", True) else None)
        return orig_reset(self, loader, *args, **kwargs)

    def _next_index(self):
        index = orig_index(self)
        queue = self.__dict__.get("_mldebug_indices")
        if queue is None or queue[0] != generation:
            if self._num_workers:
                return index        # started before the watch: its prefetch is unknown
            # single process: the index drawn now is the batch returned now
            queue = self._mldebug_indices = (generation, collections.deque())
        queue[1].append(index)
        return index

    def __next__(self):
        data = orig_next(self)
        queue = self.__dict__.get("_mldebug_indices")
        indices = queue[1].popleft() if queue is not None and queue[0] == generation \
            and queue[1] else None
        _note(data, indices)
        return data

    for name, fn, orig in (("__next__", __next__, orig_next),
                           ("_next_index", _next_index, orig_index),
                           ("_reset", _reset, orig_reset)):
        fn.__qualname__, fn.__doc__ = orig.__qualname__, orig.__doc__
        setattr(base, name, fn)
    _saved = (base, orig_next, orig_index, orig_reset)


def uninstall() -> None:
    global _saved
    if _saved is None:
        return
    base, orig_next, orig_index, orig_reset = _saved
    base.__next__, base._next_index, base._reset = orig_next, orig_index, orig_reset
    _saved = None
    _ring.clear()


def _note(data, indices) -> None:
    tensors: list = []
    _walk(data, "", 0, tensors)
    if tensors:
        if isinstance(indices, (list, tuple)):
            # an IterableDataset's sampler yields None for every sample: no indices
            indices = None if None in indices else list(indices)
        elif indices is not None and not isinstance(indices, int):
            try:
                indices = [int(i) for i in indices]   # a custom batch_sampler's ranges
            except TypeError:
                indices = None
        _ring.append(_Batch(indices, tensors))


def _walk(data, path: str, depth: int, out: list) -> None:
    if len(out) >= MAX_TENSORS:
        return
    if isinstance(data, Tensor):
        try:
            out.append((path, weakref.ref(data)))
        except TypeError:
            pass
        return
    if depth >= _MAX_DEPTH:
        return
    if isinstance(data, Mapping):
        for key, value in data.items():
            _walk(value, f"{path}[{key!r}]", depth + 1, out)
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        for key, value in zip(data._fields, data):
            _walk(value, f"{path}.{key}", depth + 1, out)
    elif isinstance(data, (list, tuple)):
        for i, value in enumerate(data):
            _walk(value, f"{path}[{i}]", depth + 1, out)


# -- at a stop -------------------------------------------------------------------------
def name_the_data(v, value) -> None:
    """Violation V's VALUE came in from outside the watched ops: if it is the data, say
    which sample, and stop where the batch enters the model."""
    found = describe(value, v.frame)
    if found is None:
        return
    v.data, entry = found
    if entry is not None and entry is not v.frame:
        v.frame = entry
        v.file, v.line, v.function = _frames.location(entry)


def describe(value, frame: Optional[FrameType]):
    """(data, entry frame) for a non-finite input `value` that came in from outside the
    watched ops, or None when it is not data (a parameter, a constant, nothing found).

    data: {"variable": name at the entry line or None, "rows": [...] or None,
           "dataset_indices": [...] or None}; entry frame: where the batch enters the model
    (None: keep the stop's frame)."""
    if not isinstance(value, Tensor) or _is_parameter(value):
        return None
    found = _in_batches(value)
    targets = [value] if found is None else [value, found[1]]
    entry, variable = _entry(frame, targets)
    if found is None and variable is None:
        return None
    batch, tensor = found if found is not None else (None, value)
    indices = batch.indices if batch is not None else None
    size = len(indices) if isinstance(indices, list) else None
    rows = _nonfinite_rows(tensor, size)
    dataset_indices = None
    if isinstance(indices, int):          # batch_size=None: the batch is one sample
        dataset_indices = [indices]
    elif size is not None and rows is not None:
        dataset_indices = [indices[r] for r in rows]
    return {"variable": variable, "rows": rows, "dataset_indices": dataset_indices}, entry


def _is_parameter(t: Tensor) -> bool:
    """A parameter or a view of one (`weight.t()` is what a Linear's matmul reads)."""
    return isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)


def _same(a: Tensor, b: Tensor) -> bool:
    if a is b:
        return True
    try:
        pa, pb = a.untyped_storage().data_ptr(), b.untyped_storage().data_ptr()
    except Exception:  # noqa: BLE001 - tensors without storage (meta, sparse, subclasses)
        return False
    return bool(pa) and pa == pb and a.device == b.device


def _same_values(a: Tensor, b: Tensor) -> bool:
    """A copy of a batch tensor (to another device or dtype): the same shape and the
    same non-finite positions."""
    if a.shape != b.shape or not (a.is_floating_point() and b.is_floating_point()):
        return False
    try:
        return bool(torch.equal(torch.isfinite(a).cpu(), torch.isfinite(b).cpu()))
    except Exception:  # noqa: BLE001
        return False


def _in_batches(value: Tensor):
    """(batch, batch tensor) holding `value` (newest batch first), or None."""
    live = [(batch, t) for batch in reversed(_ring) for _, ref in batch.tensors
            if (t := ref()) is not None]
    for batch, t in live:
        if _same(t, value):
            return batch, t
    for batch, t in live:
        if _same_values(t, value):
            return batch, t
    return None


def _in_module_code(frame: FrameType) -> bool:
    """A module's call (`Module._call_impl`), or a `forward` of a module called without
    it (the watch's replays call `forward` itself)."""
    code = frame.f_code
    if code.co_name in ("_call_impl", "_wrapped_call_impl"):
        return code.co_filename.replace("\\", "/").endswith("torch/nn/modules/module.py")
    if code.co_name != "forward" or "self" not in code.co_varnames[:1]:
        return False
    try:
        return isinstance(frame.f_locals.get("self"), torch.nn.Module)
    except Exception:  # noqa: BLE001
        return False


def _entry(frame: Optional[FrameType], targets: list):
    """(frame, name): the user frame where the batch enters the model and the name of
    the tensor there. Preferred: the innermost user frame outside every module call that
    holds it; then any. (None, None) if none holds it."""
    chain = []
    while frame is not None:
        chain.append(frame)
        frame = frame.f_back
    outermost_call = max((i for i, f in enumerate(chain) if _in_module_code(f)), default=-1)
    found = []
    for i, f in enumerate(chain):
        if not _frames.is_user_file(f.f_code.co_filename):
            continue
        name = _name_in(f, targets)
        if name is not None:
            found.append((i, f, name))
    for choice in ([x for x in found if x[0] > outermost_call], found):
        if choice:
            return choice[0][1], choice[0][2]
    return None, None


def _name_in(frame: FrameType, targets: list) -> Optional[str]:
    """The expression that reaches one of `targets` from the frame's locals: a plain
    name first (`x`), then an item or field of a container (`batch['x']`, `batch[0]`)."""
    try:
        local = dict(frame.f_locals)
    except Exception:  # noqa: BLE001
        return None
    for name, value in local.items():
        if isinstance(value, Tensor) and not _is_parameter(value) and any(
                _same(value, t) for t in targets):
            return name
    for name, value in local.items():
        if isinstance(value, (Mapping, list, tuple)) and not isinstance(value, Tensor):
            path = _path_in(value, targets, 1)
            if path is not None:
                return name + path
    return None


def _path_in(data, targets: list, depth: int) -> Optional[str]:
    if depth > _MAX_DEPTH:
        return None
    if isinstance(data, Mapping):
        items = [(f"[{k!r}]", v) for k, v in list(data.items())[:MAX_TENSORS]]
    elif isinstance(data, tuple) and hasattr(data, "_fields"):
        items = [(f".{k}", v) for k, v in zip(data._fields, data)]
    elif isinstance(data, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(data[:MAX_TENSORS])]
    else:
        return None
    for path, value in items:
        if isinstance(value, Tensor):
            if any(_same(value, t) for t in targets):
                return path
        else:
            inner = _path_in(value, targets, depth + 1)
            if inner is not None:
                return path + inner
    return None


def _nonfinite_rows(t: Tensor, size: Optional[int]):
    """Indices along the batch dimension (the first one of `size` elements when the
    batch size is known, else dim 0) whose slice holds a NaN or an Inf."""
    if t.dim() == 0:
        return None
    dim = 0
    if size is not None and t.shape[0] != size:
        dims = [d for d in range(t.dim()) if t.shape[d] == size]
        if not dims:
            return None
        dim = dims[0]
    try:
        bad = ~torch.isfinite(t.detach())
        bad = bad.movedim(dim, 0).reshape(t.shape[dim], -1).any(1)
        return [int(i) for i in bad.nonzero().flatten().tolist()]
    except Exception:  # noqa: BLE001 - an odd tensor subclass: no rows rather than a crash
        return None
