"""mldebug's own calls under the watch (summary, describe, the HTML repr, trace, the
recording's log_*, inspect and the view) never stop, never mark a NaN as judged and change
nothing the watch sees: the program's own use of the same NaN stops exactly as it does
without those calls (core/quiet.py, `own_call`)."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import mldebug
from mldebug.core.quiet import own_call
from mldebug.watch import watch

from conftest import clean_env, marker_line, read_report, run_cli

PROGRAM = """
    import sys

    import numpy as np
    import torch
    import mldebug

    own, runs = sys.argv[1] == "own", sys.argv[2]
    data = torch.from_numpy(np.array([[1.0, np.nan], [2.0, 3.0]], dtype=np.float32))
    model = torch.nn.Linear(2, 1)
    recording = mldebug.record(model, run_dir=runs)
    if own:                   # mldebug's own looks at the NaN: none of them is a stop
        print("summary", mldebug.summary(data))
        print("describe", mldebug.describe(data).splitlines()[0])
        print("html", len(mldebug.summary(data)._repr_html_()) > 0)
        print("trace", type(mldebug.trace(model, data)).__name__)
        mldebug.log_tensor("data", data)
        mldebug.log_scalar("bad", data[0, 1])
        mldebug.log_note("a NaN in the data")
        mldebug.view(port=0)          # (any free port: tests may run side by side)
        print("inspect", mldebug.inspect(data) is data)
    print("before the model")
    out = model(data)  # here
    print("after", out.isnan().sum().item())
"""


@pytest.mark.parametrize("path", ["host", "device"])
def test_mldebugs_own_calls_stop_nothing_and_the_programs_own_use_stops_as_without_them(
        write_program, tmp_path, path):
    prog = write_program(PROGRAM)
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1") if path == "device" else clean_env()
    if path == "host":
        env.pop("MLDEBUG_SIMULATE_DEVICE", None)
    stops = {}
    for mode in ("plain", "own"):
        report = tmp_path / f"{mode}.jsonl"
        result = run_cli(["--batch", "--report", str(report), str(prog), mode,
                          str(tmp_path / "runs")], env=env, timeout=240)
        assert result.returncode == 3, result.stderr
        assert "before the model" in result.stdout and "after" not in result.stdout
        (stops[mode],) = read_report(report)
        if mode == "own":
            assert "NaN!1" in result.stdout and "html True" in result.stdout
            assert "trace Graph" in result.stdout and "inspect True" in result.stdout
    own, plain = stops["own"], stops["plain"]
    assert (own["file"], own["line"]) == (str(prog), marker_line(prog))
    assert own["message"] == plain["message"] and own["data"] == plain["data"]
    assert "in the data: data row 0" in own["message"]


def test_a_summary_under_action_raise_is_the_summary():
    data = torch.from_numpy(np.array([[1.0, np.nan], [2.0, 3.0]], dtype=np.float32))
    with watch(action="raise") as w:
        s = mldebug.summary(data)
        text = mldebug.describe(data)
    assert s.nan == 1 and "unavailable" not in str(s) and "NaN" in text
    assert w.violations == []


def test_the_program_still_stops_at_a_nan_it_uses_after_mldebug_looked_at_it(device):
    data = torch.from_numpy(np.array([1.0, np.nan, 3.0]))
    with watch(on_violation=lambda v: None) as w:
        mldebug.summary(data)
        mldebug.describe(data)
        y = data * 2               # the program's own first use: came in from outside
    assert [(v.op, v.created) for v in w.violations] == [("aten.mul.Tensor", False)]
    del y


def test_only_the_watched_thread_looks_away():
    """A view's or a panel's thread computing a summary while the program runs must not
    blind the watch for the program's thread."""
    inside, release = threading.Event(), threading.Event()

    @own_call
    def held():                   # mldebug's own work, on another thread, in progress
        inside.set()
        release.wait(30)

    with watch(on_violation=lambda v: None) as w:
        worker = threading.Thread(target=held)
        worker.start()
        assert inside.wait(30)
        y = torch.log(torch.zeros(2))          # the program's thread: still watched
        release.set()
        worker.join()
    assert [v.op for v in w.violations] == ["aten.log.default"]
    del y
