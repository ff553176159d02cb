"""What the tiers may leave unchecked, and why (tiers.py has the design).

- The loss region's backward: a dry run is not needed when its autograd nodes cannot make
  a NaN/Inf from finite values (`SAFE_BACKWARD`, `loss_region_safe`).
- Inside an exact nn.Sequential of torch.nn layers, where no user code runs: sentinels
  whose job the next child does (`sequential_plan`), and parameter gradients that follow
  from checked ones (`params_to_check`).
- The gradient of a torch.nn layer's output, where the layer's own parameter gradients
  show any NaN/Inf in it (`params_show_grad`): they are checked after backward.

In the first two cases only a float overflow could make a NaN/Inf where nothing looks;
the tiers still see it later (the model output's gradient, the optimizer step's check),
and say so. In the third nothing is left unseen: it is seen one check later.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed
import torch.nn as nn
import torch.nn.modules.module as _module_mod

# Backward nodes that make finite gradients from finite gradients and finite saved
# values (short of a float overflow): a loss region made only of these needs no dry run.
# Not here, on purpose: Log, Sqrt, Rsqrt, Pow below 1, Reciprocal, Exp, Atan2, Norm, BCE (its
# derivative divides by x(1-x)), and a division by a tensor that needs a gradient.
SAFE_BACKWARD = frozenset("""
    NllLossBackward0 NllLoss2DBackward0 LogSoftmaxBackward0 SoftmaxBackward0
    MseLossBackward0 L1LossBackward0 SmoothL1LossBackward0 HuberLossBackward0
    BinaryCrossEntropyWithLogitsBackward0 SoftMarginLossBackward0
    MeanBackward0 MeanBackward1 SumBackward0 SumBackward1 AddBackward0 AddBackward1
    SubBackward0 SubBackward1 RsubBackward0 RsubBackward1 NegBackward0 MulBackward0
    MulBackward1 DivBackward1 ViewBackward0 UnsafeViewBackward0 ReshapeAliasBackward0
    TBackward0 TransposeBackward0 TransposeBackward1 PermuteBackward0 SelectBackward0
    SliceBackward0 SqueezeBackward0 SqueezeBackward1 SqueezeBackward2 SqueezeBackward3
    SqueezeBackward4 UnsqueezeBackward0 ExpandBackward0 CloneBackward0 ToCopyBackward0
    IndexBackward0 GatherBackward0 CatBackward0 StackBackward0 SplitBackward0
    SplitWithSizesBackward0 UnbindBackward0 WhereBackward0 MaskedFillBackward0
    AbsBackward0 ClampBackward1 ClampMinBackward0 ClampMaxBackward0 ReluBackward0
    ThresholdBackward0 SigmoidBackward0 TanhBackward0 LogSigmoidBackward0
    SoftplusBackward0 MaxBackward0 MaxBackward1 MinBackward0 MinBackward1 AmaxBackward0
    AminBackward0 FlattenBackward0 DetachBackward0 AliasBackward0
    torch::autograd::AccumulateGrad
""".split())
MAX_LOSS_NODES = 64    # a bigger region outside the model gets the dry run


def _loss_region(roots, boundary):
    """The autograd nodes from ROOTS down to (not into) the BOUNDARY ids, each once."""
    stack = [r.grad_fn for r in roots]
    # id -> node: the Python object of an autograd node lives only while referenced, and
    # a later node's object may take the address of a dropped one (seen on CUDA: a node
    # of the region was skipped as if seen)
    seen: dict = {}
    while stack:
        node = stack.pop()
        if node is None or id(node) in boundary or id(node) in seen:
            continue
        seen[id(node)] = node
        yield node
        for fn, _ in node.next_functions:     # (a loop: no generator resumed per edge)
            stack.append(fn)


def loss_region_nodes(roots, boundary, limit=MAX_LOSS_NODES) -> list:
    """Names of the autograd nodes from ROOTS down to the BOUNDARY ids (at most LIMIT)."""
    return [node.name() for _, node in zip(range(limit), _loss_region(roots, boundary))]


def loss_region_safe(roots, boundary) -> bool:
    """Whether the autograd graph from ROOTS down to the BOUNDARY nodes (the model
    outputs' nodes, by id) is made only of SAFE_BACKWARD nodes (a few: a bounded walk)."""
    for count, node in enumerate(_loss_region(roots, boundary), 1):
        if count > MAX_LOSS_NODES:
            return False
        name = node.name()
        if name == "DivBackward0":
            # x / y: safe when only x needs a gradient (a y near 0 would blow up dy)
            edges = node.next_functions
            if len(edges) > 1 and edges[1][0] is not None:
                return False
        elif name == "PowBackward0":
            # x ** k: k * x ** (k - 1) is finite for k >= 1 (k = 0.5 is a sqrt)
            exponent = getattr(node, "_saved_exponent", None)
            if not isinstance(exponent, (int, float)) or not exponent >= 1:
                return False
        elif name not in SAFE_BACKWARD:
            return False
    return True


# Inside an exact nn.Sequential, a child's output goes only to the next child. When that
# child is one of these torch.nn layers (exact type: a subclass may override forward),
# the sentinels on the output before it can be left out:
# - PROPAGATES: a NaN/Inf anywhere in its input leaves a NaN/Inf in its output (checked
#   there; the flag then defers to the Sequential, whose exact re-run pins the op). ReLU
#   and Tanh are not here: they turn -Inf or +-Inf into finite values.
# - BACKWARD_SAFE: its backward makes a finite input gradient from a finite output
#   gradient and finite saved values (short of an overflow), so the input's gradient
#   needs no check of its own: the output's is checked, or the next one's, and so on.
_PROPAGATES = {nn.Linear, nn.Bilinear, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d,
               nn.LayerNorm, nn.GroupNorm, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
               nn.Dropout3d, nn.Identity, nn.Flatten, nn.Unflatten, nn.LeakyReLU}
_CONVS = {nn.Conv1d, nn.Conv2d, nn.Conv3d}      # these propagate at stride 1 only
_BACKWARD_SAFE = _PROPAGATES | _CONVS | {
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Softmax, nn.LogSoftmax,
    nn.Hardtanh, nn.ELU, nn.MaxPool1d, nn.MaxPool2d, nn.MaxPool3d, nn.AvgPool1d,
    nn.AvgPool2d, nn.AvgPool3d, nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d, nn.AdaptiveMaxPool1d, nn.AdaptiveMaxPool2d, nn.AdaptiveMaxPool3d}
NO_FORWARD_CHECK = 1    # the next child shows any NaN/Inf of this output
NO_GRAD_CHECK = 2       # the next child's backward cannot make one in its gradient
_HOOKS = ("_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")


def _has_hooks(module) -> bool:
    """Whether MODULE carries a hook of its own that may change what flows through it
    (a loop, not a generator: this runs for each child at every step)."""
    for h in _HOOKS:
        if getattr(module, h, None):
            return True
    return False


def _consumer_code(child) -> int:
    """What the output before CHILD in a Sequential can leave out (flags above)."""
    kind = type(child)
    if kind not in _BACKWARD_SAFE or _has_hooks(child):
        return 0            # (a user hook may change what it gets or gives back)
    code = NO_GRAD_CHECK
    if kind in _PROPAGATES or (kind in _CONVS and all(s == 1 for s in child.stride)):
        code |= NO_FORWARD_CHECK
    return code


# torch.nn layers whose parameters' gradients show any NaN/Inf of their output's gradient:
# each value of that gradient enters a sum of products that makes a weight's or a bias's
# gradient (a Linear's g^T x and sum(g), a convolution's, a norm's affine terms, the rows
# of an embedding), and a NaN or an Inf there leaves a NaN or an Inf (inf * 0 is a NaN).
# Where those parameter gradients are checked after backward, the output's gradient needs
# no pre-hook of its own (`params_show_grad`). Not here: a transposed convolution (an
# output position that no input reaches adds only to the bias), and an embedding with a
# padding_idx (that row's gradient is dropped) or a sparse one (its gradient is not read).
_GRAD_SHOWN_BY_PARAMS = {nn.Linear, nn.Bilinear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                         nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d,
                         nn.BatchNorm3d, nn.Embedding}
# the same by name, for layers of other libraries (not imported here): Hugging Face's
# Conv1D (GPT-2 and its kin) is a Linear written as addmm(bias, x, weight)
_GRAD_SHOWN_BY_NAME = {("transformers.pytorch_utils", "Conv1D")}
_KIND_SHOWN: dict = {}  # type -> whether it is one of those (exact type: a subclass may
                        # override forward)
PARAMS_SHOW_GRAD = 4    # this output's gradient shows in its module's parameter gradients


def params_show_grad(module) -> bool:
    """Whether MODULE's parameter gradients (computed by this process, checked after
    backward) show any NaN/Inf of its output's gradient: a layer of _GRAD_SHOWN_BY_PARAMS
    with a plain parameter that needs a gradient, and no hook of its own (a backward hook
    may change the gradient it is given). Runs for each such call at every step."""
    kind = type(module)
    shown = _KIND_SHOWN.get(kind)
    if shown is None:
        shown = _KIND_SHOWN[kind] = kind in _GRAD_SHOWN_BY_PARAMS or (
            kind.__module__, kind.__qualname__) in _GRAD_SHOWN_BY_NAME
    if not shown or _has_hooks(module):
        return False
    if kind is nn.Embedding and (module.padding_idx is not None or module.sparse):
        return False
    for p in module._parameters.values():
        # (a tensor subclass, a DTensor's shard, is not the gradient this call made)
        if p is not None and type(p) is nn.Parameter and p.requires_grad:
            return True
    return False


def grads_local() -> bool:
    """Whether a parameter's gradient after backward is what this process's backward made:
    not while a global module backward hook may change gradients, nor across ranks (DDP
    averages them, FSDP keeps a shard). Asked once per outermost call."""
    if _module_mod._global_backward_hooks or _module_mod._global_backward_pre_hooks:
        return False
    return not (_DIST and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() > 1)


_DIST = torch.distributed.is_available()


_SEQUENTIAL_PLANS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def sequential_plan(seq) -> dict:
    """id(child) -> flags for the output of each child of nn.Sequential SEQ (by what the
    next child is; 0 for the last one and for a child that appears twice). Cached per
    Sequential, rebuilt when its children change."""
    children = tuple(seq._modules.values())
    cached = _SEQUENTIAL_PLANS.get(seq)
    if cached is not None and cached[0] == children:
        return cached[1]
    plan = {}
    for i, child in enumerate(children):
        nxt = children[i + 1] if i + 1 < len(children) else None
        code = _consumer_code(nxt) if nxt is not None else 0
        plan[id(child)] = 0 if id(child) in plan else code
    _SEQUENTIAL_PLANS[seq] = (children, plan)
    return plan


def params_to_check(module) -> list:
    """The parameters whose gradients need a check after backward. Left out: those of a
    torch.nn layer in BACKWARD_SAFE reached from an exact nn.Sequential through exact
    nn.Sequentials only: no code of the user's runs in that tree, the layers' backward
    makes finite gradients from finite ones, and the gradient of each output there is
    checked (the last child's) or flows through such layers to one that is. Used only
    when the loss region has no dry run: its nodes, also those on paths into a
    parameter (an L2 term), are then all in SAFE_BACKWARD. (A list built in loops, not
    nested generators and `parameters()`: it runs at every step, and on a GPU's
    launch-bound step each Python call counts.)"""
    out: list = []
    _checked_params(module, out)
    return out


def _checked_params(module, out: list) -> None:
    if type(module) is not nn.Sequential or _has_hooks(module):
        _all_params(module, out)
        return
    for p in module._parameters.values():
        if p is not None:
            out.append(p)
    for child in module._modules.values():
        if child is None:
            continue
        if (type(child) in _BACKWARD_SAFE and not child._modules
                and not _has_hooks(child)):
            continue
        _checked_params(child, out)


def _all_params(module, out: list) -> None:
    """`module.parameters()` into OUT, in its order (modules depth first, each module and
    each parameter once), without its chain of generators."""
    modules, params = set(), set()
    stack = [module]
    while stack:
        m = stack.pop()
        if id(m) in modules:
            continue
        modules.add(id(m))
        for p in m._parameters.values():
            if p is not None and id(p) not in params:
                params.add(id(p))
                out.append(p)
        children = [c for c in m._modules.values() if c is not None]
        children.reverse()
        stack += children
