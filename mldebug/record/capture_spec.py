"""What a recording captures in full: `Capture` (torchfunc's recorders as one API) and the
choice of modules by path pattern, type, index or callable."""
from __future__ import annotations

import dataclasses
import fnmatch

import torch.nn as nn

from ..core.errors import UsageError
from ..core.modnames import module_names

WHAT = ("pre_input", "input", "output", "input_grad", "output_grad")
REDUCTIONS = ("sum", "mean", "max", "min", "first", "last")


@dataclasses.dataclass
class Capture:
    """Full-tensor capture of chosen modules (torchfunc's recorders as one API).

    modules    what to capture: a path pattern ('encoder.*'), a type, an index into
               model.modules(), a callable (path, module) -> bool, or a list of those
    what       'pre_input'   inputs as the forward pre-hook sees them (ForwardPre)
               'input'       inputs when the module returns (ForwardInput)
               'output'      outputs (ForwardOutput)
               'input_grad'  gradient of the loss w.r.t. the inputs (BackwardInput)
               'output_grad' gradient of the loss w.r.t. the outputs (BackwardOutput)
    reduction  how the invocations of one step combine: None stores each invocation
               (call 0, 1, ...); 'sum', 'mean', 'max', 'min', 'first', 'last'; or a
               callable (accumulated, new) -> accumulated, as torchfunc's reduction
    index      which tensor of the inputs/outputs (default 0, the first)
    max_bytes  a tensor larger than this is skipped with one warning
    """

    modules: object
    what: str = "output"
    reduction: object = None
    index: int = 0
    max_bytes: int = 64 << 20

    def __post_init__(self):
        if self.what not in WHAT:
            raise UsageError(f"Capture what must be one of {', '.join(WHAT)}, what={self.what!r}")
        if not (self.reduction is None or callable(self.reduction)
                or self.reduction in REDUCTIONS):
            raise UsageError(f"Capture reduction must be None, a callable or one of "
                             f"{', '.join(REDUCTIONS)}, reduction={self.reduction!r}")




def _select(model: nn.Module, spec, what: str) -> list:
    """[(path, module)] chosen by SPEC among model.modules() (what='modules') or
    model.children() (what='children'); clear errors for bad specs."""
    names = module_names(model)
    if what == "children":
        pool = [(name, m) for name, m in model.named_children()]
    else:
        pool = [(names.get(id(m), name), m) for name, m in model.named_modules()]
    if spec is True or spec == "all":
        return pool
    items = spec if isinstance(spec, (list, tuple)) and not (
        isinstance(spec, tuple) and spec and all(isinstance(s, type) for s in spec)) else [spec]
    chosen: dict = {}
    for item in items:
        found = []
        if isinstance(item, bool):
            raise UsageError(f"{what}= takes types, indices, path patterns or callables, "
                             f"got {item!r}")
        if isinstance(item, int):
            if not -len(pool) <= item < len(pool):
                raise UsageError(f"{what}= index {item} is out of range: the model has "
                                 f"{len(pool)} {'children' if what == 'children' else 'modules'}")
            found = [pool[item]]
        elif isinstance(item, str):
            found = [(p, m) for p, m in pool if fnmatch.fnmatchcase(p or "(root)", item)]
        elif isinstance(item, type) or (isinstance(item, tuple) and item):
            found = [(p, m) for p, m in pool if isinstance(m, item)]
        elif callable(item):
            found = [(p, m) for p, m in pool if item(p, m)]
        else:
            raise UsageError(f"{what}= takes types, indices, path patterns or callables, "
                             f"got {item!r}")
        if not found:
            raise UsageError(f"{what}={item!r} matched no module of {type(model).__name__}")
        for p, m in found:
            chosen.setdefault(id(m), (p, m))
    return list(chosen.values())
