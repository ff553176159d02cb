"""Issue 22's budget on the CPU, counted, not timed: a healthy step under the watch
dispatches at most 10% more aten ops than the plain step and adds no host read, on the
three benchmark models (benchmarks/bench_watch.py: an MLP, a ResNet-18-like CNN, a
GPT-like transformer with AdamW), with full coverage: every module output, gradient and
optimizer result is still checked, by the C bit test (mldebug/watch/native_check.py),
which reads memory in place instead of dispatching a `sum` and an `item` per tensor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import mldebug
from mldebug.watch import native_check

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_watch  # noqa: E402
from opcount import count_step  # noqa: E402


def counts(name, watched, on_a_device=False):
    """(aten ops, host reads) of one healthy training step. ON_A_DEVICE: the watch takes
    its GPU path, the CPU standing in for the device (core.simulate_device)."""
    from mldebug.watch import core
    torch.manual_seed(0)
    model, loss_fn, opt = bench_watch.MODELS[name]("cpu")
    ctx = mldebug.watch(action="raise") if watched else bench_watch.Plain()
    core.simulate_device(on_a_device)
    try:
        with ctx:
            ops, reads = count_step(lambda: bench_watch.step(model, loss_fn, opt))
    finally:
        core.simulate_device(False)
    return sum(ops.values()), reads


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_the_watch_adds_at_most_a_tenth_of_the_steps_ops_and_no_host_read(name):
    if native_check.reason():
        pytest.skip(f"the C check is not built here: {native_check.reason()}")
    plain_ops, plain_reads = counts(name, watched=False)
    ops, reads = counts(name, watched=True)
    assert ops - plain_ops <= 0.10 * plain_ops, (name, plain_ops, ops)
    assert reads == plain_reads, (name, plain_reads, reads)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_on_a_device_a_step_adds_at_most_a_tenth_of_its_ops_and_one_host_read(name):
    """On a GPU every op is a launch and every read a sync: the step's checks wait in the
    ledger (watch/step_ledger.py) and are reduced by one `_foreach_norm` per dtype, one
    stack, one amax and read once, at `opt.step()` (the MLP's whole budget is 4 ops)."""
    plain_ops, plain_reads = counts(name, watched=False)
    ops, reads = counts(name, watched=True, on_a_device=True)
    assert ops - plain_ops <= 0.10 * plain_ops, (name, plain_ops, ops)
    assert reads - plain_reads == 1, (name, plain_reads, reads)


def test_the_count_sees_the_torch_path_it_replaces(monkeypatch):
    """Without the kernel (no compiler, MLDEBUG_NATIVE=0) each checked tensor costs a sum
    and a read again: the count is what tells the two paths apart."""
    monkeypatch.setitem(native_check._state, "fns", {})
    plain_ops, plain_reads = counts("mlp", watched=False)
    ops, reads = counts("mlp", watched=True)
    assert reads > plain_reads and ops - plain_ops > 0.10 * plain_ops


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "permuted", "channels_last", "view"])
def test_the_c_check_finds_what_isfinite_finds(dtype, layout):
    if native_check.reason():
        pytest.skip(f"the C check is not built here: {native_check.reason()}")
    base = torch.randn(2, 3, 40, 50).to(dtype)
    shaped = {"contiguous": lambda t: t, "permuted": lambda t: t.permute(2, 0, 3, 1),
              "channels_last": lambda t: t.contiguous(memory_format=torch.channels_last),
              "view": lambda t: t[1]}[layout]
    assert native_check.nonfinite(shaped(base)) is False
    for bad in (float("nan"), float("inf"), float("-inf")):
        for at in ((0, 0, 0, 0), (1, 2, 39, 49), (1, 1, 20, 7)):
            t = base.clone()
            t[at] = bad
            expected = not bool(torch.isfinite(shaped(t)).all())
            assert native_check.nonfinite(shaped(t)) is expected, (bad, at)


def test_the_c_check_leaves_what_it_cannot_read_to_torch():
    strided = torch.randn(10, 10)[:, ::2]                # not one run of memory
    assert native_check.nonfinite(strided) is None
    assert native_check.nonfinite(torch.ones(3, dtype=torch.complex64)) is None
    freed = torch.ones(8)
    freed.untyped_storage().resize_(0)
    assert native_check.nonfinite(freed) is None


def forward_extra_ops_on_a_device(name):
    """Extra aten ops and host reads of one forward (the loss included) under the watch
    on the device path, the CPU standing in for a GPU (as the cpu-as-device tests do)."""
    from mldebug.watch import core
    out = []
    for watched in (False, True):
        torch.manual_seed(0)
        model, loss_fn, _ = bench_watch.MODELS[name]("cpu")
        core.simulate_device(watched)
        try:
            with (mldebug.watch(action="raise") if watched else bench_watch.Plain()), \
                    torch.no_grad():
                ops, reads = count_step(loss_fn)
        finally:
            core.simulate_device(False)
        out.append((sum(ops.values()), reads))
    (plain, plain_reads), (ops, reads) = out
    return ops - plain, reads - plain_reads


def test_on_a_device_a_forward_is_checked_by_a_few_fused_launches():
    """On a GPU every op is a launch: a forward's extra ops do not grow with the number
    of modules (the MLP has 6, the CNN 60): the root's output and the loss are reduced
    by one `_foreach_norm` and read once; the CNN's one op more is the copy, as each call
    starts, of the buffers its calls write in place (BatchNorm's running statistics, one
    `_foreach_clone`), which a re-run starts from."""
    mlp, cnn = forward_extra_ops_on_a_device("mlp"), forward_extra_ops_on_a_device("cnn")
    assert cnn == (mlp[0] + 1, mlp[1]), (mlp, cnn)
    assert mlp[1] <= 1 and mlp[0] <= 6, mlp


# The Python calls one healthy step on the device path adds, all code (torch's too: the
# hooks mldebug installs make torch run more of its own), torch 2.13.0, on the plain
# step's 104 / 765 / 1259: the watch (its roots' hooks, backward, the step's read; no
# hook below a root) +132 / +143 / +140; the recorder with all four logs every step
# +385 / +3252 / +3216. On a GPU's launch-bound step the training thread's CPU time is
# the step's time, and what mldebug adds there is mostly these calls: a ceiling 15%
# above them catches a walk or a check put back on the hot path (a module hook per call
# was ~1,300 calls on the CNN; a tensor's Python `__hash__` per parameter, ~150 on a
# 12-layer GPT-2). (A capture left counted by an earlier test made every hook ask for
# one: ~10 calls a module call; conftest's `_no_capture_left_open` fails such a test.)
EXTRA_CALLS = {"mlp": (132, 385), "cnn": (143, 3252), "gpt": (140, 3216)}


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_on_a_device_the_python_calls_a_step_adds_stay_under_their_ceiling(name, tmp_path):
    from mldebug.record import stats
    from mldebug.watch import core
    from opcount import count_calls
    got = {}
    for part in ("plain", "watch", "record"):
        torch.manual_seed(0)
        model, loss_fn, opt = bench_watch.MODELS[name]("cpu")
        on = {"plain": bench_watch.Plain, "watch": lambda: mldebug.watch(action="raise"),
              "record": lambda: mldebug.record(model, run_dir=tmp_path, run=name)}[part]()
        simulate = stats.simulate_device if part == "record" else core.simulate_device
        simulate(part != "plain")
        try:
            with on:
                got[part] = count_calls(lambda: bench_watch.step(model, loss_fn, opt),
                                        warmup=6)
        finally:
            simulate(False)
    for part, measured in zip(("watch", "record"), EXTRA_CALLS[name]):
        extra = got[part] - got["plain"]
        assert 0 < extra <= 1.15 * measured, (name, part, extra, measured)


def gpt2(layers):
    """transformers' GPT-2 language model from a config (no download): n_embd 32, 2 heads,
    a vocabulary of 100, 16 positions; the loss computed inside (labels), AdamW."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=100,
                                     n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    idx = torch.randint(0, 100, (2, 16))
    return model, (lambda: model(idx, labels=idx).loss), torch.optim.AdamW(
        model.parameters(), lr=1e-4)


def extra_calls(make, device_path=True):
    """Python calls (all code, torch's too) one healthy step adds to the same step
    without mldebug, on the device path or the CPU's: the median of three steps."""
    import statistics
    from mldebug.watch import core
    from opcount import count_calls
    got = {}
    for watched in (False, True):
        model, loss_fn, opt = make()
        core.simulate_device(watched and device_path)
        try:
            with mldebug.watch(action="raise") if watched else bench_watch.Plain():
                got[watched] = statistics.median(
                    count_calls(lambda: bench_watch.step(model, loss_fn, opt), warmup=w)
                    for w in (6, 1, 1))
        finally:
            core.simulate_device(False)
    return got[True] - got[False]


@pytest.mark.parametrize("device_path", [True, False], ids=["device-path", "cpu"])
def test_the_python_a_step_adds_does_not_grow_with_the_models_depth(device_path):
    """On a GPU's launch-bound step the host's Python is the watch's cost: with hooks
    on the roots only (not on every module) and every check a few multi-tensor ops, a
    12-layer GPT-2 (164 modules, 148 parameters) adds about what a 2-layer one (34, 28)
    does: 118 calls each on the device path, torch 2.13.0. On the CPU each tensor's C
    check runs in one loop of mldebug's (checks.host_bad), not a call or four each:
    92 calls each."""
    two = extra_calls(lambda: gpt2(2), device_path)
    twelve = extra_calls(lambda: gpt2(12), device_path)
    assert 0 < two <= 400 and 0 < twelve <= 400, (two, twelve)
    assert twelve <= 1.25 * two, (two, twelve)


def test_on_a_device_an_op_outside_modules_costs_a_few_of_mldebugs_python_calls():
    """Outside module calls (the loss, data handling) every op passes the per-op check;
    on a GPU its outputs wait in the device window (device_window.py), and the training
    thread's CPU time is the step's time. The check's Python per op, mldebug's own code
    counted: the mode, the window, the ledger's hold, the provenance (and the window's
    reduction, shared by its ops): 6.0 calls for `x * 2` and 10.1 for `F.cross_entropy`
    (three ops), torch 2.13.0 (the window also notes each argument's memory and which
    ops cannot make a NaN/Inf)."""
    import os
    import torch.nn.functional as F
    from mldebug.watch import core
    from opcount import count_calls
    under = os.path.dirname(mldebug.__file__) + os.sep
    x = torch.randn(64, 10, requires_grad=True)
    y = torch.randint(0, 10, (64,))

    def many(op):
        return lambda: [op() for _ in range(100)]

    core.simulate_device(True)
    try:
        with mldebug.watch(action="raise") as w:
            mul = count_calls(many(lambda: x * 2), under=under, warmup=1) / 100
            loss = count_calls(many(lambda: F.cross_entropy(x, y)), under=under,
                               warmup=1) / 100
            assert not w.violations
    finally:
        core.simulate_device(False)
    assert 2 <= mul <= 6.5 and 6 <= loss <= 16, (mul, loss)


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt"])
def test_the_launch_bound_stand_in_is_the_same_step_with_tiny_tensors(name, monkeypatch):
    """`bench_watch.py --launch-bound` times the benchmark models with tiny shapes on the
    CPU, where a step's time is its host work, as on a launch-bound GPU step: it stands
    in for them only if it runs the same step, op for op, plain and watched on the device
    path (the figures in benchmarks/README.md, watch, lean on that)."""
    full = counts(name, watched=False), counts(name, watched=True, on_a_device=True)
    monkeypatch.setattr(bench_watch, "TINY", [True])
    tiny = counts(name, watched=False), counts(name, watched=True, on_a_device=True)
    assert tiny[0] == full[0], (name, full, tiny)
    # (watched, the ledger reduces what it holds every 64 MiB too, which the full-size
    # temporaries reach sooner: a few more `_foreach_norm`s there; the one read is the same)
    assert tiny[1][1] == full[1][1] and 0 <= full[1][0] - tiny[1][0] <= 3, (name, full, tiny)
