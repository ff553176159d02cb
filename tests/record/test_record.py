"""mldebug.record: what is stored is what torch computes; the store survives a kill;
recording never changes training; hooks come off; bad input is a clear error."""
from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.core.errors import UsageError
from mldebug.record import Capture, native, open_run
from mldebug.record.timeline import compare, timeline

from conftest import clean_env, run_cli

def _without_kernel(monkeypatch):
    """The CPU's torch and numpy path, as on a machine without a C compiler."""
    monkeypatch.setattr(native, "_STATE", {"kernel": None, "reason": "the test's torch path"})


@pytest.fixture(params=["kernel", "torch"])
def cpu_path(request, monkeypatch):
    """Both ways the CPU's tensors are reduced: the one-pass kernel (`fused.c`; the test
    environment has a C compiler) and the torch / numpy path used without one."""
    if request.param == "kernel":
        assert native.kernel() is not None, native.reason()
    else:
        _without_kernel(monkeypatch)
    return request.param


@pytest.fixture
def torch_path(monkeypatch):
    _without_kernel(monkeypatch)


def make_mlp(seed=0, device="cpu"):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)).to(device)


def batches(n, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(5, 8, generator=g).to(device),
             torch.randint(0, 3, (5,), generator=g).to(device)) for _ in range(n)]


def train(model, data, lr=0.1, each=None):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        if each is not None:
            each(i, loss)
        opt.step()
        mldebug.log_scalar("loss", loss)
    return model


def _close(a, b, rel=1e-5):
    return a == pytest.approx(b, rel=rel, abs=1e-6)


def check_row(row, t):
    """A stored stats row against torch's own numbers for tensor T."""
    t = t.detach().cpu().double().flatten()
    assert row["numel"] == t.numel()
    assert _close(row["mean"], t.mean().item())
    assert _close(row["abs_mean"], t.abs().mean().item())
    assert _close(row["std"], t.std().item(), rel=1e-4)
    assert _close(row["abs_max"], t.abs().max().item())
    assert _close(row["min"], t.min().item())
    assert _close(row["max"], t.max().item())
    assert row["nan"] == row["posinf"] == row["neginf"] == 0


def test_recorded_stats_match_torch(tmp_path, device, cpu_path):
    model = make_mlp(device=device)
    data = batches(4, device=device)
    expected = {}
    outs = {}

    def keep(module, args, out):       # the test's own reference, not mldebug's
        out.retain_grad()
        outs["h"] = out

    model[0].register_forward_hook(keep)

    def each(i, loss):
        expected[i] = {"h": outs["h"].detach().clone(), "h_grad": outs["h"].grad.clone(),
                       "w": model[2].weight.detach().clone(),
                       "w_grad": model[2].weight.grad.clone()}

    with mldebug.record(model, run_dir=tmp_path, run="base") as rec:
        train(model, data, each=each)
    assert rec.closed and rec.path == str(tmp_path / "base.sqlite")

    with open_run(rec.path) as run:
        assert run.steps() == [0, 1, 2, 3]
        assert run.status == "closed"
        for i in range(4):
            e = expected[i]
            check_row(run.stats("0:output[0]", steps=[i])[0], e["h"])
            check_row(run.stats("0:output_grad[0]", steps=[i])[0], e["h_grad"])
            check_row(run.stats("2.weight:param", steps=[i])[0], e["w"])
            check_row(run.stats("2.weight:param_grad", steps=[i])[0], e["w_grad"])
            # per-sample gradient norms of the output
            norms = run.norms("0:output_grad[0]", i)
            np.testing.assert_allclose(norms, e["h_grad"].norm(dim=1).cpu().numpy(), rtol=1e-5)
            # the histogram of a small tensor counts every value over [min, max]
            h = [x for x in run.histograms("0:output[0]") if x["step"] == i][0]
            assert h["sample_n"] == 80 and sum(h["counts"]) + h["below"] + h["above"] == 80
            ref, _ = np.histogram(e["h"].cpu().double().numpy(), bins=30, range=(h["lo"], h["hi"]))
            assert np.abs(ref - np.array(h["counts"])).sum() <= 2
        # the loss logged after optimizer.step() belongs to the step that just ended
        assert [s for s, _ in run.scalars()["loss"]] == [0, 1, 2, 3]
        kinds = {s["kind"] for s in run.series()}
        assert kinds == {"input", "output", "input_grad", "output_grad", "param", "param_grad"}


def test_every_records_only_those_steps_and_unrecorded_steps_have_no_module_hooks(tmp_path):
    model = make_mlp()
    seen = []

    def each(i, loss):
        seen.append((i, len(model[0]._forward_hooks)))

    with mldebug.record(model, run_dir=tmp_path, run="r", every=3):
        train(model, batches(7), each=each)
    assert seen == [(0, 1), (1, 0), (2, 0), (3, 1), (4, 0), (5, 0), (6, 1)]
    with open_run(tmp_path / "r.sqlite") as run:
        assert run.steps() == [0, 3, 6]
        # KPIs are kept for every step, recorded or not
        assert [s for s, _ in run.scalars("loss")["loss"]] == list(range(7))


def test_recording_never_changes_training(tmp_path, device):
    plain = train(make_mlp(device=device), batches(6, device=device))
    model = make_mlp(device=device)
    with mldebug.record(model, run_dir=tmp_path, run="r",
                        capture=[Capture("0", "output"), Capture("2", "input_grad", "sum")]):
        train(model, batches(6, device=device))
    for a, b in zip(plain.parameters(), model.parameters()):
        assert torch.equal(a, b)


def _hook_counts(model):
    from torch.optim import optimizer as o
    return ([(len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
             for m in model.modules()],
            len(o._global_optimizer_pre_hooks), len(o._global_optimizer_post_hooks))


def test_close_removes_every_hook_also_on_exception(tmp_path):
    model = make_mlp()
    before = _hook_counts(model)
    with pytest.raises(RuntimeError, match="boom"):
        with mldebug.record(model, run_dir=tmp_path, run="r",
                            capture=Capture(nn.Linear, "pre_input")) as rec:
            model(torch.randn(2, 8)).sum().backward()
            assert _hook_counts(model) != before
            raise RuntimeError("boom")
    assert _hook_counts(model) == before
    assert mldebug.record.active_recorder() is None
    rec.close()  # idempotent
    with open_run(rec.path) as run:
        assert run.status == "closed"
        assert run.steps() == [0]          # the step in progress was written at close


def test_captures_store_full_tensors_with_reductions(tmp_path, device):
    model = make_mlp(device=device)
    x1, x2 = torch.randn(5, 8, device=device), torch.randn(5, 8, device=device)
    outs, grads = [], []
    def keep(module, args, out):
        outs.append(out.detach().clone())
        out.register_hook(grads.append)

    model[0].register_forward_hook(keep)
    with mldebug.record(model, run_dir=tmp_path, run="c", log=(), step="manual", capture=[
            Capture("0", "output"), Capture("0", "output", reduction="sum"),
            Capture("0", "output_grad", reduction="max"),
            Capture(["0"], "pre_input", reduction=lambda acc, new: torch.cat([acc, new]))]) as rec:
        (model(x1).sum() + model(x2).sum()).backward()
        rec.step()
    with open_run(rec.path) as run:
        caps = {(c["key"], c["reduction"], c["call"]): c["array"] for c in run.captures()}
    np.testing.assert_array_equal(caps[("0:capture_output[0]", "none", 0)], outs[0].cpu().numpy())
    np.testing.assert_array_equal(caps[("0:capture_output[0]", "none", 1)], outs[1].cpu().numpy())
    np.testing.assert_allclose(caps[("0:capture_output[0]", "sum", 0)],
                               (outs[0] + outs[1]).cpu().numpy(), rtol=1e-6)
    np.testing.assert_array_equal(caps[("0:capture_output_grad[0]", "max", 0)],
                                  torch.maximum(grads[0], grads[1]).cpu().numpy())
    np.testing.assert_array_equal(caps[("0:capture_pre_input[0]", "<lambda>", 0)],
                                  torch.cat([x1, x2]).cpu().numpy())


def test_module_selection_and_condition(tmp_path):
    model = make_mlp()
    calls = []

    def condition(module, inputs, output):
        calls.append(type(module).__name__)
        return True

    with mldebug.record(model, run_dir=tmp_path, run="s", modules=nn.Linear, log=("io",),
                        condition=condition) as rec:
        train(model, batches(1))
    with open_run(rec.path) as run:
        assert {s["module"] for s in run.series()} == {"0", "2"}
    assert calls == ["Linear", "Linear"]
    with mldebug.record(model, run_dir=tmp_path, run="c", children=[1], log=("io",)) as rec:
        train(model, batches(1))
    with open_run(rec.path) as run:
        assert {s["module"] for s in run.series()} == {"1"}


def test_named_tensors_notes_and_nonfinite_counts(tmp_path, cpu_path):
    t = torch.tensor([1.0, -3.0, float("nan"), float("inf"), float("-inf"), float("nan"), 2.0])
    with mldebug.record(None, run_dir=tmp_path, run="n", step="manual", note="first try") as rec:
        mldebug.log_tensor("attn", t, role="helper")
        mldebug.log_note("lr halved")
        mldebug.log_scalar("acc", 0.5)
        rec.step()
    with open_run(rec.path) as run:
        row = run.stats("attn:tensor")[0]
        assert (row["nan"], row["posinf"], row["neginf"], row["numel"]) == (2, 1, 1, 7)
        assert row["min"] == -3.0 and row["max"] == 2.0 and row["abs_max"] == 3.0
        assert row["mean"] == pytest.approx(0.0) and row["abs_mean"] == pytest.approx(2.0)
        assert run.series()[0]["role"] == "helper"
        assert run.notes() == [(0, "first try"), (0, "lr halved")]
        assert run.scalars() == {"acc": [(0, 0.5)]}
        assert run.meta["note"] == "first try"


def test_bad_input_is_a_clear_error(tmp_path):
    model = make_mlp()
    with pytest.raises(UsageError, match="'bogus'"):
        mldebug.record(model, log=("io", "bogus"), run_dir=tmp_path)
    with pytest.raises(UsageError, match="every"):
        mldebug.record(model, every=0, run_dir=tmp_path)
    with pytest.raises(UsageError, match="matched no module"):
        mldebug.record(model, modules="encoder.*", run_dir=tmp_path)
    with pytest.raises(UsageError, match="out of range"):
        mldebug.record(model, children=[7], run_dir=tmp_path)
    with pytest.raises(UsageError, match="what must be one of"):
        Capture("0", what="outputs")
    with pytest.raises(ValueError, match="run name"):
        mldebug.record(model, run="a/b", run_dir=tmp_path)
    with mldebug.record(model, run_dir=tmp_path, run="ok"):
        with pytest.raises(UsageError, match="is recording"):
            mldebug.record(model, run_dir=tmp_path, run="other")
        with pytest.raises(UsageError, match="must be a number"):
            mldebug.log_scalar("loss", "high")
        with pytest.raises(UsageError, match="torch.Tensor"):
            mldebug.log_tensor("x", [1.0])
    with pytest.raises(UsageError, match="exists"):
        mldebug.record(model, run_dir=tmp_path, run="ok", if_exists="error")
    rec = mldebug.record(model, run_dir=tmp_path, run="ok", if_exists="new")
    rec.close()
    assert rec.run == "ok-2"


def test_a_failing_store_warns_and_training_goes_on(tmp_path):
    model = make_mlp()
    with pytest.warns(RuntimeWarning, match="recording stops, the program goes on"):
        with mldebug.record(model, run_dir=tmp_path, run="f") as rec:
            rec._writer.flush()
            rec._writer._db.close()            # the disk goes away under the recorder
            train(model, batches(3))
    plain = train(make_mlp(), batches(3))
    assert all(torch.equal(a, b) for a, b in zip(plain.parameters(), model.parameters()))


def test_two_runs_compare_in_a_json_timeline(tmp_path):
    for name, lr in (("baseline", 0.01), ("hot", 5.0)):
        with mldebug.record(make_mlp(), run_dir=tmp_path, run=name, modules="2"):
            pass
        model = make_mlp()
        with mldebug.record(model, run_dir=tmp_path, run=name, modules="2"):
            train(model, batches(5), lr=lr)
    both = compare((str(tmp_path), "baseline"), str(tmp_path / "hot.sqlite"), max_steps=3)
    json.dumps(both, allow_nan=False)
    a, b = both["runs"]
    assert (a["name"], b["name"]) == ("baseline", "hot")
    assert "2.weight:param" in both["common"] and both["scalars"] == ["loss"]
    wa = next(s for s in a["series"] if s["key"] == "2.weight:param")
    wb = next(s for s in b["series"] if s["key"] == "2.weight:param")
    assert wa["steps"] == [0, 2, 4] and len(wa["hist"]["counts"]) == 3
    assert len(wa["hist"]["counts"][0]) == 30
    # the hot run's weights moved much further from the same start
    assert wa["stats"]["abs_max"][0] == wb["stats"]["abs_max"][0]
    assert wb["stats"]["abs_max"][-1] > 2 * wa["stats"]["abs_max"][-1]
    assert len(b["scalars"]["loss"]["values"]) == 5
    only = timeline(str(tmp_path / "hot.sqlite"), kinds=["param_grad"])
    assert {s["kind"] for s in only["series"]} == {"param_grad"}


KILLED = """
import sys, torch, torch.nn as nn
import mldebug
from mldebug.record import recorder
# where a CPU step is committed: by this thread (torch's threads take every core) or by
# the writer thread (a core to spare), whatever this machine has
recorder.spare_core = lambda: sys.argv[2] == "writer-thread"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
rec = mldebug.record(model, run_dir=sys.argv[1], run="killed")
assert rec._commit_here == (sys.argv[2] == "training-thread")
step = 0
while True:
    opt.zero_grad()
    model(torch.randn(16, 32)).pow(2).mean().backward()
    opt.step()
    print(step, flush=True)
    step += 1
"""


@pytest.mark.parametrize("commit", ["training-thread", "writer-thread"])
def test_a_killed_recording_keeps_every_committed_step(tmp_path, write_program, commit):
    prog = write_program(KILLED)
    runs = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, str(prog), str(runs), commit],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=clean_env())
    try:
        last = -1
        deadline = time.time() + 90
        while last < 30 and time.time() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            last = int(line)
        assert last >= 30, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    path = runs / "killed.sqlite"
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
    db.close()
    with open_run(path) as run:
        steps = run.steps()
        assert run.status == "recording"             # never closed
        assert steps == list(range(len(steps)))      # no gap
        assert len(steps) >= last - 1                # at most the last step or two lost
        for key in ("0:output[0]", "2.weight:param_grad"):
            assert [r["step"] for r in run.stats(key)] == steps
    result = run_cli(["runs", str(runs)])
    assert result.returncode == 0, result.stderr
    assert "killed" in result.stdout and "unclosed" in result.stdout
    assert f"{len(steps):>6}" in result.stdout


def test_runs_command_lists_runs_and_steps(tmp_path):
    result = run_cli(["runs", str(tmp_path / "missing")])
    assert result.returncode == 2
    assert "no such directory" in result.stderr and "Traceback" not in result.stderr
    result = run_cli(["runs", str(tmp_path)])
    assert result.returncode == 0
    assert "no runs in" in result.stdout
    result = run_cli(["runs"])
    assert result.returncode == 2 and "usage: python -m mldebug runs DIR" in result.stderr
    for name, n in (("a", 3), ("b", 5)):
        model = make_mlp()
        with mldebug.record(model, run_dir=tmp_path, run=name, every=2, note=f"run {name}"):
            train(model, batches(n))
    result = run_cli(["runs", str(tmp_path)])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == f"2 runs in {tmp_path}:"
    row_a = next(line for line in lines if line.strip().startswith("a "))
    row_b = next(line for line in lines if line.strip().startswith("b "))
    assert row_a.split()[1:5] == ["closed", "2", "0", "2"]
    assert row_b.split()[1:5] == ["closed", "3", "0", "4"]
    assert "note: run a" in result.stdout and "loss" in row_a


def test_a_program_that_forgets_close_still_writes_its_run(tmp_path, write_program):
    prog = write_program("""
        import sys, torch, torch.nn as nn, mldebug
        model = nn.Linear(4, 2)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        mldebug.record(model, run_dir=sys.argv[1], run="open")
        for _ in range(3):
            opt.zero_grad(); model(torch.randn(2, 4)).sum().backward(); opt.step()
            mldebug.log_scalar("loss", 1.0)
    """)
    result = subprocess.run([sys.executable, str(prog), str(tmp_path)], capture_output=True,
                            text=True, env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    with open_run(tmp_path / "open.sqlite") as run:
        assert run.status == "closed" and run.steps() == [0, 1, 2]
        assert len(run.scalars()["loss"]) == 3


def test_an_empty_batch_is_recorded_without_a_warning(tmp_path, cpu_path):
    """A step with no samples (an empty last batch): every tensor of the batch is empty,
    their gradients too; per-sample norms of none are none (this used to warn)."""
    import warnings
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mldebug.record(model, run_dir=tmp_path, run="empty") as rec:
            for x in (torch.randn(5, 8), torch.randn(0, 8)):
                opt.zero_grad()
                model(x).sum().backward()
                opt.step()
    with open_run(rec.path) as run:
        rows = run.stats("0:output[0]")
        assert [r["numel"] for r in rows] == [80, 0]
        grads = run.stats("0:output_grad[0]")
        assert [r["numel"] for r in grads] == [80, 0]


def test_the_device_batch_path_matches_torch_and_the_cpu_path():
    """A GPU step's small tensors are copied into blocks whose reductions are queued
    (`stage`) and read on the writer thread (`finish`); run here on the CPU, it must
    give what the CPU path (`hostbatch`, numpy) and torch give, NaN/Inf and padding
    included."""
    from mldebug.record.hostbatch import HostBatch, HostPool
    from mldebug.record.tensorbatch import BlockPool, TensorBatch
    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(5, 16, generator=g), torch.randn(3000, generator=g) * 1e3,
          torch.randn(7, 8, 9, generator=g), torch.tensor([1.0, float("nan"), 3.0, float("inf")]),
          torch.randn(2048, generator=g), torch.randn(1, generator=g).half(),
          -torch.rand(1500, generator=g) - 1]              # all negative: max is not 0 padding
    pool = BlockPool()

    def run(staged, roll_rows=0):
        # (a GPU's pool never holds a block above its cap: a fresh pool for the rolled run)
        b = (TensorBatch(pool if not roll_rows else BlockPool(), "cpu", 100, roll_rows)
             if staged else HostBatch(HostPool()))
        for i, t in enumerate(ts):
            b.add(i, t.reshape(-1), torch.float32, t.shape, 0 if t.dim() > 1 else None)
        rows, samples, norms = np.zeros((len(ts), 9)), {}, {}
        if staged:
            st = b.stage(100)
            st.finish([x.double().numpy().reshape(-1) for x in st.tensors], rows, samples, norms)
        else:
            b.reduce(rows, samples, norms, 100)
        return rows, samples, norms

    (host, host_s, host_n), (dev, dev_s, dev_n) = run(False), run(True)
    np.testing.assert_allclose(dev, host, rtol=1e-6)
    # blocks of at most 3 rows: reduced and refilled along the way (a large step on a
    # GPU), with the NaN/Inf counted before the block is overwritten
    rolled, rolled_s, rolled_n = run(True, roll_rows=3)
    finite = [i for i in range(len(ts)) if i != 3]
    np.testing.assert_allclose(rolled[finite], host[finite], rtol=1e-6)
    # the tensor with NaN/Inf: counts and sums exact, min/max count the zeros put there
    np.testing.assert_allclose(rolled[3], [2, 4, 4, 10, 0, 3, 1, 1, 0], rtol=1e-6)
    for k in host_s:
        np.testing.assert_array_equal(rolled_s[k], host_s[k])
    for k in host_n:      # (numpy sums the squares in another order than torch)
        np.testing.assert_allclose(rolled_n[k], host_n[k], rtol=1e-6)
    assert dev_s.keys() == host_s.keys() == set(range(len(ts)))
    for k in host_s:
        np.testing.assert_array_equal(dev_s[k], host_s[k])
    assert dev_n.keys() == host_n.keys() == {0, 2}
    np.testing.assert_allclose(dev_n[2], ts[2].reshape(7, -1).norm(dim=1).numpy(), rtol=1e-5)
    for i in (0, 1, 4, 6):
        t = ts[i].double()
        # float32 row sums: exact to float32 rounding of the values' magnitudes
        assert dev[i, 1] == pytest.approx(t.sum().item(), abs=1e-6 * t.abs().sum().item())
        assert (dev[i, 4], dev[i, 5]) == (t.min().item(), t.max().item())
    assert list(dev[3]) == [2, 4, 4, 10, 1, 3, 1, 1, 0]   # finite stats, then the counts


def test_the_cpu_batch_takes_norms_along_any_batch_dimension():
    """`hostbatch` cuts Σx² at each sample when a tensor's samples lie one after another,
    and falls back to torch otherwise (a batch dimension inside); every dtype is copied
    as float32 (bfloat16 too), float64 as float64."""
    from mldebug.record.hostbatch import HostBatch, HostPool
    from mldebug.record.tensorbatch import per_sample_norms
    g = torch.Generator().manual_seed(1)
    cases = [(torch.randn(3, 5, 4, generator=g), 1),      # samples interleaved
             (torch.randn(1, 6, 2, generator=g), 1),      # leading 1: still one after another
             (torch.randn(4, 3, generator=g), -1),        # the last dimension
             (torch.randn(7, generator=g), 0),            # one value a sample
             (torch.randn(2, 8, generator=g).bfloat16(), 0),
             (torch.randn(5, 2, generator=g).double(), 0)]
    b = HostBatch(HostPool())
    for i, (t, bd) in enumerate(cases):
        acc = torch.float64 if t.dtype == torch.float64 else torch.float32
        b.add(i, t.reshape(-1), acc, t.shape, bd)
    stats, norms = np.zeros((len(cases), 9)), {}
    b.reduce(stats, {}, norms, 0)
    for i, (t, bd) in enumerate(cases):
        np.testing.assert_allclose(norms[i], per_sample_norms(t, bd).numpy(), rtol=1e-6)
        x = t.double().reshape(-1)
        np.testing.assert_allclose(stats[i, :6], [x.numel(), x.sum(), x.abs().sum(),
                                                  x.square().sum(), x.min(), x.max()],
                                   rtol=1e-6, atol=1e-6)


def test_large_cpu_tensors_of_one_sign_keep_an_exact_abs_sum(torch_path):
    """Without the kernel, a large CPU tensor all >= 0 (a ReLU's output) or all <= 0
    skips the |x| pass: its |x| sum must still be what torch gives, and mixed signs still
    take the pass."""
    from mldebug.record.stats import StepBatch
    g = torch.Generator().manual_seed(2)
    ts = [torch.relu(torch.randn(70000, generator=g)), -torch.rand(70000, generator=g),
          torch.randn(70000, generator=g), torch.zeros(70000)]
    b = StepBatch(10, None)
    for t in ts:
        b.add(t, 0)
    _, rows, _, _ = b.stage()
    for row, t in zip(rows, ts):
        assert row[2] == t.abs().sum().item()      # float32 sums, the same kernel
        assert row[1] == t.sum().item() and (row[4], row[5]) == (t.min().item(), t.max().item())


def _kernel_cases():
    g = torch.Generator().manual_seed(3)
    r = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return [(r(64, 256), 0),                  # a gradient: samples one after another
            (r(3, 5, 4), 1),                  # samples interleaved: torch's norms
            (r(1, 6, 2), 1), (r(4, 3), -1), (r(7), 0),
            (r(8, 6).t(), 0),                 # not contiguous: copied first
            (r(40)[::2], None), (r(6, 8)[:, ::2], 0),       # strided views
            (torch.ones(()).expand(64, 256), 0),            # a .sum()'s gradient: stride 0
            (r(2, 8).bfloat16(), 0), (r(5, 2).double(), 0), (r(40000).half(), None),
            (r(70000), None), (torch.relu(r(50000)), None),
            (-torch.rand(1500, generator=g) - 1, None),
            (r(15), None), (r(16), None), (r(4097), None), (r(1), None),
            (r(1500, 3), 0),                  # more norms than a first buffer holds
            (torch.full((33,), 3.0), None),   # a constant: its range is a point
            (r(17) * 1e20, None),             # squares overflow float32: std is +Inf
            (torch._neg_view(r(300)), None),   # a negative view: torch's path
            (torch.tensor([1.0, float("nan"), 3.0, float("inf"), -2.0]), None),
            (torch.tensor([float("nan")] * 4), None)]


def _finished(cases, size=100):
    from mldebug.record.stats import StepBatch
    b = StepBatch(30, 5.0, size)
    for t, bd in cases:
        b.add(t, size, bd)
    staged = b.stage()
    return staged[1], b.finish_staged(staged)


def test_the_kernel_gives_what_the_torch_path_gives(monkeypatch):
    """The one-pass kernel and the torch / numpy path, tensor for tensor: the same counts
    and min/max, sums to float32 rounding, the same per-sample norms and sample sizes,
    histograms that differ at most where a value sits on a bin edge."""
    cases = _kernel_cases()
    assert native.kernel() is not None, native.reason()
    _, k = _finished(cases)
    _without_kernel(monkeypatch)
    _, t = _finished(cases)
    exact = [0, 5, 6, 7, 8, 9]     # numel, min, max, the counts
    np.testing.assert_array_equal(k["stats"][:, exact], t["stats"][:, exact])
    np.testing.assert_allclose(k["stats"][:, 1:5], t["stats"][:, 1:5], rtol=2e-5, atol=1e-6)
    over = next(i for i, (c, _) in enumerate(cases) if c.dtype == torch.float32
                and c.isfinite().all() and c.abs().max() > 1e19)
    assert np.isinf(k["stats"][over, 3]) and np.isinf(t["stats"][over, 3])
    np.testing.assert_array_equal(k["sample_n"], t["sample_n"])
    assert k["norms"].keys() == t["norms"].keys() == {0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 19}
    for i in k["norms"]:
        np.testing.assert_allclose(k["norms"][i], t["norms"][i], rtol=1e-5)
    for name in ("hist", "below", "above"):
        k[name], t[name] = np.atleast_2d(k[name].T).T, np.atleast_2d(t[name].T).T
    total = lambda o: o["hist"].sum(1) + o["below"][:, 0] + o["above"][:, 0]  # noqa: E731
    np.testing.assert_array_equal(total(k), total(t))
    assert (np.abs(k["hist"] - t["hist"]).sum(1) <= 2).all()


def test_the_kernel_bins_and_summarizes_as_numpy_does():
    """The kernel's summary and histogram of each row are exactly what `describe_rows`
    and `_histograms` make of the kernel's own sums (the same float64 operations), NaN/Inf
    rows (counted again, binned at the end of the step) included."""
    from mldebug.record.stats import StepBatch, describe_rows
    from mldebug.record.tensorbatch import sample_index
    cases = _kernel_cases()
    rows, out = _finished(cases)
    np.testing.assert_array_equal(out["stats"], describe_rows(rows))
    samples = []
    for t, _ in cases:
        x = t.detach().resolve_neg().reshape(-1)
        a = (x if x.dtype == torch.float64 else x.float()).numpy().astype(np.float64)
        samples.append(a[sample_index(len(a), 100, "cpu").numpy()] if len(a) > 100 else a)
    ref = StepBatch(30, 5.0, 100)._histograms(describe_rows(rows), samples)
    for name in ("hist", "lo", "hi", "below", "above", "sample_n"):
        np.testing.assert_array_equal(out[name], ref[name], err_msg=name)


def test_the_kernel_never_reads_a_freed_storage():
    """A tensor whose storage was shrunk (FSDP frees parameters so) would send the kernel
    to read freed memory: it is refused, with nothing taken for it."""
    from mldebug.record.nativebatch import NativeBatch
    nb = NativeBatch(native.kernel(), 100, 30, 5.0, {})
    freed = torch.randn(100)
    freed.untyped_storage().resize_(0)
    assert not nb.add(0, freed)
    assert nb.add(1, torch.ones(10))
    stats = np.zeros((2, 9))
    nb.fill(stats, {}, {})
    assert nb.index == [1] and list(stats[1, :2]) == [10, 10] and not stats[0].any()


ZERO_GRADIENTS = """
import sys, torch, torch.nn as nn, mldebug
from mldebug.record import open_run
torch.manual_seed(0)
class Sign(nn.Module):          # torch.sgn's backward sends an efficient zero tensor
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 3), nn.Linear(3, 2)
    def forward(self, x):
        return self.b(torch.sgn(self.a(x)))
m = Sign()
opt = torch.optim.SGD(m.parameters(), lr=0.1)
with mldebug.record(m, run_dir=sys.argv[1], run="z") as rec:
    for _ in range(2):
        opt.zero_grad(); m(torch.randn(5, 4)).sum().backward(); opt.step()
    z = torch._efficientzerotensor(5)
    mldebug.log_tensor("zero", z)
with open_run(rec.path) as run:
    print("steps", run.steps(), "zero", run.stats("zero:tensor")[0]["abs_max"])
"""


def test_tensors_without_data_of_their_own_are_not_read(tmp_path, write_program):
    """Autograd's efficient zero tensors (here torch.sgn's gradient) have no memory: the
    kernel would read address 0 (the process died); they take torch's path. In a
    subprocess: a crash must fail this test, not end the suite."""
    out = subprocess.run([sys.executable, str(write_program(ZERO_GRADIENTS)), str(tmp_path)],
                         text=True, capture_output=True, timeout=120, env=clean_env())
    assert out.returncode == 0, out.stderr
    assert "steps [0, 1, 2] zero 0.0" in out.stdout, out.stdout + out.stderr   # (2: at close)


def test_io_grad_is_what_a_tensor_hook_sees(tmp_path, cpu_path):
    """io_grad watches are tensor hooks: torch.autograd.grad(loss, h), which never runs
    h's node, still records h's gradient, and a user hook registered later on the same
    output does not change what is recorded."""
    model = make_mlp()
    x = torch.randn(5, 8)
    with mldebug.record(model, run_dir=tmp_path, run="g", log=("io_grad",),
                        step="manual") as rec:
        h = model[0](x)
        (g,) = torch.autograd.grad(model[2](model[1](h)).pow(2).sum(), h)
        rec.step()
        h = model[0](x)
        h.register_hook(lambda grad: grad * 10)
        expected = {}
        h.register_hook(lambda grad: expected.setdefault("g", grad.clone()))
        model[2](model[1](h)).pow(2).sum().backward()
        rec.step()
    with open_run(rec.path) as run:
        rows = run.stats("0:output_grad[0]")
        assert [r["step"] for r in rows] == [0, 1]
        check_row(rows[0], g)
        check_row(rows[1], expected["g"] / 10)      # before the user's x10


def test_a_batch_dimension_a_tensor_lacks_gives_no_norms(tmp_path, cpu_path):
    """batch_dim=1 with 1-D outputs: no per-sample norms for them (both paths agree), the
    step is recorded, nothing warns."""
    import warnings
    model = nn.Sequential(nn.Linear(8, 1), nn.Flatten(0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mldebug.record(model, run_dir=tmp_path, run="bd", batch_dim=1) as rec:
            opt.zero_grad()
            model(torch.randn(5, 8)).sum().backward()
            opt.step()
    with open_run(rec.path) as run:
        assert run.steps() == [0]
        assert run.norms("1:output_grad[0]", 0) is None            # 1-D: no dimension 1
        assert len(run.norms("0:output_grad[0]", 0)) == 1          # [5, 1]: one "sample"


def test_without_a_compiler_the_recorder_takes_the_torch_path(tmp_path):
    """No compiler (CC=false), a fresh cache: the build fails, `reason()` says why, and a
    recording still stores every step; MLDEBUG_NATIVE=0 turns the kernel off. With a
    compiler the kernel is built once per cache and found there by the next process."""
    program = (
        "import sys, torch, mldebug\n"
        "from mldebug.record import native, open_run\n"
        "torch.manual_seed(0)\n"
        "m = torch.nn.Linear(4, 2); opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "with mldebug.record(m, run_dir=sys.argv[1], run='r') as rec:\n"
        "    for _ in range(3):\n"
        "        opt.zero_grad(); m(torch.randn(5, 4)).sum().backward(); opt.step()\n"
        "with open_run(rec.path) as run:\n"
        "    print('kernel', native.kernel() is not None, 'steps', run.steps(),\n"
        "          'mean', round(run.stats('weight:param')[0]['mean'], 6))\n"
        "    print('reason', native.reason())\n")
    cache = tmp_path / "cache"

    def run(**env):
        out = subprocess.run([sys.executable, "-c", program, str(tmp_path)], text=True,
                             capture_output=True, timeout=120,
                             env=clean_env(MLDEBUG_CACHE_DIR=str(cache), **env))
        assert out.returncode == 0, out.stderr
        assert "Warning" not in out.stderr, out.stderr
        return out.stdout

    failed = run(CC="false")
    assert "kernel False steps [0, 1, 2]" in failed
    assert "reason OSError: false could not build fused.c" in failed
    off = run(MLDEBUG_NATIVE="0")
    assert "kernel False steps [0, 1, 2]" in off and "reason MLDEBUG_NATIVE=0" in off
    built = run()
    assert "kernel True steps [0, 1, 2]" in built
    libs = list(cache.glob("fused-*.so"))
    assert len(libs) == 1
    mtime = libs[0].stat().st_mtime_ns
    assert run(CC="false").startswith("kernel True")     # found in the cache: no build
    assert libs[0].stat().st_mtime_ns == mtime
    # the same weights, the same mean, on either path
    means = [float(out.split("mean")[1].split()[0]) for out in (failed, built)]
    assert means[0] == pytest.approx(means[1], abs=2e-6)


def test_histograms_of_many_rows_at_once_match_numpy_row_by_row():
    """`bin_rows` bins every recorded tensor's sample in one pass: per row it must give
    numpy's histogram over [lo, hi] (hi itself in the last bin), values outside counted
    below/above and NaN/Inf not at all."""
    from mldebug.record.stats import bin_rows
    rng = np.random.default_rng(0)
    lengths = np.array([0, 1, 7, 1024, 300, 50])
    lo = np.array([0.0, -1.0, -2.0, -0.5, 3.0, 1.0])
    hi = np.array([1.0, 1.0, 2.0, 0.5, 3.0, 1.0 + 1e-9])     # a zero-width range too
    rows = [rng.standard_normal(n) * 2 for n in lengths]
    rows[3][:4] = [np.nan, np.inf, -np.inf, 0.5]              # 0.5 is hi: the last bin
    rows[4][:] = 3.0                  # a constant tensor: its range is a point
    rows[4][0] = np.nan
    for nonfinite in (False, True):                            # the fast path and the masked one
        if not nonfinite:
            rows[3][:3] = [0.11, 0.23, 0.37]
        else:
            rows[3][:3] = [np.nan, np.inf, -np.inf]
        counts = bin_rows(np.concatenate(rows), lengths, lo, hi, 10)
        assert counts.shape == (6, 12)
        for r, x in enumerate(rows):
            x = x[np.isfinite(x)]
            below, above = (x < lo[r]).sum(), (x > hi[r]).sum()
            inside = x[(x >= lo[r]) & (x <= hi[r])]
            if hi[r] > lo[r]:
                ref, _ = np.histogram(inside, bins=10, range=(lo[r], hi[r]))
            else:                                              # a point: all in bin 0
                ref = np.zeros(10, np.int64)
                ref[0] = len(inside)
            assert list(counts[r, 1:-1]) == list(ref), r
            assert (counts[r, 0], counts[r, -1]) == (below, above), r


def test_a_step_of_small_tensors_fills_one_block():
    """The CPU batch copies a step's small tensors into one buffer (one reduction per
    buffer, not per tensor), the next step's buffer sized by this one's; a device batch
    refills a full block instead of growing."""
    from mldebug.record.hostbatch import HostBatch, HostPool
    from mldebug.record.tensorbatch import BlockPool, TensorBatch
    host = HostPool()
    for step in range(2):
        cpu = HostBatch(host)
        for i in range(400):            # 400K values: more than a first buffer holds
            cpu.add(i, torch.randn(1000), torch.float32)
        assert len(cpu.buffers) == (2 if step == 0 else 1)
        stats = np.zeros((400, 9))
        cpu.reduce(stats, {}, {}, 0)
        assert (stats[:, 0] == 1000).all()
    pool = BlockPool()
    rolling = TensorBatch(pool, "cpu", 16, roll_rows=8)
    for i in range(40):
        rolling.add(i, torch.randn(1000), torch.float32)
    assert len(rolling.blocks) == 1 and rolling.blocks[0][0].shape[0] == 8
    assert len(rolling.rolled.blocks) == 4      # 40 rows in blocks of 8: four refills
    # once the cap is reached, a tensor that the open block cannot take goes to a larger
    # block of the step (refilled), not to a new one
    mixed = TensorBatch(BlockPool(), "cpu", 16, roll_rows=8)
    mixed.pool.hint[(torch.device("cpu"), torch.float32)] = 6
    for i, rows in enumerate([6, 1, 1, 5, 2, 6, 1] * 3):
        mixed.add(i, torch.randn(rows * 1024 - 5), torch.float32)
    assert sorted(b[0].shape[0] for b in mixed.blocks) == [2, 6]


def test_each_rank_of_a_job_records_to_its_own_run_with_its_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with mldebug.record(model, run_dir=str(tmp_path), run="exp") as rec:
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
    assert rec.run == "exp-rank1"           # not the file rank 0 writes
    with mldebug.record(model, run_dir=str(tmp_path), run="exp-{rank}-b"):
        pass
    with mldebug.record.open_run(str(tmp_path / "exp-rank1.sqlite")) as run:
        assert (run.meta["rank"], run.meta["world_size"]) == (1, 2)
        assert run.steps() == [0]
    assert (tmp_path / "exp-1-b.sqlite").exists()
    # the run says its rank where runs are listed: the store's list, the runs command,
    # the timeline's read
    from mldebug.record.runs_command import format_runs
    from mldebug.record.store import list_runs
    from mldebug.record.timeline import timeline
    listed = {r["name"]: r for r in list_runs(str(tmp_path))}
    assert (listed["exp-rank1"]["rank"], listed["exp-rank1"]["world_size"]) == (1, 2)
    assert "  [rank 1] exp-rank1 " in format_runs(str(tmp_path))
    t = timeline(str(tmp_path / "exp-rank1.sqlite"))
    assert (t["rank"], t["world_size"]) == (1, 2)


def test_a_compiled_model_is_recorded_without_breaking_its_graph(tmp_path):
    """Under torch.compile the recorder's module hooks return at once while dynamo traces
    (no graph break, no recompilation): the parameters and their gradients are recorded,
    the compiled module's own inputs and outputs when it is what is recorded, and a
    warning says once what is not (the modules inside the graph)."""
    import warnings
    from torch._dynamo.utils import counters
    torch._dynamo.reset()
    counters.clear()
    model = make_mlp()
    compiled = torch.compile(model)
    expected = []

    def step_on(x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(compiled(x), y).backward()
        expected.append(model[2].weight.grad.clone())
        opt.step()

    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    keys = {}
    for recorded in (model, compiled):
        counters.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with mldebug.record(recorded, run_dir=tmp_path, run="c") as rec:
                for x, y in batches(3):
                    step_on(x, y)
        ours = [str(w.message) for w in caught if "mldebug.record" in str(w.message)]
        assert len(ours) == 1 and "torch.compile" in ours[0], ours
        with open_run(rec.path) as run:
            assert run.steps() == [0, 1, 2]
            keys[recorded is compiled] = {s["key"] for s in run.series()}
            for i, row in enumerate(run.stats("2.weight:param_grad")):
                check_row(row, expected[-3 + i])
        # one graph for the model with this recorder's hooks on (dynamo guards on them)
        assert dict(counters["graph_break"]) == {}
        assert counters["stats"]["unique_graphs"] == 1
    params = {f"{m}.{p}:{k}" for m in (0, 2) for p in ("weight", "bias")
              for k in ("param", "param_grad")}
    assert keys[False] == params
    assert keys[True] == params | {":input[0]", ":output[0]", ":output_grad[0]"}


def test_a_failing_hook_under_warnings_as_errors_never_raises_into_the_forward(tmp_path):
    """A user's `condition` that raises is said as a warning and recording goes on; under
    `-W error` (pytest's filterwarnings=error) that warning is not an exception out of the
    model's forward either."""
    import warnings
    model = make_mlp()

    def condition(module, inputs, output):
        raise ValueError("bad condition")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with mldebug.record(model, run_dir=tmp_path, run="w", condition=condition):
            train(model, batches(2))
