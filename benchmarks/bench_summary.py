"""Time what `inspect` costs on a float32 tensor: mldebug.summary(x) + str(), against
lovely-tensors and a plain min/max/mean/std/isnan/isinf sequence.

    python benchmarks/bench_summary.py [--quick] [--reps N]

One process; the three contenders are interleaved within each repetition and the median is
reported, so that drifting machine load hits them alike. --quick stops at 10^6 elements.
"""
from __future__ import annotations

import argparse
import gc
import importlib
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
S = importlib.import_module("mldebug.summaries")

try:
    import lovely_tensors as lt
except ImportError:  # the table then shows '-' for lovely
    lt = None


def mldebug_inspect(x):
    return str(S.summary(x))


def lovely(x):
    return str(lt.lovely(x))


def plain(x):
    return [x.min().item(), x.max().item(), x.mean().item(), x.std().item(),
            x.isnan().sum().item(), x.isinf().sum().item()]


def median_ms(fns, x, reps):
    """Median ms per function, repetitions interleaved (one warm-up round first)."""
    times = {f: [] for f in fns}
    for rep in range(reps + 1):
        for f in fns:
            gc.collect()
            t0 = time.perf_counter()
            f(x)
            dt = time.perf_counter() - t0
            if rep:
                times[f].append(dt)
    return [statistics.median(times[f]) * 1e3 for f in fns]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="stop at 10^6 elements")
    ap.add_argument("--reps", type=int, default=0, help="repetitions (default: by size)")
    args = ap.parse_args(argv)
    exps = range(3, 7) if args.quick else range(3, 9)
    fns = [mldebug_inspect, plain] + ([lovely] if lt else [])
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"lovely-tensors {getattr(lt, '__version__', '-')}")
    head = f"{'case':<14}{'mldebug ms':>12}{'lovely ms':>12}{'plain ms':>12}" \
           f"{'mld/lovely':>12}{'mld/plain':>11}"
    print(head)
    print("-" * len(head))
    g = torch.Generator().manual_seed(0)
    cases = [(f"1e{e}", e, False) for e in exps]
    cases += [(f"1e{e} NaN", e, True) for e in (6, 8) if e <= max(exps)]
    for label, e, with_nan in cases:
        x = torch.randn(10 ** e, generator=g)
        if with_nan:
            x[::1000] = math.nan  # 0.1% NaN: the exact counting path
        reps = args.reps or (21 if e <= 6 else 7 if e == 7 else 5)
        got = dict(zip(fns, median_ms(fns, x, reps)))
        m, p, lo = got[mldebug_inspect], got[plain], got.get(lovely, math.nan)
        print(f"{label:<14}{m:>12.3f}{lo:>12.3f}{p:>12.3f}{m / lo:>12.3f}{m / p:>11.3f}",
              flush=True)
        del x
    print(f"\nexample: {mldebug_inspect(torch.randn(3, 196, 196, generator=g))}")


if __name__ == "__main__":
    main()
