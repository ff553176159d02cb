"""Cost of `mldebug.watch()` on a training step, as ratios to the plain step.

    python benchmarks/bench_watch.py [--quick] [--models mlp,cnn,gpt] [--device cpu|cuda]
                                     [--batch-scale N] [--compile] [--launch-bound]

One process; for each model the variants run interleaved, in a new (seeded) random order
every repetition (plain, plain2 = plain again, the noise floor, a do-nothing dispatch
mode, the watch's hooks doing nothing (its design's floor), watch, watch exact,
detect_anomaly, naive per-op isfinite), repetition after repetition, and the median step
time of each is printed as a ratio to plain. A step is zero_grad + forward + backward +
optimizer step.
Models: MLP 784-256-256-10 (batch 64, SGD), ResNet-18-like CNN (batch 16, 3x64x64, SGD
with momentum), GPT-like transformer (6 layers, d=512, 8 heads, seq 128, batch 8, AdamW).
Then, for each model, the counts that do not depend on the machine: the aten ops and
host reads of one healthy step, plain and watched (the budget: at most +10% ops).
The last line is the cost of the DataLoader bookkeeping the watch keeps to name a bad
sample's dataset index (watch/data_origin.py): time per batch of a shuffled DataLoader
over MLP-sized batches with it and without, as a share of the MLP step, and the tensor ops
it adds (none: it keeps references and indices).
--launch-bound times the same models with tiny shapes on one CPU thread, the watch on its
device path: a step's time is then its host work, as on a launch-bound GPU step (the
CPU's stand-in for the H100 figures; benchmarks/README.md, watch, says how close it is).
--compile runs each model as `torch.compile(model)` and prints, besides the ratios, dynamo's
counts (machine-independent): graph breaks and the graphs compiled in all, which stay
those of the plain compiled step when nothing mldebug installs enters a compiled graph
(detect_anomaly and the dispatch-mode variants make dynamo fall back to eager).
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch._dynamo
import torch._dynamo.utils as dynamo_utils
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mldebug  # noqa: E402
from opcount import count_calls, count_runs, count_step  # noqa: E402


# -- models --------------------------------------------------------------------------
BATCH_SCALE = [1]   # --batch-scale: larger batches keep a GPU busy (not launch-bound)
TINY = [False]      # --launch-bound: the same models with tiny shapes (see main)
WRAP = [lambda m: m]   # --compile: torch.compile; the loss calls the wrapped model


def make_mlp(device):
    d, h, b = (16, 16, 4) if TINY[0] else (784, 256, 64)
    m = nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(),
                      nn.Linear(h, 10)).to(device)
    x = torch.randn(b * BATCH_SCALE[0], d, device=device)
    y = torch.randint(0, 10, (b * BATCH_SCALE[0],), device=device)
    run = WRAP[0](m)
    return m, (lambda: F.cross_entropy(run(x), y)), torch.optim.SGD(m.parameters(), lr=0.01)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU(inplace=True)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False),
                                      nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        out += identity
        return self.relu(out)


class ResNet18(nn.Module):
    def __init__(self, classes=10, width=64):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 7, 2, 3, bias=False),
                                  nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                                  nn.MaxPool2d(3, 2, 1))
        layers, cin = [], width
        for cout, stride in [(width, 1), (2 * width, 2), (4 * width, 2), (8 * width, 2)]:
            layers += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
            cin = cout
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(8 * width, classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def make_cnn(device):
    width, b, side = (2, 2, 16) if TINY[0] else (64, 16, 64)
    m = ResNet18(width=width).to(device)
    x = torch.randn(b * BATCH_SCALE[0], 3, side, side, device=device)
    y = torch.randint(0, 10, (b * BATCH_SCALE[0],), device=device)
    run = WRAP[0](m)
    return m, (lambda: F.cross_entropy(run(x), y)), torch.optim.SGD(m.parameters(), lr=0.01,
                                                                    momentum=0.9)


class GPT(nn.Module):
    def __init__(self, vocab=1000, d=512, heads=8, layers=6, T=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(T, d)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True,
                                           norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(T))

    def forward(self, idx):
        T = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(T, device=idx.device))
        x = self.blocks(x, mask=self.mask[:T, :T], is_causal=True)
        return self.head(self.ln(x))


def make_gpt(device):
    vocab, d, heads, T, b = (50, 16, 2, 8, 2) if TINY[0] else (1000, 512, 8, 128, 8)
    m = GPT(vocab, d, heads, T=T).to(device)
    idx = torch.randint(0, vocab, (b * BATCH_SCALE[0], T), device=device)
    y = torch.randint(0, vocab, (b * BATCH_SCALE[0], T), device=device)
    run = WRAP[0](m)
    return m, (lambda: F.cross_entropy(run(idx).flatten(0, 1), y.flatten())), \
        torch.optim.AdamW(m.parameters(), lr=1e-4)


MODELS = {"mlp": make_mlp, "cnn": make_cnn, "gpt": make_gpt}


# -- variants ------------------------------------------------------------------------
UNINITIALIZED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
                 "empty_permuted"}


class NaiveIsfinite(TorchDispatchMode):
    """Reference: check every floating output with isfinite().all() per op (views and
    uninitialized memory skipped, like the watch)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func.overloadpacket.__name__ in UNINITIALIZED:
            return out
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in outs:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                if not bool(torch.isfinite(t).all()):
                    raise FloatingPointError(str(func))
        return out


class EmptyMode(TorchDispatchMode):
    """Floor: a dispatch mode that does nothing (the cost of any Python-level op hook)."""

    @classmethod
    def _should_skip_dynamo(cls):
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


class Plain:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


class HooksFloor:
    """Floor of the watch's design: hooks that do nothing where the watch acts on a
    healthy step (a pre- and a post-hook on the model, a pre-hook on its output's
    autograd node, `torch.autograd.backward` wrapped, the optimizer's step hooks) and a
    do-nothing dispatch mode outside the model's call, backward and the step, put on and
    off the stack as the watch's is. What the watch adds beyond it is its own work."""

    def __init__(self, model):
        self.model, self.handles, self.mode, self.off = model, [], EmptyMode(), []

    def _pop(self):
        n = torch._C._len_torch_dispatch_stack()
        on = bool(n) and torch._C._get_dispatch_stack_at(n - 1) is self.mode
        if on:
            torch._C._pop_torch_dispatch_stack(None)
        self.off.append(on)

    def _push(self, *_):
        if self.off.pop():
            torch._C._push_on_torch_dispatch_stack(self.mode)

    def _post(self, module, args, kwargs, out):
        self._push()
        if isinstance(out, torch.Tensor) and out.grad_fn is not None:
            out.grad_fn.register_prehook(lambda grads: None)

    def __enter__(self):
        import torch.optim.optimizer as optimizer
        backward = self.backward = torch.autograd.backward

        def wrapped(*args, **kwargs):
            self._pop()
            try:
                return backward(*args, **kwargs)
            finally:
                self._push()

        torch.autograd.backward = wrapped
        self.handles = [
            self.model.register_forward_pre_hook(lambda m, a, k: self._pop(),
                                                 with_kwargs=True, prepend=True),
            self.model.register_forward_hook(self._post, with_kwargs=True, always_call=True),
            optimizer.register_optimizer_step_pre_hook(lambda o, a, k: self._pop()),
            optimizer.register_optimizer_step_post_hook(self._push)]
        torch._C._push_on_torch_dispatch_stack(self.mode)
        return self

    def __exit__(self, *exc):
        self._pop()
        self.off.clear()
        for handle in self.handles:
            handle.remove()
        torch.autograd.backward = self.backward
        return False


def variants():
    """name -> make(model): a context manager around a step of MODEL."""
    return {
        "plain": lambda model: Plain(),
        "plain2": lambda model: Plain(),   # the same plain step again: the run's noise floor
        "empty_mode": lambda model: EmptyMode(),
        "hooks_floor": HooksFloor,   # the watch's hooks doing nothing: its design's floor
        "watch": lambda model: mldebug.watch(action="raise"),
        "watch_exact": lambda model: mldebug.watch(action="raise", exact=True),
        "detect_anomaly": lambda model: torch.autograd.detect_anomaly(check_nan=True),
        "naive_isfinite": lambda model: NaiveIsfinite(),
    }


def step(model, loss_fn, opt):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn()
    loss.backward()
    opt.step()


def sync(device):
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def measure(name, device, reps, warmup=2, steps_per_rep=1, only=None, compiled=False):
    torch.manual_seed(0)
    WRAP[0] = torch.compile if compiled else (lambda m: m)
    model, loss_fn, opt = MODELS[name](device)
    vs = {k: v for k, v in variants().items() if only is None or k in only}
    times = {k: [] for k in vs}
    for k, make in vs.items():
        for _ in range(warmup):
            with make(model):
                step(model, loss_fn, opt)
    sync(device)
    order = random.Random(0)
    for _ in range(reps):
        # a new order every repetition: a variant that always ran right after the heaviest
        # one measured ~7% slow here, which biased every ratio to it
        for k in order.sample(list(vs), len(vs)):
            make = vs[k]
            with make(model):
                # (a watch's first step learns its roots under the full watch: a cost
                # once a run, not a healthy step's; every variant gets the same step)
                step(model, loss_fn, opt)
                sync(device)
                t0 = time.perf_counter()
                for _ in range(steps_per_rep):
                    step(model, loss_fn, opt)
                sync(device)
                times[k].append((time.perf_counter() - t0) / steps_per_rep)
    med = {k: statistics.median(v) for k, v in times.items()}
    return med


def data_index_cost(reps):
    """(extra seconds a batch, extra tensor ops a batch) of the watch's DataLoader
    bookkeeping, batches of the MLP's size (64 x 784), shuffled, default collate."""
    from torch.utils.data import DataLoader, TensorDataset

    from mldebug.watch import data_origin
    batches = 50
    data = TensorDataset(torch.randn(64 * batches, 784), torch.randint(0, 10, (64 * batches,)))
    loader = DataLoader(data, batch_size=64, shuffle=True)

    def epoch():
        for _ in loader:
            pass

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    def ops(on):
        Count.n = 0
        if on:
            data_origin.install()
        try:
            with Count():
                epoch()
        finally:
            data_origin.uninstall()
        return Count.n

    times = {False: [], True: []}
    order = random.Random(1)
    for _ in range(reps):
        for on in order.sample([False, True], 2):
            if on:
                data_origin.install()
            try:
                t0 = time.perf_counter()
                epoch()
                times[on].append(time.perf_counter() - t0)
            finally:
                data_origin.uninstall()
    extra = (statistics.median(times[True]) - statistics.median(times[False])) / batches
    return extra, (ops(True) - ops(False)) / batches


def count_ops(name, device, simulate_device=False):
    """Issue 22's budget, machine-independent: the aten ops and host reads of one healthy
    step, plain and watched (top-level ops, torch's profiler; benchmarks/opcount.py).
    SIMULATE_DEVICE: the watch takes its GPU path on the CPU (what a GPU step dispatches)."""
    from mldebug.watch import core, dispatch
    out = {}
    for k in ("plain", "watch"):
        torch.manual_seed(0)
        model, loss_fn, opt = MODELS[name](device)
        core.simulate_device(simulate_device and k == "watch")
        try:
            with variants()[k](model):
                ops, reads = count_step(lambda: step(model, loss_fn, opt))
                calls = count_calls(lambda: step(model, loss_fn, opt), warmup=1)
                moded = count_runs(lambda: step(model, loss_fn, opt),
                                   dispatch._Mode.__torch_dispatch__.__code__, warmup=1)
        finally:
            core.simulate_device(False)
        out[k] = (sum(ops.values()), reads, calls, moded)
    (n0, r0, c0, _), (n1, r1, c1, m1) = out["plain"], out["watch"]
    label = "device path on the cpu" if simulate_device else device
    return (f"{name:6} ops a step ({label}): plain {n0}, watch {n1} ({n1 - n0:+d}, "
            f"{(n1 - n0) / n0:+.1%}; budget +10%); host reads: plain {r0}, watch {r1} "
            f"({r1 - r0:+d}); python calls: plain {c0}, watch {c1} ({c1 - c0:+d}); "
            f"ops through the per-op check's Python mode: {m1}")


def count_syncs(name, device):
    """Device syncs in one step, per variant (CUDA only), and the ops of a step."""
    import warnings
    torch.manual_seed(0)
    model, loss_fn, opt = MODELS[name](device)
    step(model, loss_fn, opt)

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        step(model, loss_fn, opt)
    result = {"ops": Count.n}
    for k in ("plain", "watch"):
        with variants()[k](model):
            step(model, loss_fn, opt)
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")
            try:
                with warnings.catch_warnings(record=True) as caught:
                    warnings.simplefilter("always")
                    step(model, loss_fn, opt)
            finally:
                torch.cuda.set_sync_debug_mode(0)
        result[k] = sum("synchroniz" in str(c.message) for c in caught)
    return result


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (< ~1 min)")
    parser.add_argument("--models", default="mlp,cnn,gpt")
    parser.add_argument("--variants",
                        default="plain,plain2,empty_mode,hooks_floor,watch,watch_exact,"
                                "detect_anomaly,naive_isfinite")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads")
    parser.add_argument("--batch-scale", type=int, default=1,
                        help="multiply every model's batch (a GPU busy rather than "
                             "launch-bound)")
    parser.add_argument("--launch-bound", action="store_true",
                        help="the models with tiny shapes on one thread, the watch on its "
                             "device path: the CPU's stand-in for a launch-bound GPU step, "
                             "where the step's time is the host's dispatch time")
    parser.add_argument("--compile", action="store_true",
                        help="run the models compiled (torch.compile(model)) and print dynamo's "
                             "graph and graph-break counts")
    args = parser.parse_args(argv)
    if args.batch_scale < 1:
        parser.error(f"--batch-scale must be 1 or more, got {args.batch_scale}")
    BATCH_SCALE[0] = args.batch_scale
    TINY[0] = args.launch_bound
    if args.threads or args.launch_bound:
        torch.set_num_threads(args.threads or 1)
    from mldebug.watch import core
    # (on the CPU, the watch's GPU code: what a launch-bound step pays on a device)
    simulate = args.launch_bound and args.device == "cpu"
    reps = {"mlp": 200, "cnn": 15, "gpt": 7} if not args.quick else {"mlp": 60, "cnn": 5, "gpt": 3}
    per = {"mlp": 5, "cnn": 1, "gpt": 1}
    only = args.variants.split(",")
    unknown = sorted(set(only) - set(variants()))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from "
                     f"{', '.join(variants())}")
    if "plain" not in only:
        only.insert(0, "plain")          # (every ratio is to it)
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"{'quick' if args.quick else 'full'}, batch x{args.batch_scale}"
          + (", compiled" if args.compile else "")
          + (", launch-bound stand-in (tiny shapes"
             + (", the watch's device path)" if simulate else ")") if args.launch_bound else ""))
    header = f"{'model':6} {'plain ms':>9} " + " ".join(f"{k:>15}" for k in only if k != "plain")
    print(header)
    mlp_step = None
    for name in args.models.split(","):
        if args.compile:
            torch._dynamo.reset()
            dynamo_utils.counters.clear()
        core.simulate_device(simulate)
        try:
            med = measure(name, args.device, reps[name], steps_per_rep=per[name], only=only,
                          compiled=args.compile)
        finally:
            core.simulate_device(False)
        base = med["plain"]
        cells = " ".join(f"{med[k] / base:>14.2f}x" for k in only if k != "plain")
        print(f"{name:6} {base * 1e3:>9.2f} {cells}", flush=True)
        if args.launch_bound:
            # what a step adds in host time: on a launch-bound GPU step the same Python
            # runs, beside a plain step whose ops each cost a launch more than here
            added = ", ".join(f"{k} {(med[k] - base) * 1e6:+.0f}" for k in only
                              if k not in ("plain", "plain2"))
            print(f"{name:6} host time a step, us: plain {base * 1e6:.0f}; added: {added}",
                  flush=True)
        if args.compile:
            c = dynamo_utils.counters
            print(f"{name:6} dynamo: {sum(c['graph_break'].values())} graph breaks, "
                  f"{c['stats']['unique_graphs']} graphs compiled in all variants", flush=True)
        if name == "mlp":
            mlp_step = base
    if not args.compile:
        for name in args.models.split(","):
            print(count_ops(name, args.device), flush=True)
            if args.device == "cpu":
                print(count_ops(name, "cpu", simulate_device=True), flush=True)
    if mlp_step is not None and not args.launch_bound:
        extra, ops = data_index_cost(20 if args.quick else 60)
        print(f"data index bookkeeping (DataLoader, batch 64x784): {extra * 1e6:+.1f} us a "
              f"batch = {100 * extra / mlp_step:+.2f}% of the mlp step; {ops:+.0f} tensor "
              "ops a batch", flush=True)
    if args.device.startswith("cuda"):
        for name in args.models.split(","):
            print(f"{name}: syncs per step {count_syncs(name, args.device)}", flush=True)


if __name__ == "__main__":
    main()
