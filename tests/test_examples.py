"""The examples the README points at, run through the real CLI."""
from __future__ import annotations

from pathlib import Path

from conftest import REPO, marker_line, read_report, run_cli

EXAMPLES = REPO / "examples"


def line_of(path: Path, text: str) -> int:
    return marker_line(path, text)


def test_nan_loss_stops_at_the_log_in_batch_mode(tmp_path):
    example = EXAMPLES / "nan_loss.py"
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(example)])
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    # softmax underflows to a denormal, log of it is finite, but its derivative 1/p
    # overflows: the first Inf is made in backward, and reported against the log line
    assert stop["reason"] == "inf"
    assert stop["op"] == "aten.div.Tensor"
    assert stop["stage"] == "backward"
    assert stop["node"] == "LogBackward0"
    assert stop["file"] == str(example)
    assert stop["line"] == line_of(example, "log_probs = torch.log(probs)")
    assert stop["function"] == "cross_entropy"
    assert stop["created"] is True
    assert stop["pause_line"] == line_of(example, "loss.backward()")
    assert "final loss" not in result.stdout


def test_nan_loss_interactive_why_and_inspect_then_quit():
    example = EXAMPLES / "nan_loss.py"
    result = run_cli([str(example)], stdin="why\ninspect loss\nup\np step\nq\n")
    out = result.stdout
    assert "Inf from aten.div.Tensor (torch.log) in LogBackward0" in out
    assert f"> {example}({line_of(example, 'loss.backward()')})<module>()" in out
    assert "root cause: this op made the non-finite value from finite inputs" in out
    assert f"built by the forward op at {example}:{line_of(example, 'torch.log(probs)')}" in out
    assert "tensor[] f32" in out
    assert "*** Newest frame" not in out and "*** Oldest frame" in out  # `up` stays in user code
    assert "final loss" not in out


def test_shape_error_post_mortem_lands_in_the_users_forward():
    example = EXAMPLES / "shape_error.py"
    result = run_cli([str(example)], stdin="p h.shape\nq\n")
    assert result.returncode == 1
    assert f"> {example}({line_of(example, 'return self.head(h)')})forward()" in result.stdout
    assert "torch.Size([4, 5408])" in result.stdout


def test_healthy_example_runs_through_without_a_stop(tmp_path):
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(EXAMPLES / "healthy.py")])
    assert result.returncode == 0, result.stderr
    assert "final loss" in result.stdout
    assert read_report(report) == []


def test_corrupt_record_names_its_dataset_index(tmp_path):
    example = EXAMPLES / "corrupt_record.py"
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(example)], timeout=180)
    assert result.returncode == 3, result.stderr
    (stop,) = read_report(report)
    assert (stop["reason"], stop["stage"], stop["created"]) == ("nan", "forward", False)
    assert stop["line"] == line_of(example, "pred = model(x)")
    assert stop["data"]["variable"] == "x" and stop["data"]["dataset_indices"] == [77]
    assert "loss" not in result.stdout
