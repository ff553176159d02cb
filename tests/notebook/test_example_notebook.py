"""examples/mldebug_notebook.ipynb, committed with its outputs stripped, runs top to
bottom in a real kernel through nbclient (no input box): the one cell tagged
raises-exception ends with the stop, every other cell runs clean."""
from __future__ import annotations

import pytest

from conftest import REPO, clean_env

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

EXAMPLE = REPO / "examples" / "mldebug_notebook.ipynb"
TIMEOUT = 240


def outputs_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type == "error":
            parts.append(f"{out.ename}: {out.evalue}")
        elif "text/plain" in out.get("data", {}):
            parts.append(out.data["text/plain"])
    return "\n".join(parts)


def test_the_example_is_committed_without_outputs():
    nb = nbformat.read(EXAMPLE, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(c.outputs == [] and c.execution_count is None for c in code)


def test_the_example_runs_top_to_bottom(tmp_path):
    nb = nbformat.read(EXAMPLE, as_version=4)
    client = nbclient.NotebookClient(nb, kernel_name="python3", timeout=TIMEOUT,
                                     startup_timeout=TIMEOUT, allow_errors=False,
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=clean_env(MPLBACKEND="agg"))   # raises on an untagged error
    by_source = {c.source.splitlines()[0]: c for c in nb.cells if c.cell_type == "code"}

    summary = by_source["grid = torch.randn(64, 64)"].outputs[0].data
    assert summary["text/plain"].startswith("tensor[64, 64] f32")
    assert "NaN!1" in summary["text/plain"] and "+Inf!3" in summary["text/plain"]
    assert "mldebug-heatmap" in summary["text/html"]

    stopped = by_source["train(200)   # stops at the first Inf"]
    assert "raises-exception" in stopped.metadata.tags
    (error,) = [o for o in stopped.outputs if o.output_type == "error"]
    assert error.ename == "StopInCell"
    assert "Inf from aten.div.Tensor (torch.log) in LogBackward0" in error.evalue

    record = outputs_text(by_source["stop = mldebug.last_stop()"])
    assert "'op': 'aten.div.Tensor'" in record and "'node': 'LogBackward0'" in record
    assert "'stage': 'backward'" in record and "'function': 'cross_entropy'" in record
    assert "'line': 10" in record        # the torch.log line of the model's cell

    assert "final loss" in outputs_text(by_source["%%mldebug --break-on nan,inf"])
    assert "mldebug: off" in outputs_text(by_source["%mldebug status"])

    graph = by_source["mldebug.trace(model, inputs[:8])"].outputs
    run = [o for o in graph if "application/vnd.bokehjs_exec.v0+json" in o.get("data", {})]
    assert run and "0 (Linear) [8, 64] f32" in run[0].data["application/javascript"]
