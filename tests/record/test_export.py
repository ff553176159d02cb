"""`python -m mldebug runs export`: a recorded run in TensorBoard event files and in W&B
runs, read back with the dashboards' own readers and compared number by number with the
store and with the browser view's Timeline data."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.record import open_run
from mldebug.record.timeline import timeline

from conftest import clean_env, run_cli
from dashboards import (base_of, expected_scalars, f32, same, tb_scalars, tb_texts,
                        tensorboard, wandb_env, wandb_records, wandb_runs)

pytest.importorskip("tensorboard")


class Twice(nn.Module):
    """A layer called twice a step (the Timeline and the export show its first call)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.mid = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.mid(torch.relu(self.mid(self.inp(x))))))


def record_run(run_dir, name="base", steps=4, **kw):
    """A short training recorded with every kind of thing an export carries: module io and
    gradients, parameters, a layer called twice, a named tensor with no finite value (NaN
    stats, no histogram), a KPI, notes."""
    torch.manual_seed(0)
    model = Twice()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    with mldebug.record(model, run_dir=run_dir, run=name, note="first try", **kw) as rec:
        for i in range(steps):
            x = torch.randn(5, 6, generator=g)
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            if i == 2:
                mldebug.log_tensor("blown", torch.full((4,), math.nan))
                mldebug.log_note("lr halved")
            loss.backward()
            opt.step()
            mldebug.log_scalar("loss", loss)
    return rec


def test_a_run_exported_to_tensorboard_reads_back_as_stored(tmp_path):
    runs, tb = tmp_path / "runs", tmp_path / "tb"
    record_run(runs)
    out = run_cli(["runs", "export", str(runs), "--tensorboard", str(tb)])
    assert out.returncode == 0, out.stderr
    assert f"tensorboard --logdir {tb}" in out.stdout
    ea = tensorboard(tb / "base")
    with open_run(runs / "base.sqlite") as run:
        want = expected_scalars(run)
        # every stat of every series and the KPI, at the store's steps, as float32
        assert set(ea.Tags()["scalars"]) == set(want)
        for tag, points in want.items():
            got = tb_scalars(ea, tag)
            assert [s for s, _ in got] == [s for s, _ in points], tag
            assert all(same(v, f32(w)) for (_, v), (_, w) in zip(got, points)), tag
        assert [v for _, v in tb_scalars(ea, "mldebug/blown/tensor/nan")] == [4.0]
        assert math.isnan(tb_scalars(ea, "mldebug/blown/tensor/mean")[0][1])
        # histograms: the stored bins themselves, over [lo, hi], at the same steps
        hist_tags = set(ea.Tags()["histograms"])
        for s in run.series():
            tag = f"{base_of(s['key'])}/hist"
            stored = [h for h in run.histograms(s["key"]) if h["call"] == 0 and sum(h["counts"])
                      and math.isfinite(h["lo"])]
            if not stored:
                assert tag not in hist_tags           # (a tensor with no finite value)
                continue
            events = ea.Histograms(tag)
            assert [e.step for e in events] == [h["step"] for h in stored]
            for e, h in zip(events, stored):
                hv = e.histogram_value
                assert list(hv.bucket) == h["counts"]
                assert (hv.min, hv.max, hv.bucket_limit[-1]) == (h["lo"], h["hi"], h["hi"])
                np.testing.assert_allclose(hv.bucket_limit,
                                           np.linspace(h["lo"], h["hi"], 31)[1:], rtol=1e-12)
        assert "mldebug/blown/tensor/hist" not in hist_tags
        # notes at their steps; the run's steps are the store's
        assert tb_texts(ea, "mldebug/notes") == [(0, "first try"), (2, "lr halved")]
        assert {e.step for e in ea.Scalars("mldebug/inp/output[0]/mean")} == set(run.steps())


def test_the_export_and_the_timeline_agree_on_every_number(tmp_path):
    """The browser view's Timeline data (`timeline()`, what the panel draws) and the
    export: the same steps, stats, histogram bins and KPIs, series by series; the layer
    called twice shows its first call in both (gradients are stored in backward's order,
    the later call first)."""
    runs, tb = tmp_path / "runs", tmp_path / "tb"
    record_run(runs)
    assert run_cli(["runs", "export", str(runs), "--run", "base", "--tensorboard",
                    str(tb)]).returncode == 0
    ea = tensorboard(tb / "base")
    view = timeline(runs / "base.sqlite", max_steps=None)
    hist_tags = set(ea.Tags()["histograms"])
    checked = 0
    for series in view["series"]:
        base = base_of(series["key"])
        for stat, values in series["stats"].items():
            got = tb_scalars(ea, f"{base}/{stat}")
            assert [s for s, _ in got] == series["steps"], (base, stat)
            assert all(same(v, f32(w)) for (_, v), w in zip(got, values)), (base, stat)
            checked += len(values)
        h = series["hist"]
        drawn = [i for i in range(len(series["steps"])) if h["lo"][i] is not None
                 and h["hi"][i] is not None and sum(h["counts"][i]) > 0]
        events = ea.Histograms(f"{base}/hist") if drawn else []
        assert drawn or f"{base}/hist" not in hist_tags
        assert [e.step for e in events] == [series["steps"][i] for i in drawn]
        for e, i in zip(events, drawn):
            assert list(e.histogram_value.bucket) == h["counts"][i]
            assert (e.histogram_value.min, e.histogram_value.max) == (h["lo"][i], h["hi"][i])
        assert [v for _, v in tb_scalars(ea, f"{base}/hist_below")] == h["below"]
        assert [v for _, v in tb_scalars(ea, f"{base}/hist_above")] == h["above"]
    for kpi, points in view["scalars"].items():
        got = tb_scalars(ea, f"mldebug/kpi/{kpi}")
        assert [s for s, _ in got] == points["steps"]
        assert all(same(v, f32(w)) for (_, v), w in zip(got, points["values"]))
    assert checked > 500
    # the layer called twice: its gradient's first call, in both
    with open_run(runs / "base.sqlite") as run:
        rows = [r for r in run.stats("mid:output_grad[0]") if r["step"] == 1]
    assert [r["call"] for r in rows] == [1, 0]            # (stored in backward's order)
    first = next(s for s in view["series"] if s["key"] == "mid:output_grad[0]")
    assert first["stats"]["mean"][1] == rows[1]["mean"]
    assert tb_scalars(ea, "mldebug/mid/output_grad[0]/mean")[1][1] == f32(rows[1]["mean"])


def test_an_export_into_a_folder_in_use_adds_its_own_file_and_touches_nothing(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    runs, tb = tmp_path / "runs", tmp_path / "tb"
    record_run(runs, steps=2)
    theirs = SummaryWriter(str(tb / "base"))          # the user's own run of that name
    theirs.add_scalar("user/loss", 1.5, 0)
    theirs.close()
    (tb / "base" / "notes.txt").write_text("mine")
    before = {p: p.read_bytes() for p in (tb / "base").iterdir()}
    for _ in range(2):                                 # twice: two files of its own
        assert run_cli(["runs", "export", str(runs), "--tensorboard", str(tb)]).returncode == 0
    after = {p: p.read_bytes() for p in (tb / "base").iterdir()}
    assert {p: after[p] for p in before} == before     # nothing deleted or truncated
    new = sorted(p.name for p in set(after) - set(before))
    assert len(new) == 2 and all(n.startswith("events.out.tfevents.") and n.endswith(".mldebug")
                                 for n in new)
    ea = tensorboard(tb / "base")
    assert tb_scalars(ea, "user/loss") == [(0, 1.5)]
    assert [s for s, _ in tb_scalars(ea, "mldebug/kpi/loss")] == [0, 1, 0, 1]


def test_a_run_exported_to_wandb_offline_reads_back_with_wandbs_reader(tmp_path):
    pytest.importorskip("wandb")
    runs = tmp_path / "runs"
    record_run(runs)
    env = clean_env(**wandb_env(tmp_path, WANDB_PROJECT="mldebug-tests",
                                WANDB_ENTITY="someone"))
    out = run_cli(["runs", "export", str(runs), "--wandb"], env=env)
    assert out.returncode == 0, out.stderr
    [run_dir] = wandb_runs(tmp_path)                  # offline: written locally only
    records = wandb_records(run_dir, env)
    header = next(r["run"] for r in records if r["type"] == "run")
    assert (header["display_name"], header["project"], header["entity"]) == (
        "base", "mldebug-tests", "someone")
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    by_step = {row["_step"]: row for row in rows}
    with open_run(runs / "base.sqlite") as run:
        assert sorted(by_step) == sorted(set(run.steps()) | {0, 1, 2, 3})
        for tag, points in expected_scalars(run).items():
            for step, value in points:
                got = by_step[step][tag]
                # W&B keeps float64 (NaN as the string 'NaN'): the store's numbers exactly
                got = math.nan if got == "NaN" else got
                assert same(got, math.nan if value is None else float(value)), (tag, step)
        for s in run.series():
            for h in run.histograms(s["key"]):
                if h["call"] or not sum(h["counts"]) or not math.isfinite(h["lo"]):
                    continue
                row, tag = by_step[h["step"]], f"{base_of(s['key'])}/hist"
                assert row[tag + "._type"] == "histogram"          # (the reader flattens it)
                assert row[tag + ".values"] == h["counts"]
                assert (row[tag + ".bins"][0], row[tag + ".bins"][-1]) == (h["lo"], h["hi"])
    assert by_step[2]["mldebug/notes"] == "lr halved"


def test_export_errors_are_one_line_and_name_what_is_missing(tmp_path):
    runs = tmp_path / "runs"
    record_run(runs, steps=1)
    bad = run_cli(["runs", "export", str(runs)])
    assert bad.returncode == 2 and "name a target: --tensorboard DIR or --wandb" in bad.stderr
    bad = run_cli(["runs", "export", str(runs), "--run", "nope", "--tensorboard", str(tmp_path)])
    assert bad.returncode == 2
    assert bad.stderr.strip() == f"mldebug: error: runs export: no run 'nope' in {str(runs)!r} (runs: base)"
    (tmp_path / "file").write_text("x")
    bad = run_cli(["runs", "export", str(runs), "--tensorboard", str(tmp_path / "file")])
    assert bad.returncode == 2 and "is a file, not a directory" in bad.stderr
    assert (tmp_path / "file").read_text() == "x"
    # without the extras: one line naming them (a package that cannot be imported stands in)
    blocked = tmp_path / "blocked"
    for name in ("tensorboard", "wandb"):
        (blocked / name).mkdir(parents=True)
        (blocked / name / "__init__.py").write_text(f"raise ImportError('no {name} here')\n")
    env = clean_env()
    env["PYTHONPATH"] = f"{blocked}:{env['PYTHONPATH']}"
    for flag, extra in ((["--tensorboard", str(tmp_path / "tb")], "tensorboard"),
                        (["--wandb"], "wandb")):
        out = run_cli(["runs", "export", str(runs), *flag], env=env)
        assert out.returncode == 2
        assert out.stderr.strip().splitlines() == [
            f"mldebug: error: runs export: runs export {flag[0]} needs the {extra} package: "
            f"pip install mldebug[{extra}]"]
    assert not (tmp_path / "tb").exists()


def test_runs_export_lists_a_folder_named_export_when_asked_for_it(tmp_path):
    record_run(tmp_path / "export", steps=1)
    out = run_cli(["runs", "export"], cwd=tmp_path)
    assert out.returncode == 0 and "1 run in export" in out.stdout


def test_the_stop_of_a_run_shows_at_its_step(tmp_path, write_program):
    """A NaN at step 2 under --batch: the stop is noted at step 2 in the store, in the
    live copy and in the export."""
    prog = write_program(f"""
        import torch, torch.nn as nn, mldebug
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        rec = mldebug.record(model, run_dir={str(tmp_path / 'runs')!r}, run="nan",
                             to=("tensorboard", {str(tmp_path / 'live')!r}))
        for step in range(5):
            opt.zero_grad()
            x = torch.randn(3, 4)
            if step == 2:
                x = torch.log(x - 10)                  # NaN in the data
            loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            mldebug.log_scalar("loss", loss)
    """)
    out = run_cli(["--batch", str(prog)], cwd=tmp_path)
    assert out.returncode == 3, out.stderr
    with open_run(tmp_path / "runs" / "nan.sqlite") as run:
        [(step, text)] = run.notes()
    assert step == 2 and text.startswith("[stop] ") and "NaN" in text
    message = text[len("[stop] "):]
    assert run_cli(["runs", "export", str(tmp_path / "runs"), "--tensorboard",
                    str(tmp_path / "tb")]).returncode == 0
    for logdir in (tmp_path / "live", tmp_path / "tb" / "nan"):
        ea = tensorboard(logdir)
        assert tb_texts(ea, "mldebug/stops") == [(2, message)]
        # (the data went bad before step 2's forward: steps 0 and 1 were recorded)
        assert [s for s, _ in tb_scalars(ea, "mldebug/0/output[0]/mean")] == [0, 1]
