"""The catalogue of NaN/Inf causes (mldebug/remedies/hints.py), proven on programs.

Each program of tests/programs_hints/ makes one cause's NaN/Inf: under
`python -m mldebug --batch --report` its stop's `hint` names the cause and the usual fix
at the line to change, in the message and the report. The same program with `--fixed`
applies the remedy the hint names and runs clean under mldebug. The programs run once
each (a module fixture, two at a time: most of the time is torch's import).
"""
from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import TESTS, clean_env, marker_line, read_report, run_cli

PROGRAMS = TESTS / "programs_hints"
DOCS = TESTS.parent / "docs"

# program -> (rule, words the hint holds, reason, stage, CLI options)
CASES = {
    "log_of_softmax": ("log_of_underflowed_probability", ["softmax output that underflowed to 0",
                                                          "torch.log_softmax"],
                       "inf", "forward", []),
    "acos_past_one": ("outside_domain", ["acos of 2 values", "1.0000001", "x.clamp(-1 + 1e-6"],
                      "nan", "forward", []),
    "sqrt_grad_at_zero": ("derivative_at_domain_edge", ["derivative of sqrt", "torch.sqrt(x + 1e-12)"],
                          "inf", "backward", []),
    "std_of_constant_column": ("division_by_zero", ["(0/0)", "`std`", "standard deviation",
                                                    "(the first at [2])", "std + 1e-8"],
                               "nan", "forward", []),
    "temperature_zero": ("division_by_zero", ["(x/0)", "`temperature` is the number 0", "argmax"],
                         "inf", "forward", []),
    "zero_norm_row": ("division_by_zero", ["a norm", "all-zero row", "F.normalize"],
                      "nan", "forward", []),
    "empty_selection_count": ("division_by_zero", ["`positive.sum()`", "a sum", ".clamp(min=1)"],
                              "nan", "forward", []),
    "std_of_one_sample": ("std_of_one_element", ["correction=1 over 1 element", "correction=0"],
                          "nan", "forward", []),
    "empty_batch_mean": ("empty_reduction", ["smooth_l1_loss over an empty tensor", "[0, 4]"],
                         "nan", "forward", []),
    "cross_entropy_all_ignored": ("cross_entropy_all_ignored", ["ignore_index (-100, 4 of 4)",
                                                                "clamp(min=1)"],
                                  "nan", "forward", []),
    "masked_softmax_row": ("softmax_all_masked_row", ["4 of 8 rows", "all -inf",
                                                      "torch.finfo(dtype).min"],
                           "nan", "forward", []),
    "mha_all_padded": ("softmax_all_masked_row", ["all -inf", "all padding out of the batch"],
                       "nan", "forward", []),
    "fp16_feedforward": ("half_precision_overflow", ["float16 overflow", "65,504", "bfloat16"],
                         "inf", "forward", []),
    "exp_overflow": ("exp_overflow", ["exp of values up to 92.46", "88.72", "F.softplus"],
                     "inf", "forward", []),
    "where_sqrt_grad": ("masked_branch_gradient", ["SqrtBackward0 is 0", "torch.where(mask, x, 1.0)"],
                        "nan", "backward", []),
    "layernorm_cancellation": ("variance_by_cancellation", ["E[x²] - E[x]²", "torch.var"],
                               "nan", "forward", []),
    "grad_scaler_step": ("loss_scaler_overflow_stepped",
                         ["overflow GradScaler found", "scaler.step(optimizer)"],
                         "nan", "optimizer", []),
    "adam_eps_zero": ("optimizer_eps_zero", ["Adam with eps=0", "exp_avg_sq are 0", "1e-8"],
                      "nan", "optimizer", []),
    "adam_eps_fp16": ("optimizer_eps_zero", ["eps=1e-08 is 0 in float16",
                                                  "exp_avg_sq are 0", "torch.autocast"],
                      "nan", "optimizer", []),
    # (with the default break-on the exploding-gradients assertion stops first, with its
    # own remedy; the NaN stop comes five steps later)
    "lr_too_high": ("diverging_training", ["training diverged", "(lr=0.5)", "clip_grad_norm_"],
                    "inf", "forward", ["--break-on", "nan,inf"]),
    "nan_in_data": ("nan_in_data", ["dataset index 7", "data pipeline"], "nan", "forward", []),
    "eigh_repeated": ("eigen_degenerate", ["eigenvalues: 1 pair is equal", "eigvalsh"],
                      "nan", "backward", []),
}
# run again on the device path (what a GPU runs, simulated): the same stop, the same
# cause and hint, but where a program says why not (what the device's read, after the
# op, can no longer see)
ON_DEVICE = sorted(CASES)
# (a temporary input, such as zero_norm_row's divisor `e.norm(...)` or empty_batch_mean's
# empty `pred[valid]`, is kept for the read: step_ledger.StepLedger._aside)
DEVICE_HINT_DIFFERS = {
    "eigh_repeated": "the eigenvalues' gaps are read from the autograd node while it runs; "
                     "at the read it has run: the cause is named, the pairs not counted",
    "lr_too_high": "the history records every step only while its own time stays within "
                   "its budget (record/history.py): which steps the cause names depends on "
                   "the machine's load, the fix does not",
}
# the stop names a line other than the program's `# here` line
FIX_LINE_MARKER = {"masked_softmax_row": "# the mask"}
# the line to change is elsewhere
NO_FIX_LINE = {"nan_in_data", "adam_eps_zero", "adam_eps_fp16", "lr_too_high"}


def _run(tmp: Path, name: str, options: list, env: dict) -> tuple:
    report = tmp / f"{name}.jsonl"
    result = subprocess.run([sys.executable, "-m", "mldebug", "--batch", "--report",
                             str(report), *options, str(PROGRAMS / f"{name}.py")],
                            capture_output=True, text=True, env=env, timeout=240)
    return result, read_report(report)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(program, 'host'|'device'): (CompletedProcess, report lines)}"""
    tmp = tmp_path_factory.mktemp("hints")
    jobs = [(name, "host", CASES[name][4], clean_env()) for name in CASES]
    jobs += [(name, "device", CASES[name][4], clean_env(MLDEBUG_SIMULATE_DEVICE="1"))
             for name in ON_DEVICE]
    for path in ("host", "device"):
        (tmp / path).mkdir()
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {(name, path): pool.submit(_run, tmp / path, name, options, env)
                   for name, path, options, env in jobs}
        return {key: future.result() for key, future in futures.items()}


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_stop_says_the_cause_and_its_fix(runs, name):
    rule, words, reason, stage, _ = CASES[name]
    result, stops = runs[name, "host"]
    assert result.returncode == 3, result.stderr[-3000:]
    (stop,) = stops
    assert (stop["reason"], stop["stage"], stop["cause"]) == (reason, stage, rule), stop["message"]
    for word in words:
        assert word in stop["hint"], (word, stop["hint"])
    program = PROGRAMS / f"{name}.py"
    if stage != "optimizer" and name != "lr_too_high":
        assert stop["line"] == marker_line(program), stop["message"]
    if name not in NO_FIX_LINE:
        line = marker_line(program, FIX_LINE_MARKER.get(name, "# here"))
        assert f"; fix at {program.name}:{line}: " in stop["hint"]
    # the message ends with it, as the terminal printed it; the report has the op's inputs
    assert stop["message"].endswith(f"; hint: {stop['hint']}")
    assert f"mldebug: stop: {stop['message']}" in result.stderr + result.stdout
    assert stop["inputs"] and all(i["name"] and i["text"] for i in stop["inputs"])


def test_every_remedy_the_hints_name_runs_clean(write_program, tmp_path):
    """All the programs with `--fixed`, one after the other in one watched process."""
    driver = write_program(f"""
        import runpy, sys
        for name in {sorted(CASES)!r}:
            sys.argv = [name + ".py", "--fixed"]
            runpy.run_path({str(PROGRAMS)!r} + "/" + name + ".py", run_name="__main__")
            print("ran", name, flush=True)
    """)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(driver)], timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert read_report(report) == []
    assert [line.split()[1] for line in result.stdout.splitlines()
            if line.startswith("ran ")] == sorted(CASES)


@pytest.mark.parametrize("name", ON_DEVICE)
def test_on_a_device_the_hint_names_the_same_cause(runs, name):
    result, stops = runs[name, "device"]
    assert result.returncode == 3, result.stderr[-3000:]
    (stop,) = stops
    _, host = runs[name, "host"]
    keys = ("reason", "stage", "op", "file", "line")
    assert [stop[k] for k in keys] == [host[0][k] for k in keys], stop["message"]
    assert stop["cause"] == host[0]["cause"] == CASES[name][0]
    if name in DEVICE_HINT_DIFFERS:
        assert stop["hint"].rpartition("; fix")[2] == host[0]["hint"].rpartition("; fix")[2]
    else:
        assert stop["hint"] == host[0]["hint"]


def test_the_report_carries_the_ops_inputs_and_a_nan_made_from_inf_says_which(runs):
    """A softmax of rows that are all -inf: made by this op (created), from the -Inf of
    the input the report names (culprit), with that input's summary."""
    _, (stop,) = runs["masked_softmax_row", "host"]
    assert stop["created"] is True and stop["culprit"] == "input 0 (self)"
    assert "this op made it from the -Inf in input 0 (self)" in stop["message"]
    assert "finite inputs" not in stop["message"]
    scores = stop["inputs"][0]
    assert scores["name"] == "input 0 (self)" and "-Inf!16" in scores["text"]
    assert scores["summary"]["neginf"] == 16 and scores["summary"]["shape"] == [2, 4, 4]
    assert stop["inputs"][1] == {"name": "input 1 (dim)", "text": "-1", "summary": None}
    assert stop["evidence"]["masked_rows"] == {
        "input": "input 0 (self)", "dim": 2, "count": 4, "of": 8, "first": [1, 0],
        "written_at": f"masked_softmax_row.py:{marker_line(PROGRAMS / 'masked_softmax_row.py', '# the mask')}"}
    json.dumps(stop, allow_nan=False)            # strict JSON, as the report promises


def test_cross_entropy_and_a_directly_called_module_are_named(runs):
    _, (ce,) = runs["cross_entropy_all_ignored", "host"]
    assert ce["op"] == "aten.nll_loss_forward.default"
    assert ce["torch_op"] == "torch.nn.functional.nll_loss"
    _, (mha,) = runs["mha_all_padded", "host"]
    assert (mha["module"], mha["module_type"]) == ("", "MultiheadAttention")
    assert " in MultiheadAttention at mha_all_padded.py:" in mha["message"]


def test_a_stop_no_rule_explains_has_no_hint(write_program, tmp_path):
    prog = write_program("""
        import torch
        a = torch.full((3,), 1e30)
        b = a * a  # here
    """)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)])
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["op"], stop["line"]) == ("inf", "aten.mul.Tensor",
                                                          marker_line(prog))
    assert stop["hint"] == "" and stop["cause"] == "" and "hint" not in stop["message"]


def test_why_shows_the_hint_and_the_evidence_it_read():
    program = PROGRAMS / "std_of_constant_column.py"
    result = run_cli(["--plain", str(program)], stdin="why\nc\n")
    out = result.stdout
    why = out[out.index("(mldebug) ") + len("(mldebug) "):]
    assert why.startswith("32 NaN from aten.div.Tensor (torch.div) at std_of_constant_column.py:")
    assert "  hint (division_by_zero): a division by zero (0/0): the divisor `std`" in why
    assert "  measured: the divisor input 1 (other) holds 1 zero(s) of 4" in why, why
    assert "  input 1 (other): tensor[4] f32" in why
    # the headline `why` prints does not repeat the hint
    assert why.split("\n", 1)[0].endswith("this op made it from finite inputs")


LIGHTNING = """
    import torch, torch.nn as nn
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 1)

        def training_step(self, batch, i):
            x, y = batch
            return (self.net(x) - y).pow(2).mean()  # here: the loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    torch.manual_seed(0)
    x = torch.randn(64, 8) * 10
    data = DataLoader(TensorDataset(x, x.sum(-1, keepdim=True)), batch_size=64)
    trainer = L.Trainer(max_epochs=30, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    trainer.fit(Model(), data)  # fit
"""


def test_under_lightning_a_backward_assertion_names_the_training_steps_loss_line(
        write_program, tmp_path):
    """Lightning calls loss.backward() itself: the exploding-gradients assertion (a
    backward check) names the training_step line that built the loss, and pauses at
    trainer.fit, the user frame still alive."""
    pytest.importorskip("lightning")
    prog = write_program(LIGHTNING)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)], timeout=240)
    assert result.returncode == 3, result.stderr[-3000:]
    (stop,) = read_report(report)
    assert (stop["reason"], stop["assertion"], stop["stage"]) == (
        "assertion", "exploding_gradients", "backward")
    assert (stop["line"], stop["function"]) == (marker_line(prog, "# here"), "training_step")
    assert stop["pause_line"] == marker_line(prog, "# fit")


def test_the_docs_list_every_cause_of_the_catalogue_and_each_has_a_program():
    from mldebug.remedies.hints import RULES
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    text = (DOCS / "watch.md").read_text()
    for name in names:
        assert f"`{name}`" in text, name
    assert set(names) == {case[0] for case in CASES.values()}
    assert {p.stem for p in PROGRAMS.glob("*.py")} == set(CASES)


def test_the_browser_views_banner_shows_the_hint_on_its_own_line():
    from mldebug.view.data import banner_html
    hint = "a division by zero (0/0): the divisor `std` is 0; fix at prep.py:9: add an eps"
    stop = {"reason": "nan", "message": f"32 NaN from aten.div.Tensor at prep.py:9 [forward]; "
                                        f"hint: {hint}", "hint": hint, "stage": "forward"}
    html = banner_html({"mode": "prompt", "where": None, "stop": stop})
    assert "<b>Stop:</b> 32 NaN from aten.div.Tensor at prep.py:9 [forward]<div" in html
    assert ('<div class="mld-hint"><b>Hint:</b> a division by zero (0/0): the divisor '
            '`std` is 0; fix at prep.py:9: add an eps</div>') in html
    assert html.count("division by zero") == 1
    del stop["hint"]
    assert "mld-hint" not in banner_html({"mode": "prompt", "where": None, "stop": stop})
