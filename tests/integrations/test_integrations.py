"""The framework callbacks, in runs launched by the framework itself (plain `python`, no
`python -m mldebug`), as a user who cannot change the entry point runs them: the
examples stop at their bug, in the user's method, with the framework's step; a clean
run with the callback computes the same bits as without it; `report=` writes the stops.
Without a terminal (a scheduler's job) a stop ends the fit with one StopError naming it."""
from __future__ import annotations

import io
import subprocess
import sys

import pytest

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
    # "prompt": commands piped in are read at the stop (a stdin that is not a terminal
    # ends the fit at the stop by default)
    batch = False if sys.argv[3:] == ["prompt"] else None


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
    callbacks = [] if mode == "plain" else [MLDebugCallback(report=report, batch=batch)]
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks)
    trainer.fit(model, DataLoader(data, batch_size=16))
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""


def _python(args, stdin="", **env):
    return subprocess.run([sys.executable, *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=clean_env(**env), timeout=300)


def _on_a_terminal(args, typed: str):
    """`python ARGS` in a pseudo-terminal, as a person runs it, with TYPED typed ahead:
    (exit status, all the terminal showed)."""
    pexpect = pytest.importorskip("pexpect")
    child = pexpect.spawn(sys.executable, [str(a) for a in args], env=clean_env(MLDEBUG_PLAIN="1"),
                          encoding="utf-8", timeout=300, dimensions=(40, 200))
    child.logfile_read = io.StringIO()
    child.send(typed)
    child.expect(pexpect.EOF)
    child.close()
    return child.exitstatus, child.logfile_read.getvalue().replace("\r\n", "\n")


def _without_a_terminal(args, **env):
    """`python ARGS` with stdin closed to input (/dev/null), as a scheduler runs a job."""
    return subprocess.run([sys.executable, *map(str, args)], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, env=clean_env(**env), timeout=300)


def _stop_line(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("mldebug: "))


def test_the_lightning_example_stops_in_training_step_at_its_step():
    example = EXAMPLES / "lightning_callback.py"
    status, screen = _on_a_terminal([example], "why\n" + "c\n" * 4)
    assert status == 0, screen
    line = marker_line(example, "the bug: log of 0")
    assert _stop_line(screen).startswith(
        f"mldebug: 1 -Inf from aten.log.default (torch.log) at lightning_callback.py:{line} "
        "[forward, step 3]")
    assert f"> {example}({line})training_step()" in screen
    assert "root cause: this op made the non-finite value from finite inputs" in screen
    assert "trained 8 steps" in screen                     # `c` ran the fit to its end


def test_the_transformers_example_stops_in_compute_loss_at_its_step():
    example = EXAMPLES / "transformers_callback.py"
    status, screen = _on_a_terminal([example], "c\n" * 6)
    assert status == 0, screen
    line = marker_line(example, "the bug: 0 / 0")
    assert _stop_line(screen).startswith(
        f"mldebug: 1 +Inf from aten.div.Tensor (torch.div) at transformers_callback.py:{line} "
        "[forward, step 2]")
    assert f"> {example}({line})compute_loss()" in screen
    assert "trained 4 steps" in screen


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
    buggy = _python([prog, "bug", report, "prompt"], stdin="c\n" * 6)
    first = read_report(report)[0]
    assert (first["reason"], first["stage"], first["step"]) == ("inf", "forward", 2)
    assert (first["file"], first["line"], first["function"]) == (str(prog), marker_line(prog),
                                                                 "training_step")
    assert "weights" in buggy.stdout                        # `c` goes on to the end


def _traceback_of_the_stop(stderr: str) -> list:
    """The lines stderr shows from the stop's report line on."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("mldebug: stop: "))
    return lines[start:]


def test_a_stop_in_a_lightning_run_without_a_terminal_ends_the_fit_with_one_clear_error(
        write_program, tmp_path):
    """A scheduler's job (stdin /dev/null): the stop's report line, then the fit ends with
    one StopError naming it, the program's own frames only (no BdbQuit, no 100 lines
    through Lightning's loops); the report file has the stop."""
    prog = write_program(LIGHTNING)
    report = tmp_path / "bug.jsonl"
    result = _without_a_terminal([prog, "bug", report])
    assert result.returncode == 1
    tail = _traceback_of_the_stop(result.stderr)
    assert tail[0].startswith("mldebug: stop: 3 +Inf and 13 -Inf from aten.div.Tensor "
                              f"(torch.div) at prog.py:{marker_line(prog)} [forward, step 2]")
    assert tail[1] == "Traceback (the program's frames, most recent call last):"
    assert f'File "{prog}", line {marker_line(prog)}, in training_step' in "\n".join(tail)
    error = [line for line in tail if line.startswith("mldebug.core.errors.StopError: ")]
    assert error == [f"mldebug.core.errors.StopError: {tail[0]}"]
    assert len(tail) <= 12, tail
    assert "BdbQuit" not in result.stderr and "lightning/pytorch" not in "\n".join(tail)
    assert "weights" not in result.stdout                   # the fit ended there
    (stop,) = read_report(report)
    assert (stop["reason"], stop["step"], stop["line"]) == ("inf", 2, marker_line(prog))


def test_batch_true_ends_the_fit_at_the_stop_even_with_commands_piped_in(write_program,
                                                                         tmp_path):
    prog = write_program(LIGHTNING.replace("batch = False if", "batch = True if"))
    result = _python([prog, "bug", tmp_path / "r.jsonl", "prompt"], stdin="c\n" * 6)
    assert result.returncode == 1
    assert "mldebug.core.errors.StopError: mldebug: stop: 3 +Inf" in result.stderr
    assert "(mldebug)" not in result.stdout and "weights" not in result.stdout


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

    mode, out = sys.argv[1], sys.argv[2]        # plain | clean | bug | raises | record; a folder
    batch = False if sys.argv[3:] == ["prompt"] else None     # (see LIGHTNING)


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
            if mode == "raises" and self.state.global_step == 2:
                weights = torch.log(loss - 100.0).expand(2)  # NaN made
                torch.multinomial(weights, 1)  # raises
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
        callbacks = [] if mode == "plain" else [MLDebugCallback(report=out + "/stops.jsonl",
                                                                batch=batch)]
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
    buggy = _python([prog, "bug", runs["bug"], "prompt"], stdin="c\n" * 6)
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


def test_a_stop_in_a_trainer_run_without_a_terminal_ends_training_with_one_clear_error(
        write_program, tmp_path):
    prog = write_program(TRANSFORMERS)
    result = _without_a_terminal([prog, "bug", tmp_path])
    assert result.returncode == 1
    tail = _traceback_of_the_stop(result.stderr)
    assert tail[0].startswith("mldebug: stop: 1 NaN from aten.log.default (torch.log) at "
                              f"prog.py:{marker_line(prog)} [forward, step 2]")
    assert f'File "{prog}", line {marker_line(prog)}, in compute_loss' in "\n".join(tail)
    assert f"mldebug.core.errors.StopError: {tail[0]}" in tail
    assert len(tail) <= 12, tail
    assert "BdbQuit" not in result.stderr and "transformers/" not in "\n".join(tail)
    assert "weights" not in result.stdout
    (stop,) = read_report(tmp_path / "stops.jsonl")
    assert (stop["reason"], stop["step"]) == ("nan", 2)


@pytest.mark.parametrize("path", ["cpu", "device"])
def test_a_nan_that_makes_the_trainer_raise_is_the_stop_on_both_paths(write_program,
                                                                      tmp_path, path):
    """A NaN the loss code makes, then an error it leads to (`torch.multinomial` of NaN
    weights) before the step's read: on a device (the CPU standing in) the watch holds the
    NaN until the read, and the Trainer has no exception callback; the error leaving the
    program is where it is read (the callback's sys.excepthook). Both paths stop at the
    log's line, not the error's; the device path's stop names the error it led to."""
    prog = write_program(TRANSFORMERS)
    device = {"MLDEBUG_SIMULATE_DEVICE": "1"} if path == "device" else {}
    result = _without_a_terminal([prog, "raises", tmp_path], **device)
    assert result.returncode == 1
    tail = _traceback_of_the_stop(result.stderr)
    assert tail[0].startswith("mldebug: stop: 1 NaN from aten.log.default (torch.log) at "
                              f"prog.py:{marker_line(prog, '# NaN made')} [forward, step 2]"), result.stderr
    raised = marker_line(prog, "# raises")
    then = ("then: RuntimeError: probability tensor contains either `inf`, `nan` or element "
            f"< 0 at prog.py:{raised}")
    assert (then in tail[0]) == (path == "device"), tail[0]
    assert [line for line in tail if line.startswith("mldebug.core.errors.StopError: ")] == [
        f"mldebug.core.errors.StopError: {tail[0]}"]
    assert "BdbQuit" not in result.stderr and "Error in sys.excepthook" not in result.stderr
    (stop,) = read_report(tmp_path / "stops.jsonl")
    assert (stop["reason"], stop["op"], stop["line"], stop["step"]) == (
        "nan", "aten.log.default", marker_line(prog, "# NaN made"), 2)
    if path == "device":
        # at a prompt (commands piped in): paused where the error was raised, its locals
        # there; `c` then reports the error itself
        shown = _python([prog, "raises", tmp_path, "prompt"], stdin="p weights\nc\n",
                        **device)
        assert shown.returncode == 1
        assert f"paused at prog.py:{raised}, where the exception it led to" in shown.stdout
        assert "tensor([nan, nan]" in shown.stdout
        assert shown.stderr.rstrip().endswith(
            "RuntimeError: probability tensor contains either `inf`, `nan` or element < 0")



def test_training_on_another_thread_installs_no_exception_hook():
    """The Trainer callback's read before an uncaught exception is a `sys.excepthook`,
    which runs for the main thread's errors: a wiring started on another thread
    (training in a web app's worker) installs none, so an error of the main thread
    cannot end the training's watch. On the main thread it is there while the wiring
    runs, and close() removes it."""
    import threading
    from mldebug.integrations.wiring import Wiring
    before, seen = sys.excepthook, []

    def train():
        wiring = Wiring(batch=True)
        wiring.start(None)
        try:
            wiring.read_before_uncaught()
            seen.append(sys.excepthook is before)
        finally:
            wiring.close()

    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
    assert seen == [True]
    wiring = Wiring(batch=True)
    wiring.start(None)
    try:
        wiring.read_before_uncaught()
        assert sys.excepthook is not before
    finally:
        wiring.close()
    assert sys.excepthook is before
