"""`mldebug.record(..., to=...)`: the live copy in TensorBoard and W&B, made on the
mirror's thread; and the framework callbacks' `record=True` writing into the trainer's own
logger. Read back with the dashboards' own readers, compared with the store."""
from __future__ import annotations

import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.core.errors import UsageError
from mldebug.record import mirror as _mirror
from mldebug.record import open_run

from conftest import clean_env
from dashboards import (base_of, expected_scalars, f32, same, tb_scalars, tb_texts,
                        tensorboard, wandb_env, wandb_history, wandb_records, wandb_runs)

pytest.importorskip("tensorboard")


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def train(model, steps, each=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    for i in range(steps):
        x, y = torch.randn(5, 8, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        mldebug.log_scalar("loss", loss)
        if each is not None:
            each(i)


def check_tensorboard_has_the_run(ea, path):
    """Every stat, KPI and histogram of the store, at its steps, in EA."""
    with open_run(path) as run:
        for tag, points in expected_scalars(run).items():
            got = tb_scalars(ea, tag)
            assert [s for s, _ in got] == [s for s, _ in points], tag
            assert all(same(v, f32(w)) for (_, v), (_, w) in zip(got, points)), tag
        for s in run.series():
            stored = [h for h in run.histograms(s["key"]) if h["call"] == 0]
            events = ea.Histograms(f"{base_of(s['key'])}/hist")
            assert [(e.step, list(e.histogram_value.bucket)) for e in events] == [
                (h["step"], h["counts"]) for h in stored]
        return run.steps()


def _python(source, tmp_path, env=None, timeout=300):
    prog = tmp_path / "prog.py"
    prog.write_text(source)
    return subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                          cwd=tmp_path, env=env or clean_env(), timeout=timeout)


def test_a_live_copy_into_a_tensorboard_folder_in_use(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    live = tmp_path / "live"
    theirs = SummaryWriter(str(live))                  # the user's own event file there
    theirs.add_scalar("user/acc", 0.5, 0)
    theirs.close()
    before = {p: p.read_bytes() for p in live.iterdir()}
    with mldebug.record(make_mlp(), run_dir=tmp_path, run="r", every=2,
                        to=("tensorboard", live)) as rec:
        train(rec.model, 5)
        mldebug.log_note("done")
    assert {p: p.read_bytes() for p in before} == before
    [mine] = set(live.iterdir()) - set(before)
    assert mine.name.endswith(".mldebug")
    ea = tensorboard(live)
    assert tb_scalars(ea, "user/acc") == [(0, 0.5)]
    assert check_tensorboard_has_the_run(ea, rec.path) == [0, 2, 4]
    assert [s for s, _ in tb_scalars(ea, "mldebug/kpi/loss")] == [0, 1, 2, 3, 4]
    assert tb_texts(ea, "mldebug/notes") == [(4, "done")]


def test_a_live_copy_into_the_users_own_writer_leaves_it_open(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(tmp_path / "tb"))
    with mldebug.record(make_mlp(), run_dir=tmp_path, run="r", to=writer) as rec:
        train(rec.model, 3, each=lambda i: writer.add_scalar("user/i", i, i))
    writer.add_scalar("user/after", 1.0, 3)          # still the user's, still open
    writer.close()
    [events] = list((tmp_path / "tb").iterdir())      # one file: the user's
    ea = tensorboard(tmp_path / "tb")
    assert check_tensorboard_has_the_run(ea, rec.path) == [0, 1, 2]
    assert tb_scalars(ea, "user/after") == [(3, 1.0)]


class BlockedWriter:
    """A SummaryWriter stand-in whose writes wait until released: a dashboard slower than
    training."""

    def __init__(self):
        self.release = threading.Event()
        self.scalars = []

    def add_scalar(self, tag, value, step, walltime=None):
        self.release.wait(60)
        self.scalars.append((tag, step))

    def add_histogram_raw(self, tag, **kwargs):
        self.release.wait(60)

    def add_text(self, tag, text, step, walltime=None):
        pass

    def flush(self):
        pass


def test_the_training_step_never_waits_for_the_mirror(tmp_path, monkeypatch):
    """The dashboard takes nothing while training runs 5 recorded steps: every step ends
    (the mirror's queue takes it); beyond the backlog a step's statistics are left out of
    the dashboard (said once, still in the store); its KPIs are not."""
    monkeypatch.setattr(_mirror, "BACKLOG", 2)
    writer = BlockedWriter()
    rec = mldebug.record(make_mlp(), run_dir=tmp_path, run="r", to=writer)
    done = []
    trainer = threading.Thread(target=lambda: (train(rec.model, 5), done.append(True)))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer.start()
        trainer.join(60)
        assert done == [True]                          # while the dashboard was blocked
        assert rec.step_index == 5 and rec._mirror.mirrored == 0
        writer.release.set()
        rec.close()
    behind = [w for w in said if "recorded steps behind" in str(w.message)]
    assert len(behind) == 1 and "statistics of step 2" in str(behind[0].message)
    # step 0 was being written, step 1 waited; 2, 3 and 4 were left out of the dashboard
    mean = "mldebug/0/output[0]/mean"
    assert [s for t, s in writer.scalars if t == mean] == [0, 1]
    assert [s for t, s in writer.scalars if t == "mldebug/kpi/loss"] == [0, 1, 2, 3, 4]
    with open_run(rec.path) as run:
        assert run.steps() == [0, 1, 2, 3, 4]


class FailingWriter(BlockedWriter):
    def add_scalar(self, tag, value, step, walltime=None):
        raise OSError("disk full")


def test_a_failing_dashboard_warns_once_and_the_recording_goes_on(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"writing to .* failed \(OSError: disk full\); "
                                            "the mirror to it stops"):
        with mldebug.record(make_mlp(), run_dir=tmp_path, run="r", to=FailingWriter()) as rec:
            train(rec.model, 3)
    with open_run(rec.path) as run:
        assert run.steps() == [0, 1, 2] and len(run.scalars()["loss"]) == 3


def test_bad_targets_and_missing_extras_are_clear_and_touch_no_run(tmp_path, monkeypatch):
    with pytest.raises(UsageError, match=r"to= takes \('tensorboard', DIR\), 'wandb', a "
                                         r"SummaryWriter, a wandb run, or a list of these; "
                                         r"got 'tensorbord'"):
        mldebug.record(make_mlp(), run_dir=tmp_path, run="r", to="tensorbord")
    with pytest.raises(UsageError, match="needs DIR a path, got 3"):
        mldebug.record(make_mlp(), run_dir=tmp_path, run="r", to=("tensorboard", 3))
    with mldebug.record(make_mlp(), run_dir=tmp_path, run="kept") as rec:
        train(rec.model, 2)
    kept = (tmp_path / "kept.sqlite").read_bytes()
    for module in ("wandb", "tensorboard", "torch.utils.tensorboard"):
        monkeypatch.setitem(sys.modules, module, None)     # `import` raises ImportError
    for to, extra in ((("tensorboard", tmp_path / "tb"), "tensorboard"), ("wandb", "wandb")):
        with pytest.raises(ImportError) as err:
            mldebug.record(make_mlp(), run_dir=tmp_path, run="kept", to=to)
        assert str(err.value) == (f"record(to='{extra}') needs the {extra} package: "
                                  f"pip install mldebug[{extra}]")
    assert (tmp_path / "kept.sqlite").read_bytes() == kept   # the earlier run, as it was
    assert mldebug.record.active_recorder() is None and not (tmp_path / "tb").exists()


WANDB_LIVE = """
import sys, torch, torch.nn as nn, wandb, mldebug
mode = sys.argv[1]
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
if mode == "theirs":
    run = wandb.init(name="users-run")
rec = mldebug.record(model, run_dir="runs", run="live", to="wandb")
for i in range(3):
    opt.zero_grad()
    loss = model(torch.randn(5, 8)).pow(2).mean()
    loss.backward()
    opt.step()
    mldebug.log_scalar("loss", loss)
    if mode == "theirs":
        wandb.log({"user/loss": loss.item()})
rec.close()
if mode == "theirs":
    print("still open:", wandb.run is not None and wandb.run.name)
    wandb.finish()
"""


@pytest.mark.parametrize("mode", ["own", "theirs"])
def test_a_live_copy_into_wandb_offline(tmp_path, mode):
    """No active run: mldebug starts one named after the recording (`log(step=)`); the
    user's active run: mldebug's keys over "mldebug/step", the user's own rows and run
    left to the user."""
    pytest.importorskip("wandb")
    env = clean_env(**wandb_env(tmp_path, WANDB_PROJECT="mldebug-tests"))
    out = _python(WANDB_LIVE.replace("sys.argv[1]", repr(mode)), tmp_path, env)
    assert out.returncode == 0, out.stderr
    [run_dir] = wandb_runs(tmp_path)
    records = wandb_records(run_dir, env)
    header = next(r["run"] for r in records if r["type"] == "run")
    assert header["display_name"] == ("live" if mode == "own" else "users-run")
    rows = [r["history"]["item"] for r in records if r["type"] == "history"]
    ours = [row for row in rows if "mldebug/0/output[0]/mean" in row]
    with open_run(tmp_path / "runs" / "live.sqlite") as run:
        stored = run.stats("0:output[0]")
        assert [row["mldebug/0/output[0]/mean"] for row in ours] == [r["mean"] for r in stored]
        step_of = (lambda row: row["_step"]) if mode == "own" else (
            lambda row: row["mldebug/step"])
        assert [step_of(row) for row in ours] == run.steps() == [0, 1, 2]
        losses = [row["mldebug/kpi/loss"] for row in rows if "mldebug/kpi/loss" in row]
        assert losses == [v for _, v in run.scalars()["loss"]]
    if mode == "theirs":
        assert len([row for row in rows if "user/loss" in row]) == 3
        assert "still open: users-run" in out.stdout


LIGHTNING = """
import sys, torch
from torch import nn
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
from mldebug.integrations.lightning import MLDebugCallback


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = ((self.net(x) - y) ** 2).mean()
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
if sys.argv[1] == "tensorboard":
    from lightning.pytorch.loggers import TensorBoardLogger
    logger = TensorBoardLogger("tb", name="exp")
else:
    from lightning.pytorch.loggers import WandbLogger
    logger = WandbLogger(name="lightning-run")
trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=logger, log_every_n_steps=1,
                    enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False,
                    callbacks=[MLDebugCallback(record=True, every=2, run="fit")])
trainer.fit(Model(), DataLoader(data, batch_size=16))
print("logdir", logger.log_dir if sys.argv[1] == "tensorboard" else logger.experiment.dir)
"""


def test_lightning_with_tensorboard_logger_gets_the_histograms_in_its_own_run(tmp_path):
    out = _python(LIGHTNING.replace("sys.argv[1]", "'tensorboard'"), tmp_path)
    assert out.returncode == 0, out.stderr
    logdir = tmp_path / "tb" / "exp" / "version_0"
    # one event file: the logger's own, holding Lightning's metrics and mldebug's
    assert [p.name.startswith("events.out.tfevents.") for p in logdir.iterdir()
            if "tfevents" in p.name] == [True]
    ea = tensorboard(logdir)
    assert [s for s, _ in tb_scalars(ea, "train_loss")] == [0, 1, 2, 3]
    assert check_tensorboard_has_the_run(ea, tmp_path / "runs" / "fit.sqlite") == [0, 2]


def test_lightning_with_wandb_logger_logs_over_the_trainers_step(tmp_path):
    pytest.importorskip("wandb")
    env = clean_env(**wandb_env(tmp_path))
    out = _python(LIGHTNING.replace("sys.argv[1]", "'wandb'"), tmp_path, env)
    assert out.returncode == 0, out.stderr
    [run_dir] = wandb_runs(tmp_path)
    rows = wandb_history(run_dir, env)
    ours = [row for row in rows if "mldebug/net.0/output[0]/mean" in row]
    with open_run(tmp_path / "runs" / "fit.sqlite") as run:
        assert [row["trainer/global_step"] for row in ours] == run.steps() == [0, 2]
        assert [row["mldebug/net.0/output[0]/mean"] for row in ours] == [
            r["mean"] for r in run.stats("net.0:output[0]")]
    assert any("train_loss" in row for row in rows)     # Lightning's own rows, same run


TRANSFORMERS = """
import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
from mldebug.integrations.transformers import MLDebugCallback


class Tokens(Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (16, 8), generator=torch.Generator().manual_seed(0))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2)
args = TrainingArguments(output_dir="out", per_device_train_batch_size=4, max_steps=3,
                         report_to="tensorboard", save_strategy="no", logging_steps=1,
                         disable_tqdm=True, use_cpu=True, seed=0)
trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=Tokens(),
                  callbacks=[MLDebugCallback(record=True, run="hf")])
trainer.train()
"""


def test_a_trainer_reporting_to_tensorboard_gets_the_histograms_in_its_run(tmp_path):
    out = _python(TRANSFORMERS, tmp_path)
    assert out.returncode == 0, out.stderr
    [logdir] = list((tmp_path / "out" / "runs").iterdir())   # the Trainer's own run
    ea = tensorboard(logdir)
    assert [s for s, _ in tb_scalars(ea, "train/loss")] == [1, 2, 3]
    assert check_tensorboard_has_the_run(ea, tmp_path / "runs" / "hf.sqlite") == [0, 1, 2]
