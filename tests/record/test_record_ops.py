"""Issue 22's recorder on a GPU, counted on the CPU standing in for the device
(`record.stats.simulate_device`): a recorded step's extra ops do not grow with the
number of parameters (their values and gradients are copied by one `_foreach_copy_`),
nor, once a recorded step has shown they are not changed in place, with the number of
module inputs, outputs and output gradients (held, copied at the step's end in one op);
the step's reductions are a fixed handful of ops per block, whatever the number of
tensors in it. And what is recorded is still what the tensor was when recorded."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.profiler import profile

import mldebug
from mldebug.record import stats
from mldebug.record.tensorbatch import BlockPool, TensorBatch, per_sample_norms

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from opcount import count_step, settled  # noqa: E402


def mlp(layers: int) -> nn.Module:
    torch.manual_seed(0)
    mods = [nn.Linear(16, 32), nn.ReLU()]
    for _ in range(layers - 2):
        mods += [nn.Linear(32, 32), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(32, 4))


def extra_ops(layers: int, log, tmp_path) -> int:
    """Aten ops a recorded step adds on the device path (one healthy SGD step)."""
    out = []
    for recorded in (False, True):
        model = mlp(layers)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))

        def step():
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()

        rec = mldebug.record(model, log=log, run_dir=tmp_path, run=f"r{layers}") \
            if recorded else None
        stats.simulate_device(recorded)
        try:
            ops, reads = count_step(step, settle=settled(rec) if rec is not None else None)
        finally:
            stats.simulate_device(False)
            if rec is not None:
                rec.close()
        assert reads == 0 or not recorded or out[0][1] == reads
        out.append((sum(ops.values()), reads))
    return out[1][0] - out[0][0]


def test_parameters_and_their_gradients_cost_the_same_ops_however_many(tmp_path):
    small = extra_ops(2, ("params", "params_grad"), tmp_path)
    large = extra_ops(12, ("params", "params_grad"), tmp_path)
    # 6 parameters and gradients against 26: the same copy and the same reductions
    assert large == small, (small, large)


def test_module_outputs_and_their_gradients_cost_no_op_each_once_seen_unchanged(tmp_path):
    """The first recorded step copies each module input, output and output gradient
    when seen and sees that none changes in place afterwards; from then on they are
    held and copied at the step's end with the parameters, in one op."""
    small = extra_ops(2, ("io", "io_grad"), tmp_path)
    large = extra_ops(12, ("io", "io_grad"), tmp_path)
    assert large == small, (small, large)


def _stage_ops(tensors) -> int:
    """Top-level aten ops of a step's `stage` and `finish`, the second time this layout
    is seen (its indices are made once and kept, as from step to step)."""
    pool = BlockPool()
    for _ in range(2):
        b = TensorBatch(pool, "cpu", 64)
        for i, (t, bd) in enumerate(tensors):
            b.add(i, t, torch.float32, t.shape if bd is not None else None, bd)
        with profile() as prof:
            st = b.stage(64)
        st.finish([x.double().numpy().reshape(-1) for x in st.tensors],
                  np.zeros((len(tensors), 9)), {}, {})
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)


def test_a_blocks_reductions_and_norms_take_the_same_ops_for_5_tensors_or_50():
    g = torch.Generator().manual_seed(0)

    def tensors(k):
        return [(torch.randn(4, 3 + j, generator=g), 0 if j % 2 else None) for j in range(k)]

    assert _stage_ops(tensors(5)) == _stage_ops(tensors(50))


def test_the_device_batch_copies_any_layout_and_takes_each_samples_norm():
    """Copied as they lie (a transposed view, bfloat16, samples longer than a block row),
    in one op each or one for all (`add_many`); norms along the first dimension at once,
    along another one by one: each as torch computes it."""
    g = torch.Generator().manual_seed(2)
    cases = [(torch.randn(6, 300, generator=g).T, 0),           # not contiguous
             (torch.randn(3, 2500, generator=g), 0),            # 3 rows a sample
             (torch.randn(4, 5, 6, generator=g), 1),            # samples interleaved
             (torch.randn(8, 3, generator=g).bfloat16(), 0),
             (torch.randn(7, generator=g), None),
             (torch.randn(2, 1024, generator=g), 0)]            # exactly a row a sample
    together = [torch.randn(33, 5, generator=g), torch.randn(5, 4, generator=g).T]
    b = TensorBatch(BlockPool(), "cpu", 50)
    for i, (t, bd) in enumerate(cases):
        b.add(i, t, torch.float32, t.shape if bd is not None else None, bd)
    b.add_many([(len(cases) + j, t, torch.float32) for j, t in enumerate(together)])
    st = b.stage(50)
    rows, samples, norms = np.zeros((len(cases) + 2, 9)), {}, {}
    st.finish([x.double().numpy().reshape(-1) for x in st.tensors], rows, samples, norms)
    everything = [t for t, _ in cases] + together
    for i, t in enumerate(everything):
        x = t.double().reshape(-1)
        np.testing.assert_allclose(rows[i, :6], [x.numel(), x.sum(), x.abs().sum(),
                                                 x.square().sum(), x.min(), x.max()],
                                   rtol=1e-5, atol=1e-5)
    assert norms.keys() == {0, 1, 2, 3, 5}
    for i in norms:
        t, bd = cases[i]
        np.testing.assert_allclose(norms[i], per_sample_norms(t, bd).numpy(), rtol=1e-5)


class ClampLater(nn.Module):
    """max(x, 0): out of place until `in_place` is set, then in place (as a ReLU with
    inplace=True), which changes the previous layer's output after it was recorded."""
    in_place = False

    def forward(self, x):
        return x.clamp_(min=0) if self.in_place else x.clamp(min=0)


def record_clamping_from_step_2(model, opt, x, y, tmp_path):
    """Four steps recorded (io), the model's `ClampLater` (index 3) in place from step 2."""
    with mldebug.record(model, log=("io",), run_dir=tmp_path, run="r") as rec:
        for step in range(4):
            model[3].in_place = step >= 2
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    return rec


def test_an_output_changed_in_place_later_is_recorded_as_it_was(tmp_path, device):
    """A Linear's output that a later in-place op changes: on the device path the first
    recorded step sees it change, so it is copied when seen on every step (its negative
    values are in the record); one that starts changing only later (step 2) was held:
    that step's row is left out with a warning, and later steps are copied when seen."""
    import warnings
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(inplace=True), nn.Linear(16, 8),
                          ClampLater(), nn.Linear(8, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = {}
    model[0].register_forward_hook(lambda m, a, out: seen.setdefault("a", []).append(
        out.detach().clone()))
    model[2].register_forward_hook(lambda m, a, out: seen.setdefault("b", []).append(
        out.detach().clone()))
    x, y = torch.randn(5, 8, device=device), torch.randint(0, 3, (5,), device=device)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rec = record_clamping_from_step_2(model, opt, x, y, tmp_path)
    ours = [str(w.message) for w in caught if "mldebug.record" in str(w.message)]
    on_a_device = stats.defers(torch.zeros(1, device=device))    # (cpu-as-device too)
    with mldebug.record.open_run(rec.path) as run:
        a = run.stats("0:output[0]")
        b = run.stats("2:output[0]")
    assert [r["step"] for r in a] == [0, 1, 2, 3]
    for r, want in zip(a, seen["a"]):       # before the ReLU: negative values kept
        assert r["min"] == pytest.approx(want.min().item()) and r["min"] < 0
    kept = [0, 1, 3] if on_a_device else [0, 1, 2, 3]
    assert [r["step"] for r in b] == kept
    for r in b:
        assert r["min"] == pytest.approx(seen["b"][r["step"]].min().item())
        assert r["max"] == pytest.approx(seen["b"][r["step"]].max().item())
    if on_a_device:
        assert len(ours) == 1 and "2:output[0]" in ours[0] and "step 2" in ours[0], ours
    else:
        assert ours == []


def test_held_tensors_changed_let_go_or_unreadable_are_lost_and_the_rest_copied():
    """What `hold` could not copy at the step's end: a tensor changed in place (its
    version moved), one whose memory was let go (`resize_(0)`, FSDP's way) and one that
    raises on access (a CUDA graph's overwritten output; a meta tensor here). Their rows
    are `lost`; the others' are exact."""
    g = torch.Generator().manual_seed(3)
    ts = [torch.randn(4, 3, generator=g) for _ in range(5)]
    ts[3] = torch.empty(6, device="meta")
    b = TensorBatch(BlockPool(), "cpu", 16)
    for i, t in enumerate(ts):
        b.hold(i, t, torch.float32)
    want = [t.double().reshape(-1) for t in ts]
    ts[1].mul_(2)                                   # changed after it was held
    ts[2].untyped_storage().resize_(0)              # let go
    st = b.stage(16)
    rows = np.zeros((len(ts), 9))
    st.finish([x.double().numpy().reshape(-1) for x in st.tensors], rows, {}, {})
    assert b.lost == {1, 2, 3}
    for i in (0, 4):
        np.testing.assert_allclose(rows[i, :6], [12, want[i].sum(), want[i].abs().sum(),
                                                 want[i].square().sum(), want[i].min(),
                                                 want[i].max()], rtol=1e-6)


class ClampThroughData(nn.Module):
    """max(x, 0) written into its input through `.data`: a change that autograd's
    version counter does not see (as a custom kernel writing in place)."""

    def forward(self, x):
        x.data.clamp_(min=0)
        return x * 1


def test_a_change_the_version_counter_misses_is_caught_by_the_first_steps_twin(tmp_path, device):
    """On the first recorded step an output copied when seen is copied again at the
    step's end and the two statistics compared: `.data.clamp_` after a Linear makes them
    differ, so that output is never held, and every step records it as the Linear gave
    it (negative values included)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), ClampThroughData(), nn.Linear(16, 3)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen = []
    model[0].register_forward_hook(lambda m, a, out: seen.append(out.detach().clone()))
    x, y = torch.randn(5, 8, device=device), torch.randint(0, 3, (5,), device=device)
    with mldebug.record(model, log=("io",), run_dir=tmp_path, run="r") as rec:
        for _ in range(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    with mldebug.record.open_run(rec.path) as run:
        rows = run.stats("0:output[0]")
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for r in rows:
        assert r["min"] == pytest.approx(seen[r["step"]].min().item()) and r["min"] < 0
    if stats.defers(torch.zeros(1, device=device)):
        assert "0:output[0]" in rec._copy_now and "2:output[0]" in rec._unchanged


def test_the_recorders_warnings_never_raise_into_the_program(tmp_path):
    """Under `-W error` (pytest's filterwarnings=error) a recorder warning is not an
    exception out of `opt.step()`: a held output that starts changing is still left
    out, and training goes on."""
    import warnings
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8), ClampLater(),
                          nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(5, 8), torch.randint(0, 3, (5,))
    stats.simulate_device(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            rec = record_clamping_from_step_2(model, opt, x, y, tmp_path)
    finally:
        stats.simulate_device(False)
    with mldebug.record.open_run(rec.path) as run:
        assert [r["step"] for r in run.stats("2:output[0]")] == [0, 1, 3]
