"""A stop says the same on a GPU as on a CPU: every stop program of the suite, run
through the CLI (`--batch --report`) on the CPU path and on the device path (what a GPU
runs: `MLDEBUG_SIMULATE_DEVICE=1`, checks read late, at the step's read), names the same
first stop: its `reason`, `file`, `line`, `stage`, `op`, `module` and `data`. Where the
program must pause later on a device, the report says where in `pause_file`/`pause_line`.

Where the two must differ for a program, WHY_THEY_DIFFER says which field and why.
"""
from __future__ import annotations

import ast
import json
import os
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import REPO, TESTS, clean_env, marker_line, run_cli

KEYS = ("reason", "file", "line", "stage", "op", "module", "data")

# the programs that run clean (other tests hold that they do, on both paths)
CLEAN = {"healthy.py", "healthy_train.py", "causal_mask_ok.py"}
# programs on disk: (path, argv)
ON_DISK = sorted(
    [(p, ()) for folder in (REPO / "examples", TESTS / "programs", TESTS / "programs_assert")
     for p in folder.glob("*.py") if p.name not in CLEAN]
    + [(TESTS / "programs_dap" / n, ()) for n in ("nan_model.py", "nan_step.py", "raises.py")])
# the CLI's, the watch's and the frameworks' stop programs written in their test files:
# (file, constant, argv)
INLINE = [
    (TESTS / "cli" / "test_cli.py", "NAN_PROGRAM", ()),
    (TESTS / "watch" / "test_watch_cli.py", "NAN_AND_GO_ON", ()),
    (TESTS / "watch" / "test_watch_cli.py", "INSIDE_A_MODEL", ()),
    (TESTS / "test_frameworks.py", "LIGHTNING", ("bug",)),
    (TESTS / "test_frameworks.py", "HF_TRAINER", ("bug",)),
]
NEEDS = {"LIGHTNING": "lightning", "HF_TRAINER": "transformers", "gpt2_nan.py": "transformers",
         "transformers_callback.py": "transformers", "lightning_callback.py": "lightning"}

# program -> (the fields that differ on the device path, why)
WHY_THEY_DIFFER: dict = {
    "corrupt_sample.py": (
        {"line", "op", "module", "data"},
        "its data set is made by torch.randn on the CPU and then written through numpy "
        "(`.numpy()` shares the memory; no version counter sees the write). On a GPU those "
        "CPU ops are checked as they run, as on the CPU path; the simulated device path "
        "puts every CPU tensor on the device path, where randn's output is judged at the "
        "read, after the write, and randn is named"),
}


def _inline(file: Path, name: str) -> str:
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets
                                             if isinstance(t, ast.Name)] == [name]:
            return textwrap.dedent(ast.literal_eval(node.value))
    raise LookupError(f"{name} is not in {file}")


def _cases():
    cases = [pytest.param(path, args, id=path.parent.name + "/" + path.name)
             for path, args in ON_DISK]
    cases += [pytest.param((file, name), args, id=f"{file.stem}.{name}")
              for file, name, args in INLINE]
    return cases


def _first_stop(program: Path, args, device: str, folder: Path):
    report = folder / f"stops-{device}.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(program), *args],
                     cwd=str(program.parent), env=clean_env(MLDEBUG_SIMULATE_DEVICE=device),
                     timeout=300)
    lines = report.read_text().splitlines() if report.exists() else []
    return (json.loads(lines[0]) if lines else None), result


@pytest.mark.parametrize("source, args", _cases())
def test_the_first_stop_is_the_same_on_the_cpu_and_on_a_device(source, args, tmp_path):
    if isinstance(source, tuple):
        file, name = source
        program = tmp_path / f"{name.lower()}.py"
        program.write_text(_inline(file, name))
    else:
        name, program = source.name, source
    if name in NEEDS:
        pytest.importorskip(NEEDS[name])
    folders = {d: tmp_path / f"path-{d}" for d in "01"}
    for folder in folders.values():
        folder.mkdir()
    with ThreadPoolExecutor(2) as pool:      # the two paths side by side
        cpu, device = pool.map(lambda d: _first_stop(program, args, d, folders[d]), "01")
    (cpu_stop, cpu_run), (dev_stop, dev_run) = cpu, device
    assert cpu_run.returncode == dev_run.returncode, (cpu_run.stderr[-2000:],
                                                      dev_run.stderr[-2000:])
    assert (cpu_stop is None) == (dev_stop is None), (cpu_stop, dev_stop)
    if cpu_stop is None:
        return
    excused = WHY_THEY_DIFFER.get(name, (set(), ""))[0]
    for key in KEYS:
        if key not in excused:
            assert cpu_stop[key] == dev_stop[key], (key, cpu_stop["message"],
                                                    dev_stop["message"])
        else:       # (an excuse that no longer holds goes)
            assert cpu_stop[key] != dev_stop[key], f"{name}: {key} agrees now"
    # where a device pauses elsewhere, the report says so (and the message too)
    if dev_stop["pause_file"] and (dev_stop["pause_file"], dev_stop["pause_line"]) != (
            dev_stop["file"], dev_stop["line"]) and dev_stop["stage"] == "forward":
        assert "found at" in dev_stop["message"] or "then:" in dev_stop["message"], \
            dev_stop["message"]


# -- the three programs that read differently before ------------------------------------
def _program(name):
    return TESTS / "programs" / name


@pytest.mark.parametrize("name, led_to", [
    ("policy_mask_nan.py", "then: ValueError: Expected parameter probs"),
    ("sampling_temperature_zero.py",
     "then: RuntimeError: probability tensor contains either `inf`, `nan` or element < 0"),
])
def test_on_a_device_the_nan_comes_before_the_exception_it_led_to(name, led_to, tmp_path):
    program = _program(name)
    stop, result = _first_stop(program, (), "1", tmp_path)
    assert result.returncode == 3, result.stderr
    assert stop["reason"] in ("nan", "inf") and stop["op"] == "aten.div.Tensor"
    assert stop["line"] == marker_line(program)
    raised_at = marker_line(program) + 1
    assert (os.path.basename(stop["pause_file"]), stop["pause_line"]) == (name, raised_at)
    assert stop["then"].startswith(led_to.removeprefix("then: "))
    assert stop["then"].endswith(f"at {name}:{raised_at}")
    assert led_to in stop["message"]
    assert len(json.loads(json.dumps(stop["then"]))) < 200      # one line, cut short
    lines = (tmp_path / "stops-1.jsonl").read_text().splitlines()
    assert len(lines) == 1           # --batch: the first stop ends the run
    # the exception's traceback is still printed, before the stop's line
    assert result.stderr.index("Traceback") < result.stderr.index("mldebug: stop:")


def test_a_nan_that_came_with_a_batch_names_the_model_call_and_where_it_was_read(tmp_path):
    program = _program("nan_in_batch.py")
    cpu, _ = _first_stop(program, (), "0", tmp_path)
    device, _ = _first_stop(program, (), "1", tmp_path)
    assert cpu["line"] == device["line"] == marker_line(program)
    assert cpu["data"] == device["data"] == {"variable": "x", "rows": [5],
                                               "dataset_indices": [13]}
    assert cpu["pause_file"] == "" and device["pause_line"] == \
        marker_line(program, "    opt.step()")
    assert f"; found at the read at nan_in_batch.py:{device['pause_line']}" in \
        device["message"]


def test_at_the_prompt_the_nan_pauses_where_the_exception_was_raised_then_the_exception():
    program = _program("policy_mask_nan.py")
    result = run_cli([str(program)], stdin="p probs[2]\nc\nq\n",
                     env=clean_env(MLDEBUG_SIMULATE_DEVICE="1"), cwd=str(program.parent))
    out = result.stdout
    assert result.returncode == 1, result.stderr
    nan_stop = out.index("3 NaN from aten.div.Tensor (torch.div) at policy_mask_nan.py:")
    assert "where the exception it led to was raised; `c` then reports that exception" in out
    assert f"> {program}({marker_line(program) + 1})<module>()" in out
    assert "tensor([nan, nan, nan])" in out
    assert out.index("uncaught ValueError", nan_stop) > nan_stop    # then the exception


PYTEST_PROGRAM = """
    import torch

    def test_sampling():
        torch.manual_seed(0)
        probs = torch.softmax(torch.randn(2, 5) / 0.0, dim=-1)  # here
        assert torch.multinomial(probs, 1).shape == (2, 1)
"""

WATCH_BLOCK = """
    import torch
    import mldebug
    from mldebug.core.errors import NonFiniteError

    try:
        with mldebug.watch(action="raise"):
            probs = torch.softmax(torch.randn(2, 5) / 0.0, dim=-1)  # here
            torch.multinomial(probs, 1)
    except NonFiniteError as exc:
        print("stop:", exc)
        print("context:", type(exc.__context__).__name__)
"""


@pytest.mark.parametrize("device", ["0", "1"])
def test_pytest_fails_the_test_with_the_nan_before_its_exception(write_program, tmp_path,
                                                                device):
    prog = write_program(PYTEST_PROGRAM, "test_sampling.py")
    report = tmp_path / "r.jsonl"
    import subprocess
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"--mldebug-report={report}", str(prog)], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300,
                         env=clean_env(MLDEBUG_SIMULATE_DEVICE=device))
    assert run.returncode == 1, run.stdout
    assert "1 failed" in run.stdout and "mldebug: 4 +Inf and 6 -Inf from aten.div" in run.stdout
    (stop,) = [json.loads(line) for line in report.read_text().splitlines()]
    assert stop["line"] == marker_line(prog) and stop["reason"] == "inf"
    assert ("RuntimeError: probability tensor" in stop["then"]) == (device == "1")


@pytest.mark.parametrize("device", ["0", "1"])
def test_a_watch_block_raises_the_nan_before_its_exception(write_program, device):
    import subprocess
    prog = write_program(WATCH_BLOCK)
    run = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                         timeout=120, env=clean_env(MLDEBUG_SIMULATE_DEVICE=device))
    assert run.returncode == 0, run.stderr
    assert f"at prog.py:{marker_line(prog)} [forward]" in run.stdout
    if device == "1":
        assert "then: RuntimeError: probability tensor" in run.stdout
        assert "context: RuntimeError" in run.stdout
    else:
        assert "then:" not in run.stdout and "context: NoneType" in run.stdout


LIGHTNING_POLICY = """
    import torch
    import lightning as L
    from torch import nn
    from torch.distributions import Categorical
    from torch.utils.data import DataLoader, TensorDataset
    from mldebug.integrations.lightning import MLDebugCallback


    class Policy(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            (x,) = batch
            mask = torch.ones(len(x), 3)
            mask[2] = 0                           # a state with no legal action
            probs = torch.softmax(self.net(x), -1) * mask
            probs = probs / probs.sum(-1, keepdim=True)  # here
            return -Categorical(probs=probs).entropy().mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)


    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", logger=False, callbacks=[MLDebugCallback()],
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    trainer.fit(Policy(), DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=4))
"""


@pytest.mark.parametrize("device", ["0", "1"])
def test_a_lightning_fit_ends_with_the_nan_before_its_exception(write_program, device):
    """MLDebugCallback in a script with no terminal (batch): the fit ends with StopError
    naming the NaN at its line, on a device too, where Categorical raised first."""
    pytest.importorskip("lightning")
    import subprocess
    prog = write_program(LIGHTNING_POLICY)
    run = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                         stdin=subprocess.DEVNULL, timeout=300,
                         env=clean_env(MLDEBUG_SIMULATE_DEVICE=device))
    assert run.returncode == 1, run.stderr[-3000:]
    assert "StopError" in run.stderr and "BdbQuit" not in run.stderr
    assert f"from aten.div.Tensor (torch.div) at prog.py:{marker_line(prog)}" in run.stderr
    assert ("then: ValueError: Expected parameter probs" in run.stderr) == (device == "1")


# an op's output outside a model gone by the device's read: one temporary among more than
# the ledger holds (freed), or written over in place before the read
GONE_BY_THE_READ = """
    import sys
    import torch
    torch.manual_seed(0)
    h = (torch.randn(16, 8) * 10).half()
    if sys.argv[1] == "freed":
        z = (h * -7e4).float().nan_to_num(0.0)      # freed
        for _ in range(100):
            z = z * 0.5 + 1.0
    elif sys.argv[1] == "written-over":
        z = h * -7e4                                 # written-over
        z.nan_to_num_(0.0)
    else:                     # its input a temporary too: nothing to compute it again from
        z = ((torch.randn(16, 8) * 10).half() * -7e4).float().nan_to_num(0.0)  # input-freed-too
        for _ in range(100):
            z = z * 0.5 + 1.0
    print(float(z.float().sum()))
"""


@pytest.mark.parametrize("case", ["freed", "written-over", "input-freed-too"])
def test_an_output_gone_by_the_read_is_counted_again_from_its_inputs_or_said_uncounted(
        write_program, tmp_path, case):
    program = write_program(GONE_BY_THE_READ)
    cpu, _ = _first_stop(program, (case,), "0", tmp_path)
    device, result = _first_stop(program, (case,), "1", tmp_path)
    assert result.returncode == 3, result.stderr
    assert cpu["line"] == device["line"] == marker_line(program, f"# {case}")
    assert cpu["op"] == device["op"] == "aten.mul.Tensor"
    assert cpu["count"] > 100 and " +Inf and " in cpu["message"].split(" from ")[0]
    assert "hint: float16 overflow" in cpu["message"]
    if case != "input-freed-too":
        # its input alive and unchanged: the op runs again at the stop, and the device
        # path says what the CPU path says, counts, output and hint
        assert device["count"] == cpu["count"] and device["hint"] == cpu["hint"]
        assert device["output"] == cpu["output"]
        assert device["message"].startswith(cpu["message"].split("; hint")[0])
    else:
        # a norm tells Inf, not how many nor which sign: said so, not "1 +Inf"
        assert device["count"] == 0 and device["output"] is None
        assert device["message"].startswith("Inf from aten.mul.Tensor (torch.mul) at ")
        assert "; not counted: its output was freed before the device read" in \
            device["message"]
