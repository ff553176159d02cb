"""Framework training loops through the CLI as a user runs them: the model run inside the
optimizer step (a closure: LBFGS, Lightning's automatic optimization) and Hugging Face's
Trainer (a tiny GPT-2 from a config). A clean run computes the same bits as without
mldebug and stops nowhere; a planted Inf in the user's code is a *forward* stop at the
user's line (not an optimizer one, not inside the framework)."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env, marker_line, read_report, run_cli

LBFGS = """
    import sys
    import torch
    from torch import nn

    bug = len(sys.argv) > 1
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1, max_iter=3)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    for step in range(3):
        def closure():
            opt.zero_grad()
            out = model(x)
            if bug and step == 2:
                out = out / torch.zeros_like(out)  # here
            loss = ((out - y) ** 2).mean()
            loss.backward()
            return loss
        opt.step(closure)
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""

LIGHTNING = """
    import sys
    import torch
    from torch import nn
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    bug = len(sys.argv) > 1


    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))

        def training_step(self, batch, batch_idx):
            x, y = batch
            out = self.net(x)
            if bug and self.global_step == 2:
                out = out / torch.zeros_like(out)  # here
            return ((out - y) ** 2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    model = Model()
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(model, DataLoader(data, batch_size=16))
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""


# trainer.fit(torch.compile(model)): Lightning compiles the module's training_step (a
# bound method) with the module's dynamo context; no module hook runs inside it
LIGHTNING_COMPILED = LIGHTNING.replace(
    "out = out / torch.zeros_like(out)  # here", "out = out / torch.zeros_like(out)  # the bug"
).replace("trainer.fit(model, DataLoader(data, batch_size=16))",
          "trainer.fit(torch.compile(model), DataLoader(data, batch_size=16))  # here")


HF_TRAINER = """
    import sys
    import torch
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    bug = len(sys.argv) > 1


    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 64, (16, 12), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}


    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            out = model(**inputs)
            loss = out.loss
            if bug and self.state.global_step == 1:
                loss = loss / torch.zeros_like(loss)  # here
            return (loss, out) if return_outputs else loss


    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(output_dir=sys.argv[0] + ".out", per_device_train_batch_size=4,
                             max_steps=3, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0, data_seed=0)
    MyTrainer(model=model, args=args, train_dataset=Tokens()).train()
    print("weights", sum(p.detach().double().sum().item() for p in model.parameters()).hex())
"""


CHECKPOINTED_BF16 = """
    import sys
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    bug = len(sys.argv) > 1
    torch.manual_seed(0)


    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            if bug:
                h = torch.log(h - 100.0)  # here
            return h.relu()


    blocks = nn.ModuleList([Block() for _ in range(3)])
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    x = torch.randn(4, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = x
        for b in blocks:
            h = checkpoint(b, h, use_reentrant=False)
        loss = h.float().pow(2).mean()
    loss.backward()
    opt.step()
    print("weights", [p.detach().double().sum().item().hex() for p in blocks.parameters()])
"""


def _plain(prog, *args) -> str:
    result = subprocess.run([sys.executable, str(prog), *args], capture_output=True, text=True,
                            env=clean_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    return result.stdout


def _same_bits(watched: str, plain: str, prog, *args, lines: int = 1) -> None:
    """The last LINES of the watched run's output (its weights, printed in hex) are the
    plain run's. The plain program on this CPU is not always bitwise reproducible itself
    (once in many runs, on a busy 2-core machine, a plain run of the reentrant
    checkpointing program printed other last bits): on a mismatch the plain program runs
    again, and the watched run must equal one of the two. A change the watch makes is
    not hidden by that: it differs from both."""
    last = watched.splitlines()[-lines:]
    if last == plain.splitlines()[-lines:]:
        return
    again = _plain(prog, *args).splitlines()[-lines:]
    assert last == again, (f"the watched run computed other bits: {last}; two plain runs: "
                           f"{plain.splitlines()[-lines:]}, {again}")


def _clean_and_planted(prog, tmp_path, function):
    plain = _plain(prog)
    report = tmp_path / "clean.jsonl"
    clean = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert clean.returncode == 0, clean.stderr
    assert read_report(report) == []
    _same_bits(clean.stdout, plain, prog)
    report = tmp_path / "bug.jsonl"
    buggy = run_cli(["--batch", "--report", str(report), str(prog), "bug"], timeout=300)
    assert buggy.returncode == 3, buggy.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["op"]) == ("inf", "forward", "aten.div.Tensor")
    assert (stop["file"], stop["line"], stop["function"]) == (str(prog), marker_line(prog),
                                                              function)
    assert "weights" not in buggy.stdout


def test_an_lbfgs_closure_runs_forward_and_backward_not_optimizer(write_program, tmp_path):
    _clean_and_planted(write_program(LBFGS), tmp_path, "closure")


def test_lightning_training_step_inside_the_optimizer_closure(write_program, tmp_path):
    _clean_and_planted(write_program(LIGHTNING), tmp_path, "training_step")


def test_lightning_with_a_compiled_module_checks_the_compiled_training_step(write_program,
                                                                          tmp_path):
    """The Inf made inside the compiled training_step is a forward stop at its step, at
    the user's line that runs it (trainer.fit), naming training_step (it was first seen
    in the compiled backward, as NaN 'made from finite inputs' by aten.mm.out)."""
    prog = write_program(LIGHTNING_COMPILED)
    plain = _plain(prog)
    report = tmp_path / "clean.jsonl"
    clean = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert clean.returncode == 0, clean.stderr
    assert read_report(report) == []
    _same_bits(clean.stdout, plain, prog)
    report = tmp_path / "bug.jsonl"
    buggy = run_cli(["--batch", "--report", str(report), str(prog), "bug"], timeout=300)
    assert buggy.returncode == 3, buggy.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["step"], stop["created"]) == (
        "inf", "forward", 2, True)
    assert (stop["file"], stop["line"]) == (str(prog), marker_line(prog))
    assert stop["message"].startswith("1 +Inf in training_step() at prog.py:")
    # on a GPU's path (read later, not at each op) the same one stop: the extern kernels
    # that compiled code runs through the per-op check (addmm.out into a buffer a fused
    # kernel then writes) are not held for the later read
    report = tmp_path / "device.jsonl"
    device = run_cli(["--batch", "--report", str(report), str(prog), "bug"], timeout=300,
                     env=clean_env(MLDEBUG_SIMULATE_DEVICE="1"))
    assert device.returncode == 3, device.stderr
    assert [(s["reason"], s["stage"], s["step"], s["line"]) for s in read_report(report)] == [
        ("inf", "forward", 2, marker_line(prog))]


def test_hugging_face_trainer_with_a_custom_compute_loss(write_program, tmp_path):
    _clean_and_planted(write_program(HF_TRAINER), tmp_path, "compute_loss")


def test_gradient_checkpointing_under_bf16_autocast(write_program, tmp_path):
    prog = write_program(CHECKPOINTED_BF16)
    plain = _plain(prog)
    clean = run_cli(["--batch", str(prog)], timeout=300)
    assert clean.returncode == 0, clean.stderr
    _same_bits(clean.stdout, plain, prog)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--report", str(report), str(prog), "bug"], stdin="c\n" * 8,
                     timeout=300)
    first = read_report(report)[0]
    assert (first["reason"], first["stage"], first["op"]) == ("nan", "forward",
                                                              "aten.log.default")
    assert (first["file"], first["line"]) == (str(prog), marker_line(prog))
    # the watch's re-run that pinned the op saved nothing into the checkpoint's count:
    # after `c`, the backward recomputes the blocks as it would without mldebug
    assert "CheckpointError" not in result.stdout + result.stderr
    assert "weights" in result.stdout
    # and what the recomputation makes again (the NaN, what flows from it into the next
    # blocks) is the first stop's: no new stop in backward, none after
    assert [s["stage"] for s in read_report(report)] == ["forward"]


# Hugging Face's own gradient checkpointing (`model.gradient_checkpointing_enable()`, torch's
# non-reentrant checkpoint around each GPT-2 block) through the Trainer: the user's module
# in the last block runs twice a step (forward, then recomputed in backward)
HF_CHECKPOINTED = """
    import sys
    import torch
    from torch import nn
    from torch.utils.data import Dataset
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    bug = sys.argv[1] if sys.argv[1:2] != ["clean"] else None      # clean | loss | block
    reentrant = sys.argv[2:] == ["reentrant"]       # torch's reentrant checkpoint instead
    CALLS = []


    class Tokens(Dataset):
        def __init__(self):
            g = torch.Generator().manual_seed(0)
            self.ids = torch.randint(0, 64, (16, 12), generator=g)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}


    class MyMLP(nn.Module):
        def __init__(self, mlp):
            super().__init__()
            self.mlp = mlp

        def forward(self, h):
            CALLS.append(torch.is_grad_enabled())
            out = self.mlp(h)
            if bug == "block" and STEP[0] == 2:
                out = torch.log(out - 100.0)  # here block
            return out


    class MyTrainer(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
            STEP[0] = self.state.global_step
            out = model(**inputs)
            loss = out.loss
            if bug == "loss" and self.state.global_step == 2:
                loss = torch.log(loss - 100.0)  # here loss
            return (loss, out) if return_outputs else loss


    STEP = [0]
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = GPT2LMHeadModel(config)
    model.transformer.h[1].mlp = MyMLP(model.transformer.h[1].mlp)
    if reentrant:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    else:
        model.gradient_checkpointing_enable()           # transformers' default: non-reentrant
    args = TrainingArguments(output_dir=sys.argv[0] + ".out", per_device_train_batch_size=4,
                             max_steps=3, report_to=[], save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, use_cpu=True, seed=0, data_seed=0)
    MyTrainer(model=model, args=args, train_dataset=Tokens()).train()
    print("checkpointing", model.is_gradient_checkpointing, "calls", len(CALLS))
    print("weights", sum(p.detach().double().sum().item() for p in model.parameters()).hex())
"""


@pytest.mark.parametrize("kind", ["default", "reentrant"])
def test_hugging_face_gradient_checkpointing_through_the_trainer_is_clean(write_program,
                                                                         tmp_path, kind):
    prog = write_program(HF_CHECKPOINTED)
    plain = _plain(prog, "clean", kind)
    # the blocks are recomputed: the user's module runs twice in each of the 3 steps
    assert "checkpointing True calls 6" in plain
    report = tmp_path / "clean.jsonl"
    clean = run_cli(["--batch", "--report", str(report), str(prog), "clean", kind],
                    timeout=300)
    assert clean.returncode == 0, clean.stderr
    assert read_report(report) == []
    _same_bits(clean.stdout, plain, prog, "clean", kind, lines=2)


@pytest.mark.parametrize("where,kind,function", [
    ("loss", "default", "compute_loss"),
    # made in the first forward, made again when backward recomputes the block
    ("block", "default", "forward"), ("block", "reentrant", "forward")])
def test_hugging_face_gradient_checkpointing_reports_a_nan_once(write_program, tmp_path,
                                                               where, kind, function):
    prog = write_program(HF_CHECKPOINTED)
    report = tmp_path / "r.jsonl"
    # `c` at every prompt: the run goes on through the recomputation to its end
    result = run_cli(["--report", str(report), str(prog), where, kind], stdin="c\n" * 8,
                     timeout=300)
    assert result.returncode == 0, result.stderr
    (stop,) = read_report(report)                       # once: not again in backward
    assert (stop["reason"], stop["stage"], stop["op"], stop["step"]) == ("nan", "forward",
                                                                         "aten.log.default", 2)
    assert (stop["file"], stop["line"], stop["function"]) == (
        str(prog), marker_line(prog, f"# here {where}"), function)
    assert result.stdout.count("(mldebug) ") == 1
    assert "weights" in result.stdout and "CheckpointError" not in result.stderr
