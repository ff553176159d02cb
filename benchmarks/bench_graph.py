"""Cost of mldebug's always-on graph capture on a forward pass, as ratios to the plain pass.

    python benchmarks/bench_graph.py [--quick] [--models cnn,gpt] [--threads N] [--step]

One process; for each model the variants run interleaved within every repetition and the
median of the per-repetition ratios (variant time / plain time of the same repetition) is
printed. The pass is a training-mode forward under autograd (what the capture sees while
a program trains). Variants:
    plain        model(x)
    capture      mldebug's always-on module-level capture (graph.Capture: two global
                 module hooks, shapes/dtypes, weak references; summaries on demand)
    assertions   capture + the assertion runner with the default library (dead_relu
                 runs on the first call of each ReLU node and every 10th after)
    torchview    torchview.draw_graph(model, input_data=x) (default depth 3), when
                 torchview imports
Models (builders imported from bench_watch.py): ResNet-18-like CNN (batch 16, 3x64x64),
GPT-like transformer (6 layers, d=512, 8 heads, seq 128, batch 8).
Targets: capture <= 1.10x (CNN), <= 1.05x (transformer).
`--step` times whole training steps instead (plain, capture, assertions): what the CLI's
always-on capture and default assertions cost a training loop.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, HERE)
from bench_watch import MODELS  # noqa: E402

from mldebug import graph as _graph  # noqa: E402
from mldebug.assertions.scan import AlwaysOn  # noqa: E402

TARGETS = {"cnn": 1.10, "gpt": 1.05}


def _input(loss_fn):
    """The model input captured by bench_watch's loss closure ('x' or 'idx')."""
    cells = dict(zip(loss_fn.__code__.co_freevars, (c.cell_contents for c in loss_fn.__closure__)))
    return cells.get("x", cells.get("idx"))


class _Variant:
    def __init__(self, enter, run, exit_=None):
        self.enter, self.run, self.exit = enter, run, exit_


def variants(model, x):
    def plain():
        return model(x)

    state = {}

    def start_capture():
        state["c"] = _graph.Capture().start()

    def stop_capture():
        state.pop("c").close()

    def start_all():
        state["a"] = AlwaysOn(assertions=True)

    def stop_all():
        state.pop("a").close()

    out = {
        "plain": _Variant(lambda: None, plain),
        "capture": _Variant(start_capture, plain, stop_capture),
        "assertions": _Variant(start_all, plain, stop_all),
    }
    try:
        from torchview import draw_graph
    except Exception:  # noqa: BLE001 - optional peer
        draw_graph = None
    if draw_graph is not None:
        out["torchview"] = _Variant(lambda: None,
                                    lambda: draw_graph(model, input_data=x, device="cpu"))
    return out


def step_variants(model, loss_fn, opt):
    """--step: a whole training step (zero_grad, forward, backward, optimizer step)."""
    def step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        opt.step()

    state = {}
    return {
        "plain": _Variant(lambda: None, step),
        "capture": _Variant(lambda: state.__setitem__("c", _graph.Capture().start()), step,
                            lambda: state.pop("c").close()),
        "assertions": _Variant(lambda: state.__setitem__("a", AlwaysOn(assertions=True)),
                               step, lambda: state.pop("a").close()),
    }


def measure(name, reps, warmup=2, only=None, whole_step=False):
    torch.manual_seed(0)
    model, loss_fn, opt = MODELS[name]("cpu")
    model.train()
    x = _input(loss_fn)
    vs = step_variants(model, loss_fn, opt) if whole_step else variants(model, x)
    vs = {k: v for k, v in vs.items() if only is None or k in only}
    for v in vs.values():
        for _ in range(warmup):
            v.enter()
            try:
                v.run()
            finally:
                if v.exit:
                    v.exit()
    times = {k: [] for k in vs}
    for _ in range(reps):
        for k, v in vs.items():
            v.enter()
            try:
                t0 = time.perf_counter()
                v.run()
                times[k].append(time.perf_counter() - t0)
            finally:
                if v.exit:
                    v.exit()
    plain = times["plain"]
    ratios = {k: statistics.median(t / p for t, p in zip(ts, plain)) for k, ts in times.items()}
    return statistics.median(plain), ratios, {k: min(ts) / min(plain) for k, ts in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--models", default="cnn,gpt")
    parser.add_argument("--variants", default="plain,capture,assertions,torchview")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads")
    parser.add_argument("--step", action="store_true",
                        help="time whole training steps instead of forward passes "
                             "(variants plain, capture, assertions)")
    args = parser.parse_args(argv)
    if args.step:
        args.variants = ",".join(v for v in args.variants.split(",") if v != "torchview")
    if args.threads:
        torch.set_num_threads(args.threads)
    reps = {"cnn": 9, "gpt": 5} if args.quick else {"cnn": 31, "gpt": 15}
    only = args.variants.split(",")
    try:
        import torchview  # noqa: F401
        tv = "torchview " + getattr(torchview, "__version__", "(installed)")
    except Exception:  # noqa: BLE001
        tv = "torchview not importable: column left out (issue's figures: 1.26x CNN, 1.11x GPT)"
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"{'quick' if args.quick else 'full'}, "
          f"{'whole training step' if args.step else 'forward pass'}; {tv}")
    names = [k for k in only if k != "plain"]
    print(f"{'model':6} {'plain ms':>9} " + " ".join(f"{k:>12}" for k in names)
          + "   (median of per-rep ratios; min/min in brackets)")
    for name in args.models.split(","):
        base, ratios, mins = measure(name, reps[name], only=only, whole_step=args.step)
        cells = " ".join(f"{ratios[k]:>6.3f}x [{mins[k]:.3f}]" if k in ratios else f"{'-':>12}"
                         for k in names)
        target = TARGETS.get(name)
        verdict = ""
        if target is not None and "capture" in ratios and not args.step:
            verdict = f"  capture target <= {target:.2f}x: {'met' if ratios['capture'] <= target else 'NOT met'}"
        print(f"{name:6} {base * 1e3:>9.2f} {cells}{verdict}", flush=True)


if __name__ == "__main__":
    main()
