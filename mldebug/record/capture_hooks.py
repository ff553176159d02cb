"""Full-tensor captures of chosen modules: the hooks `Capture` installs and how each
invocation's tensor is kept or reduced (methods of `Recorder`)."""
from __future__ import annotations

import torch

from ..core import cuda_graphs as _cuda_graphs
from ..core import replay as _replay
from ..core.compile import FLAG as _FLAG
from ..core.compile import dynamo_compiling as _dynamo_compiling
from ..core.quiet import own_work
from ..core.structs import tensors_in as _tensors
from .capture_spec import Capture


CUDA_GRAPH_NOTE = ("mldebug.record does not record what runs inside it (a replay fires "
                   "no hook, and a copy captured with the program's kernels would be made "
                   "again at every replay); the steps outside the graph are recorded")


def cuda_graph_aside() -> bool:
    """Whether the recorder's hooks step aside now: this thread captures a CUDA graph
    (said once; `core.cuda_graphs`)."""
    return bool(_cuda_graphs.MAYBE[0]) and _cuda_graphs.step_aside("record", CUDA_GRAPH_NOTE)


class CaptureHooks:
    """Methods of `Recorder`: the hooks of its full-tensor captures."""

    def _make_pre(self, path: str, cap: Capture):
        def hook(module, args):
            # dynamo traces this call: nothing of ours in its graph
            if _dynamo_compiling() or _FLAG._is_compiling_flag:
                self._in_compiled = True
                return None
            if _replay._depth or (self.training_only and not module.training) \
                    or (_cuda_graphs.MAYBE[0] and cuda_graph_aside()):
                return None  # (a watch's re-run of the call is not a new invocation)
            self._capture(path, cap, module, args)
            return None
        return hook

    def _make_cap(self, path: str, cap: Capture):
        def hook(module, args, output):
            if _dynamo_compiling() or _FLAG._is_compiling_flag:
                self._in_compiled = True
                return None
            if _replay._depth or (self.training_only and not module.training) \
                    or (_cuda_graphs.MAYBE[0] and cuda_graph_aside()):
                return None  # (a watch's re-run of the call is not a new invocation)
            if self.condition is not None:
                try:
                    if not self.condition(module, args, output):
                        return None
                except Exception as exc:  # noqa: BLE001
                    self._warn(f"condition at {path}", exc)
                    return None
            value = output if cap.what == "output" or cap.what == "output_grad" else args
            self._capture(path, cap, module, value)
            return None
        return hook

    def _capture(self, path: str, cap: Capture, module, value) -> None:
        try:
            ts = _tensors(value)
            if cap.index >= len(ts) or cap.index < -len(ts):
                return
            t = ts[cap.index]
            key = f"{path}:capture_{cap.what}[{cap.index}]"
            ckey = (key, id(cap))
            count = self._calls.get(ckey, 0)
            self._calls[ckey] = count + 1
            if cap.what.endswith("_grad"):
                if t.requires_grad:
                    serial = self._serial
                    self._thooks.append(t.register_hook(
                        lambda g: self._cap_add(serial, key, cap, count, g)))
                return
            self._cap_add(self._serial, key, cap, count, t)
        except Exception as exc:  # noqa: BLE001
            self._warn(f"capture at {path}", exc)

    def _cap_add(self, serial, key, cap: Capture, count: int, t) -> None:
        if serial != self._serial or self.closed or _replay.active():
            return None
        try:
            with own_work(), self._lock:
                if t.numel() * t.element_size() > cap.max_bytes:
                    self._warn(f"capture {key} ({t.numel() * t.element_size()} bytes > "
                               f"max_bytes={cap.max_bytes})", RuntimeError("too large"))
                    return None
                t = t.detach()
                red = cap.reduction
                if red is None:
                    self._cap_store[(key, count)] = (cap, t.clone(), "none", 1)
                    return None
                prev = self._cap_store.get((key, -1))
                if prev is None:
                    self._cap_store[(key, -1)] = (cap, t.clone(), red if isinstance(red, str)
                                                  else getattr(red, "__name__", "callable"), 1)
                    return None
                acc, n = prev[1], prev[3] + 1
                if callable(red):
                    acc = red(acc, t)
                elif red in ("sum", "mean"):
                    acc = acc + t          # mean divides at the end of the step
                elif red == "max":
                    acc = torch.maximum(acc, t)
                elif red == "min":
                    acc = torch.minimum(acc, t)
                elif red == "last":
                    acc = t.clone()
                self._cap_store[(key, -1)] = (cap, acc, prev[2], n)
        except Exception as exc:  # noqa: BLE001 - e.g. shapes that do not reduce
            self._warn(f"capture {key}", exc)
        return None
