"""The framework callbacks, in runs launched by the framework itself (plain `python`, no
`python -m mldebug`), as a user who cannot change the entry point runs them: the
examples stop at their bug, in the user's method, with the framework's step; a clean
run with the callback computes the same bits as without it; `report=` writes the stops."""
from __future__ import annotations

import subprocess
import sys

from conftest import REPO, clean_env, marker_line, read_report

EXAMPLES = REPO / "examples"

LIGHTNING = """
    import sys
    import torch
    from torch import nn
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from mldebug.integrations.lightning import MLDebugCallback

    mode, report = sys.argv[1], sys.argv[2]


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            if mode == "bug" and self.global_step == 2:
                out = out / torch.zeros_like(out)  # here
            return ((out - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model = Model()
    callbacks = [] if mode == "plain" else [MLDebugCallback(report=report)]
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=16))
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""


def _python(args, stdin=""):
    return subprocess.run([sys.executable, *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=clean_env(), timeout=300)


def _stop_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("mldebug: "))


def test_the_lightning_example_stops_in_training_step_at_its_step():
    example = EXAMPLES / "lightning_callback.py"
    result = _python([example], stdin="why\n" + "c\n" * 4)
    assert result.returncode == 0, result.stderr
    line = marker_line(example, "the bug: log of 0")
    assert _stop_line(result.stdout).startswith(
        f"mldebug: 1 -Inf from aten.log.default (torch.log) at lightning_callback.py:{line} "
        "[forward, step 3]")
    assert f"> {example}({line})training_step()" in result.stdout
    assert "root cause: this op made the non-finite value from finite inputs" in result.stdout
    assert "trained 8 steps" in result.stdout              # `c` ran the fit to its end


def test_the_transformers_example_stops_in_compute_loss_at_its_step():
    example = EXAMPLES / "transformers_callback.py"
    result = _python([example], stdin="c\n" * 6)
    assert result.returncode == 0, result.stderr
    line = marker_line(example, "the bug: 0 / 0")
    assert _stop_line(result.stdout).startswith(
        f"mldebug: 1 +Inf from aten.div.Tensor (torch.div) at transformers_callback.py:{line} "
        "[forward, step 2]")
    assert f"> {example}({line})compute_loss()" in result.stdout
    assert "trained 4 steps" in result.stdout


def test_the_lightning_callback_changes_no_bit_and_reports_its_stops(write_program, tmp_path):
    prog = write_program(LIGHTNING)
    plain = _python([prog, "plain", tmp_path / "none.jsonl"])
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "clean.jsonl"
    clean = _python([prog, "clean", report])
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]    # the same bits
    assert not report.exists() or read_report(report) == []
    report = tmp_path / "bug.jsonl"
    buggy = _python([prog, "bug", report], stdin="c\n" * 6)
    first = read_report(report)[0]
    assert (first["reason"], first["stage"], first["step"]) == ("inf", "forward", 2)
    assert (first["file"], first["line"], first["function"]) == (str(prog), marker_line(prog),
                                                                 "training_step")
    assert "weights" in buggy.stdout                        # `c` goes on to the end


RESUMED = """
    import sys
    import torch
    from torch import nn
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset
    from mldebug.integrations.lightning import MLDebugCallback


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return ((self.net(x) - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    common = dict(accelerator="cpu", logger=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir=sys.argv[1])
    first = L.Trainer(max_steps=3, **common)
    first.fit(Model(), data)
    first.save_checkpoint(sys.argv[1] + "/at3.ckpt")
    second = L.Trainer(max_steps=6, callbacks=[MLDebugCallback(record=True, every=1,
                       run_dir=sys.argv[1], run="resumed")], **common)
    second.fit(Model(), data, ckpt_path=sys.argv[1] + "/at3.ckpt")
"""


def test_a_recording_started_by_the_callback_numbers_steps_from_the_global_step(
        write_program, tmp_path):
    prog = write_program(RESUMED)
    result = _python([prog, tmp_path])
    assert result.returncode == 0, result.stderr
    import mldebug
    with mldebug.record.open_run(str(tmp_path / "resumed.sqlite")) as run:
        assert run.steps() == [3, 4, 5]            # the resumed run's own global steps


TRANSFORMERS = """
    import sys
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
    from mldebug.integrations.transformers import MLDebugCallback

    mode, out = sys.argv[1], sys.argv[2]        # plain | clean | bug | record; a folder


    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 64, (32, 12), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}


    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            out = model(**inputs)
            loss = out.loss
            if mode == "bug" and self.state.global_step == 2:
                loss = torch.log(loss - 100.0)  # here
            return (loss, out) if return_outputs else loss


    def trainer(max_steps, callbacks, **more):
        args = TrainingArguments(output_dir=out + "/hf", per_device_train_batch_size=4,
                                 max_steps=max_steps, report_to=[], logging_strategy="no",
                                 disable_tqdm=True, use_cpu=True, seed=0, data_seed=0, **more)
        return MyTrainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)


    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    if mode == "record":
        # 3 steps and a checkpoint; resumed to 7 steps, the callback recording every 2nd
        trainer(3, [], save_strategy="steps", save_steps=3).train()
        trainer(7, [MLDebugCallback(record=True, every=2, run_dir=out, run="resumed")],
                save_strategy="no").train(resume_from_checkpoint=out + "/hf/checkpoint-3")
    else:
        callbacks = [] if mode == "plain" else [MLDebugCallback(report=out + "/stops.jsonl")]
        trainer(4, callbacks, save_strategy="no").train()
    print("weights", sum(p.detach().double().sum().item() for p in model.parameters()).hex())
"""


def test_the_transformers_callback_changes_no_bit_and_reports_its_stops(write_program,
                                                                       tmp_path):
    prog = write_program(TRANSFORMERS)
    runs = {mode: tmp_path / mode for mode in ("plain", "clean", "bug")}
    for folder in runs.values():
        folder.mkdir()
    plain = _python([prog, "plain", runs["plain"]])
    assert plain.returncode == 0, plain.stderr
    clean = _python([prog, "clean", runs["clean"]])
    assert clean.returncode == 0, clean.stderr
    assert clean.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]    # the same bits
    assert "mldebug: " not in clean.stdout + clean.stderr
    report = runs["clean"] / "stops.jsonl"
    assert not report.exists() or read_report(report) == []
    buggy = _python([prog, "bug", runs["bug"]], stdin="c\n" * 6)
    assert buggy.returncode == 0, buggy.stderr
    (stop,) = read_report(runs["bug"] / "stops.jsonl")
    # the Trainer's global step, in the user's compute_loss
    assert (stop["reason"], stop["stage"], stop["op"], stop["step"]) == (
        "nan", "forward", "aten.log.default", 2)
    assert (stop["file"], stop["line"], stop["function"]) == (str(prog), marker_line(prog),
                                                              "compute_loss")
    assert "weights" in buggy.stdout                        # `c` goes on to the end


def test_a_recording_started_by_the_transformers_callback_counts_global_steps(
        write_program, tmp_path):
    prog = write_program(TRANSFORMERS)
    result = _python([prog, "record", tmp_path])
    assert result.returncode == 0, result.stderr
    import mldebug
    with mldebug.record.open_run(str(tmp_path / "resumed.sqlite")) as run:
        # the resumed run's global steps are 3..6; every=2 records 4 and 6
        assert run.steps() == [4, 6]
