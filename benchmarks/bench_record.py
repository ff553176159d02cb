"""Cost of `mldebug.record()` and of the CLI's step history, as ratios to the plain step.

    python benchmarks/bench_record.py [--quick] [--models mlp,cnn,gpt] [--device cpu|cuda]
                                      [--batch-scale N]

One process; for each model the variants run interleaved, repetition after repetition,
each on its own copy of the model (same weights), and the median step time of each is
printed as a ratio to plain. A step is zero_grad + forward + backward + optimizer step
(the MLP, ResNet-18-like CNN and, with --models, the GPT of bench_watch.py).

    plain2          a second plain copy: the noise floor of the measurement
    record@1        all four logs (io, io_grad, params, params_grad), every step
    record@100:off  every=100, the steps that are not recorded (median step)
    record:never    a recorder that never records (`every=lambda s: False`): the steady
                    cost of unrecorded steps (record@100:off are the 3rd..8th steps after
                    a recorded one, which still feel its allocations)
    record@100      every=100 amortized: (recorded + 99 unrecorded) / 100
    history         the CLI's default history (with the graph capture the CLI runs),
                    against the graph capture alone ("capture")
    record@1>tb, record@100>tb (with --to tensorboard; >wandb with --to wandb)
                    record@1 and record@100 with a live copy (`to=`) into a TensorBoard
                    event file in a temporary folder, or into an offline W&B run: the
                    copy is made on the mirror's own thread, beside these steps
    texp@1, texp@100:off, texp@100
                    torchexplorer.watch(log=all four, log_freq=1 / 100, backend='none'),
                    when installed. Its graphviz layout needs the `dot` program and its
                    imports wandb and loguru: missing ones are replaced by stubs and the
                    layout by a no-op, so what is measured is its hooks and histograms
                    (the peer's real cost is higher). Its backward hooks refuse in-place
                    ops, so its model copy runs with `disable_inplace=True` (its own
                    option; the ReLUs then allocate) and without io_grad of BatchNorm
                    layers (`ignore_io_grad_classes`: the block's `out += identity` writes
                    into the BatchNorm output). Skipped with a message when missing or
                    when it fails on a model.

Then, for each model, the counts that do not depend on the machine: the aten ops and host
reads of a plain step, a recorded one and one `every=100` does not record; on the CPU also
those of the recorder's device (GPU) path, run on the CPU: there each op is a launch.
"""
from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
import types

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_watch import BATCH_SCALE, MODELS, step, sync  # noqa: E402
from opcount import count_calls, count_step, settled  # noqa: E402

import mldebug  # noqa: E402
from mldebug.graph import Capture  # noqa: E402
from mldebug.record import block_graphs  # noqa: E402
from mldebug.record.history import History  # noqa: E402

LOGS = ("io", "io_grad", "params", "params_grad")
CLOCK = [time.perf_counter]   # --clock cpu: time.process_time (all threads of the process)
TO = [None]                   # --to: the live copy's target kind


def load_torchexplorer():
    """torchexplorer.watch, or None with the reason."""
    for name in ("wandb", "loguru"):
        try:
            __import__(name)
        except ImportError:
            stub = types.ModuleType(name)
            if name == "wandb":
                stub.run = None
            else:
                class _Logger:
                    def __getattr__(self, _):
                        return lambda *a, **k: self
                stub.logger = _Logger()
            sys.modules[name] = stub
    try:
        import torchexplorer
        from torchexplorer.api import api
    except Exception as exc:  # noqa: BLE001
        return None, f"{type(exc).__name__}: {exc}"
    api.layout.layout = lambda structure, cache=None, *a, **k: (None, cache)
    return torchexplorer.watch, ""


class Variant:
    """A model copy with something attached; `steps(n)` returns per-step times."""

    def __init__(self, name, make, device, attach):
        self.name = name
        torch.manual_seed(0)     # every copy: the same weights, data and optimizer
        self.model, self.loss_fn, self.opt = make()
        self.device = device
        self.attach = attach
        self.handle = None
        self.count = 0          # steps run on this copy so far

    def steps(self, n):
        """[(index of the step on this copy, seconds)] for N steps."""
        times = []
        with self.attach(self) as h:
            self.handle = h
            for _ in range(n):
                sync(self.device)
                t0 = CLOCK[0]()
                step(self.model, self.loss_fn, self.opt)
                sync(self.device)
                times.append((self.count, CLOCK[0]() - t0))
                self.count += 1
        return times


class _Null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


EAGER = "bench_record.py: record@1:eager"


def _short(target: str) -> str:
    return {"tensorboard": "tb"}.get(target, target)


def make_variants(make, device, run_dir, texp):
    def rec(every):
        return lambda v: mldebug.record(v.model, log=LOGS, every=every, run_dir=run_dir,
                                        run=f"bench-{every}")

    class CaptureOnly:
        def __init__(self, v):
            self.c = Capture()

        def __enter__(self):
            self.c.start()

        def __exit__(self, *exc):
            self.c.close()

    class CaptureHistory(CaptureOnly):
        def __init__(self, v):
            super().__init__(v)
            self.h = v.__dict__.setdefault("_history", History())  # keeps its stride

        def __enter__(self):
            self.c.start()
            self.h.start()

        def __exit__(self, *exc):
            self.h.close()
            self.c.close()

    class OneOpAtATime:
        """record@1 with the blocks' reductions one op at a time, not a CUDA graph
        (`mldebug/record/block_graphs.py`): what the graphs save, side by side."""
        def __init__(self, v):
            self.rec = rec(1)(v)

        def __enter__(self):
            self.was = block_graphs.GRAPHS.off
            if self.was is None:
                block_graphs.GRAPHS.off = EAGER
            return self.rec.__enter__()

        def __exit__(self, *exc):
            try:
                return self.rec.__exit__(*exc)
            finally:
                if block_graphs.GRAPHS.off == EAGER:
                    block_graphs.GRAPHS.off = self.was

    variants = {
        "plain": lambda v: _Null(),
        "plain2": lambda v: _Null(),   # a second plain copy: the noise floor
        "record@1": rec(1),
        "record@100": rec(100),
        "record:never": lambda v: mldebug.record(v.model, log=LOGS, run_dir=run_dir,
                                                 run="bench-never", every=lambda s: False),
        "capture": CaptureOnly,
        "history": CaptureHistory,
    }
    if torch.device(device).type == "cuda":
        variants["record@1:eager"] = OneOpAtATime
    if TO[0] is not None:
        def mirrored(every):
            to = ("tensorboard", os.path.join(run_dir, "tb")) if TO[0] == "tensorboard" else "wandb"
            return lambda v: mldebug.record(v.model, log=LOGS, every=every, run_dir=run_dir,
                                            run=f"bench-{every}-to", to=to)
        variants[f"record@1>{_short(TO[0])}"] = mirrored(1)
        variants[f"record@100>{_short(TO[0])}"] = mirrored(100)
    if texp is not None:
        def peer(freq):
            def attach(v):
                if not getattr(v, "_watched", False):
                    # its full backward hooks refuse in-place ops: ReLU(inplace) is
                    # switched off (its own option), BatchNorm's io_grad skipped (the
                    # ResNet block adds into the BatchNorm output in place)
                    texp(v.model, log=list(LOGS), log_freq=freq, backend="none",
                         disable_inplace=True,
                         ignore_io_grad_classes=[torch.nn.BatchNorm2d])
                    v._watched = True
                return _Null()
            return attach
        variants["texp@1"] = peer(1)
        variants["texp@100"] = peer(100)
    return {k: Variant(k, make, device, a) for k, a in variants.items()}


def count_ops(name, device, run_dir, simulate_device=False):
    """The aten ops and host reads of one step, plain and recorded with all four logs
    (every=1), and of a step `every=100` does not record: machine-independent counts
    (benchmarks/opcount.py) beside the ratios. SIMULATE_DEVICE: the recorder's device
    (GPU) path, run on the CPU (`record.stats.simulate_device`)."""
    from mldebug.record import stats
    out = {}
    kinds = [("plain", None), ("record@1", 1), ("record@100:off", 100)]
    if torch.device(device).type == "cuda":
        kinds.insert(2, ("record@1:eager", 1))
    for k, every in kinds:
        was = block_graphs.GRAPHS.off
        if k.endswith(":eager") and was is None:
            block_graphs.GRAPHS.off = EAGER
        torch.manual_seed(0)
        model, loss_fn, opt = MODELS[name](device)
        rec = None if every is None else mldebug.record(
            model, log=LOGS, every=every, run_dir=run_dir, run=f"count-{name}-{every}")
        stats.simulate_device(simulate_device)
        try:
            # record@100:off: steps 1.. of a recorder whose step 0 was recorded in warm-up;
            # record@1: a step once the first recorded steps have learned what to hold and
            # the blocks' sizes have settled (a new layout's indices are made once)
            settle = settled(rec) if rec is not None else None
            ops, reads = count_step(lambda: step(model, loss_fn, opt), warmup=6, settle=settle)
            calls = count_calls(lambda: step(model, loss_fn, opt), warmup=1, settle=settle)
        finally:
            stats.simulate_device(False)
            if rec is not None:
                rec.close()
            if block_graphs.GRAPHS.off == EAGER:
                block_graphs.GRAPHS.off = was
        out[k] = (sum(ops.values()), reads, calls)
    n0, r0, c0 = out["plain"]
    label = "device path on the cpu" if simulate_device else device
    return f"{name:6} ops a step ({label}): plain {n0} (python calls {c0}), " + ", ".join(
        f"{k} {n} ({n - n0:+d}, reads {r - r0:+d}, python calls {c - c0:+d})"
        for k, (n, r, c) in out.items() if k != "plain")


def measure(name, device, reps, per, run_dir, texp):
    vs = make_variants(lambda: MODELS[name](device), device, run_dir, texp)
    for k, v in list(vs.items()):               # warm-up
        try:
            v.steps(2)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run this model
            if not k.startswith("texp"):
                raise
            print(f"{name}: {k} failed ({type(exc).__name__}: {str(exc)[:120]}); left out")
            del vs[k]
    times = {k: [] for k in vs}
    order = random.Random(0)
    for _ in range(reps):
        # a new order every repetition: no variant always runs right after the heaviest
        for k in order.sample(list(vs), len(vs)):
            v = vs[k]
            t = v.steps(per)
            if k.startswith("record@100"):
                # a new recorder each block: its step 0 is recorded; the two steps after
                # it share the machine with its write and are left out of ':off'
                times.setdefault(k + ":rec", []).append(t[0][1])
                times.setdefault(k + ":off", []).extend(x for _, x in t[3:])
            elif k.endswith("@100"):
                # the peer counts steps on its model copy: every 100th is recorded
                for i, x in t:
                    times.setdefault(k + (":rec" if i % 100 == 0 else ":off"), []).append(x)
            else:
                times[k] += [x for _, x in t]
    med = {k: statistics.median(v) for k, v in times.items() if v}
    for k in list(med):
        if k.endswith(":rec"):
            base_k = k[:-4]
            med[base_k] = (med[k] + 99 * med[base_k + ":off"]) / 100
    for k in ("texp@100", "record@100"):     # no recorded step among the timed ones
        if k not in med and k + ":off" in med and k.replace("100", "1") in med:
            med[k] = (med[k.replace("100", "1")] + 99 * med[k + ":off"]) / 100
    return med


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    parser.add_argument("--models", default="mlp,cnn")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=0, help="torch.set_num_threads")
    parser.add_argument("--to", choices=("tensorboard", "wandb"),
                        help="also time record@1 and record@100 with a live copy (to=) into "
                             "TensorBoard, or into W&B (offline, under a temporary folder)")
    parser.add_argument("--batch-scale", type=int, default=1,
                        help="multiply every model's batch (bench_watch.py's models)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="wall: perf_counter; cpu: process CPU time of all threads (less "
                             "sensitive to other processes on a shared machine; use with "
                             "--threads 1, as idle intra-op threads spin)")
    args = parser.parse_args(argv)
    if args.batch_scale < 1:
        parser.error(f"--batch-scale must be 1 or more, got {args.batch_scale}")
    BATCH_SCALE[0] = args.batch_scale
    if args.clock == "cpu":
        CLOCK[0] = time.process_time
    if args.threads:
        torch.set_num_threads(args.threads)
    TO[0] = args.to
    texp, why = load_torchexplorer()
    reps = {"mlp": 80, "cnn": 10, "gpt": 6} if not args.quick else {"mlp": 30, "cnn": 4,
                                                                     "gpt": 3}
    per = {"mlp": 8, "cnn": 5, "gpt": 4}   # (:off leaves out the first three)
    load = os.getloadavg()
    print(f"torch {torch.__version__}, device {args.device}, threads {torch.get_num_threads()}, "
          f"{'quick' if args.quick else 'full'}, batch x{args.batch_scale}, clock {args.clock}, load average {load[0]:.2f} {load[1]:.2f} "
          f"{load[2]:.2f} on {os.cpu_count()} cpus")
    if texp is None:
        print(f"torchexplorer: skipped ({why}); pip install torchexplorer --no-deps to compare")
    from mldebug.record import native, recorder
    kernel = "built" if native.kernel() else f"not used ({native.reason()})"
    committer = "writer thread" if recorder.spare_core() else "training thread"
    print(f"recorder: CPU kernel {kernel}; a CPU step is committed by the {committer}")
    cols = ["plain2", "record@1", "record@100:off", "record:never", "record@100", "capture", "history"]
    if torch.device(args.device).type == "cuda":
        cols.insert(2, "record@1:eager")
    if args.to is not None:
        cut = cols.index("record@100") + 1
        cols[cut:cut] = [f"record@1>{_short(args.to)}", f"record@100>{_short(args.to)}"]
    if texp is not None:
        cols += ["texp@1", "texp@100:off", "texp@100"]
    print(f"{'model':6} {'plain ms':>9} " + " ".join(f"{c:>14}" for c in cols)
          + f" {'history/capture':>16}")
    with tempfile.TemporaryDirectory() as run_dir:
        if args.to == "wandb":      # (offline, nothing printed, its files in the folder)
            os.environ.update(WANDB_MODE="offline", WANDB_SILENT="true", WANDB_DIR=run_dir)
        for name in args.models.split(","):
            med = measure(name, args.device, reps[name], per[name], run_dir, texp)
            base = med["plain"]
            cells = " ".join(f"{med[c] / base:>13.3f}x" if c in med else f"{'-':>14}"
                             for c in cols)
            print(f"{name:6} {base * 1e3:>9.2f} {cells} {med['history'] / med['capture']:>15.3f}x",
                  flush=True)
        for name in args.models.split(","):
            print(count_ops(name, args.device, run_dir), flush=True)
            if args.device == "cpu":
                print(count_ops(name, "cpu", run_dir, simulate_device=True), flush=True)
    g = block_graphs.GRAPHS
    print(f"block graphs (record/block_graphs.py): {g.captured} captured, {g.replays} "
          f"replays, {'in use' if g.off is None else 'off: ' + g.off}")
    load = os.getloadavg()
    print(f"load average after: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")


if __name__ == "__main__":
    main()
