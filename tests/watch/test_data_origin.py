"""A NaN that came in with the data is named by its sample: the variable at the user's
line where the batch enters the model, the rows of the batch, and the dataset indices of
those rows — through real DataLoaders (workers, shuffling, custom collate, dicts) driven
by the CLI as a user runs it."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from conftest import clean_env, marker_line, read_report, run_cli

# The label of every record is its own index, so at a stop `y[rows]` tells, independently
# of mldebug, which dataset indices the bad rows are.
PROGRAM = """
    import sys
    from collections import namedtuple

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    KIND = sys.argv[1]          # tuple | dict | dict-collate | namedtuple-collate
    WORKERS = int(sys.argv[2])
    CLEAN = sys.argv[3:] == ["clean"]           # the corrupt record replaced
    Batch = namedtuple("Batch", "pixels label")


    class Records(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(200, 8, generator=g)
            if not CLEAN:
                # one corrupt record, as a file holds it (`x[77, 3] = nan` would be a
                # NaN the program writes on purpose: no stop there, see marks.py)
                self.x.numpy()[77, 3] = float("nan")

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            y = torch.tensor([float(i)])
            if KIND.startswith("dict"):
                return {"pixel_values": self.x[i], "label": y}
            return self.x[i], y


    def collate(items):          # a custom collate_fn returning a dict
        return {key: torch.stack([item[key] for item in items]) for key in items[0]}


    def collate_namedtuple(items):       # one returning a namedtuple
        return Batch(torch.stack([x for x, _ in items]), torch.stack([y for _, y in items]))


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 1)

        def forward(self, x):
            return self.fc2(torch.relu(self.fc1(x)))


    def train_step(model, opt, batch):
        pred = model(batch["pixel_values"])  # here dict
        loss = nn.functional.mse_loss(pred, batch["label"] * 0)
        opt.zero_grad()
        loss.backward()
        opt.step()


    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    collate_fn = {"dict-collate": collate, "namedtuple-collate": collate_namedtuple}
    loader = DataLoader(Records(), batch_size=16, shuffle=True, num_workers=WORKERS,
                        collate_fn=collate_fn.get(KIND))
    for epoch in range(2):
        for batch in loader:
            if KIND.startswith("dict"):
                train_step(model, opt, batch)
                continue
            if KIND == "namedtuple-collate":
                pred = model(batch.pixels)  # here namedtuple
                loss = nn.functional.mse_loss(pred, batch.label * 0)
                opt.zero_grad()
                loss.backward()
                opt.step()
                continue
            x, y = batch
            pred = model(x)  # here tuple
            loss = nn.functional.mse_loss(pred, y * 0)
            opt.zero_grad()
            loss.backward()
            opt.step()
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""


def test_a_corrupt_record_is_named_by_its_dataset_index_through_workers_and_shuffling(
        write_program, tmp_path):
    prog = write_program(PROGRAM)
    report = tmp_path / "r.jsonl"
    # at the stop, the user checks the rows by hand: which rows hold a NaN, and their labels
    commands = ("why\n"
                "p 'rows', x.isnan().any(1).nonzero().flatten().tolist()\n"
                "p 'labels', y[x.isnan().any(1)].flatten().tolist()\n"
                "q\n")
    r = run_cli(["--report", str(report), str(prog), "tuple", "2"], stdin=commands,
                timeout=180)
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", False)
    # it stops at the line where the batch enters the model, not inside Net.forward
    assert (stop["file"], stop["line"], stop["function"]) == (
        str(prog), marker_line(prog, "# here tuple"), "<module>")
    rows = re.search(r"\('rows', (\[[\d, ]*\])\)", r.stdout).group(1)
    assert stop["data"] == {"variable": "x", "rows": json.loads(rows), "dataset_indices": [77]}
    assert "('labels', [77.0])" in r.stdout
    assert re.search(r"in the data: x row \d+ \(dataset index 77\)", stop["message"])
    # `why` says it came in with the data, and which sample
    assert re.search(r"it came in with the data: x row \d+ \(dataset index 77\)", r.stdout)


@pytest.mark.parametrize("kind", ["dict", "dict-collate"])
def test_a_dict_batch_names_its_key_at_the_users_step_function(write_program, tmp_path, kind):
    prog = write_program(PROGRAM)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog), kind, "2"], timeout=180)
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"]) == ("nan", "forward")
    assert (stop["file"], stop["line"], stop["function"]) == (
        str(prog), marker_line(prog, "# here dict"), "train_step")
    data = stop["data"]
    assert data["variable"] == "batch['pixel_values']"
    assert data["dataset_indices"] == [77] and len(data["rows"]) == 1
    assert "in the data: batch['pixel_values'] row" in r.stderr


def test_without_workers_too_and_a_copy_to_another_dtype_is_still_the_batch(
        write_program, tmp_path):
    # the model runs in float64: `x.double()` is a copy, matched by its NaN positions
    source = PROGRAM.replace("pred = model(x)  # here tuple",
                             "model.double()\n            pred = model(x.double()).float()  # here tuple")
    prog = write_program(source)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog), "tuple", "0"], timeout=180)
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog, "# here tuple"))
    assert stop["data"]["variable"] is None or stop["data"]["variable"] == "x"
    assert stop["data"]["dataset_indices"] == [77]


def test_a_custom_collate_returning_a_namedtuple_names_its_field(write_program, tmp_path):
    prog = write_program(PROGRAM)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog), "namedtuple-collate", "2"],
                timeout=180)
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"]) == ("nan", "forward")
    assert (stop["file"], stop["line"], stop["function"]) == (
        str(prog), marker_line(prog, "# here namedtuple"), "<module>")
    data = stop["data"]
    assert data["variable"] == "batch.pixels"
    assert data["dataset_indices"] == [77] and len(data["rows"]) == 1
    assert "in the data: batch.pixels row" in r.stderr


@pytest.mark.parametrize("kind", ["tuple", "dict", "dict-collate", "namedtuple-collate"])
def test_without_the_corrupt_record_the_run_is_untouched(write_program, tmp_path, kind):
    """The same loaders with record 77 left finite: no stop, and the bookkeeping changes
    no bit (the same shuffled order through the workers, the same weights)."""
    prog = write_program(PROGRAM)
    args = [str(prog), kind, "2", "clean"]
    plain = subprocess.run([sys.executable, *args], capture_output=True, text=True,
                           env=clean_env(), timeout=180)
    assert plain.returncode == 0, plain.stderr
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), *args], timeout=180)
    assert r.returncode == 0, r.stderr
    assert read_report(report) == []
    assert r.stdout.splitlines()[-1] == plain.stdout.splitlines()[-1]     # the same bits
    assert r.stdout.splitlines()[-1].startswith("weights [") and "nan" not in r.stdout


ITERABLE = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset


    class Stream(IterableDataset):          # no dataset indices: only rows
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for i in range(200):
                x = torch.randn(8, generator=g)
                if i == 77:
                    x.numpy()[3] = float("nan")   # one corrupt record, row 13 of batch 4
                yield x, torch.tensor([float(i)])


    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    for x, y in DataLoader(Stream(), batch_size=16):
        pred = model(x)  # here
        pred.pow(2).mean().backward()
"""


def test_an_iterable_dataset_names_the_row_and_no_dataset_index(write_program, tmp_path):
    # its sampler yields None for every sample: that is no index ('dataset index None')
    prog = write_program(ITERABLE)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog)], timeout=180)
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", False)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog))
    assert stop["data"] == {"variable": "x", "rows": [13], "dataset_indices": None}
    assert stop["message"].split("; hint: ")[0].endswith("in the data: x row 13")


CHECKPOINT = """
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.numpy()[0, 0] = float("nan")   # a corrupt checkpoint, not the data
    w = model.weight
    x = torch.randn(3, 4)
    model(x)  # here
"""


def test_a_corrupt_parameter_is_no_data(write_program, tmp_path):
    prog = write_program(CHECKPOINT)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog)])
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert stop["created"] is False and stop["data"] is None
    assert "in the data" not in stop["message"]


def test_a_nan_made_by_an_op_is_no_data(write_program, tmp_path):
    prog = write_program("""
        import torch
        x = -torch.ones(4)
        y = torch.log(x)  # here
    """)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--report", str(report), str(prog)])
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert stop["created"] is True and stop["data"] is None


def test_the_bookkeeping_is_installed_only_while_a_watch_runs():
    from torch.utils.data import dataloader

    import mldebug
    from mldebug.watch import data_origin
    base = dataloader._BaseDataLoaderIter
    torch_own = (base.__next__, base._next_index, base._reset)
    data = TensorDataset(torch.arange(40.).reshape(20, 2))
    with mldebug.watch(action="raise"):
        assert base.__next__ is not torch_own[0]
        batches = list(DataLoader(data, batch_size=8, shuffle=True))
        noted = list(data_origin._ring)[-3:]
        for batch, note in zip(batches, noted):
            # the indices noted are the rows' own (each row holds 2*index, 2*index+1)
            assert [int(v) // 2 for v in batch[0][:, 0]] == note.indices
            assert note.tensors[0][1]() is batch[0]          # a reference, not a copy
    assert (base.__next__, base._next_index, base._reset) == torch_own
    assert not data_origin._ring


def test_an_iterator_with_workers_started_before_the_watch_gets_no_indices():
    import mldebug
    from mldebug.watch import data_origin
    data = TensorDataset(torch.arange(40.).reshape(20, 2))
    it = iter(DataLoader(data, batch_size=4, shuffle=True, num_workers=2))
    first = next(it)
    with mldebug.watch(action="raise"):
        second = next(it)          # its indices were drawn (prefetched) before the watch
        (note,) = list(data_origin._ring)
        assert note.indices is None and note.tensors[0][1]() is second[0]
    del first, it


LIGHTNING = """
    import torch
    from torch import nn
    import lightning as L
    from torch.utils.data import DataLoader, Dataset


    class Records(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(128, 4, generator=g)
            self.x.numpy()[77, 1] = float("inf")      # one corrupt record (an Inf)

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return self.x[i], torch.zeros(1)


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)  # here
            return ((out - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    if __name__ == "__main__":
        torch.manual_seed(0)
        trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Model(), DataLoader(Records(), batch_size=16, shuffle=True, num_workers=2))
"""


def test_lightning_with_workers_names_the_sample_in_training_step(write_program, tmp_path):
    """Lightning fetches a batch ahead and moves it to the device: the sample is still
    named, at the user's `training_step` line."""
    pytest.importorskip("lightning")
    prog = write_program(LIGHTNING)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--batch", "--break-on", "nan,inf-all", "--report", str(report), str(prog)],
                timeout=300)
    assert r.returncode == 3, r.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"]) == ("inf", "forward")
    assert (stop["line"], stop["function"]) == (marker_line(prog), "training_step")
    assert stop["data"]["variable"] == "x" and stop["data"]["dataset_indices"] == [77]


HF_TRAINER = """
    import sys
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainingArguments


    class Records(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.x = torch.randn(200, 8, generator=g)
            self.x.numpy()[77, 3] = float("nan")      # one corrupt record

        def __len__(self):
            return len(self.x)

        def __getitem__(self, i):
            return {"features": self.x[i], "labels": torch.tensor([float(i)])}


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 1)

        def forward(self, features, labels):
            pred = self.fc(features)  # here
            return {"loss": nn.functional.mse_loss(pred, labels * 0)}


    torch.manual_seed(0)
    args = TrainingArguments(output_dir=sys.argv[0] + ".out", per_device_train_batch_size=16,
                             num_train_epochs=1, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=True, use_cpu=True, seed=0,
                             dataloader_num_workers=2)
    Trainer(model=Net(), args=args, train_dataset=Records()).train()
"""


def test_hugging_face_trainer_with_workers_names_the_sample_in_the_models_forward(
        write_program, tmp_path):
    """The Trainer's loader (accelerate's wrapper, shuffled, 2 workers) hands the dict to
    the model as keyword arguments: the sample is named by the parameter's name."""
    pytest.importorskip("transformers")
    prog = write_program(HF_TRAINER)
    report = tmp_path / "r.jsonl"
    r = run_cli(["--report", str(report), str(prog)],
                stdin="p 'labels', labels[features.isnan().any(1)].flatten().tolist()\nq\n",
                timeout=300)
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", False)
    assert (stop["file"], stop["line"], stop["function"]) == (str(prog), marker_line(prog),
                                                              "forward")
    assert stop["data"]["variable"] == "features" and stop["data"]["dataset_indices"] == [77]
    assert "('labels', [77.0])" in r.stdout            # the row's own label says 77 too
