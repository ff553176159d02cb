"""A NaN or Inf the program writes on purpose (`x[mask] = nan`, `masked_fill`, `fill_`,
`full`, a `torch.tensor` literal) is no stop where it is written nor where it flows; it
is a stop where it first reaches a model call, the loss, a gradient or a parameter,
naming the line that wrote it (mldebug/watch/marks.py). A NaN read from a file stays
what it was: a stop where the program first reads it."""
from __future__ import annotations

import inspect
import re

import numpy as np
import pytest
import torch
from torch import nn

from mldebug.watch import watch

from conftest import clean_env, read_report, run_cli

pytestmark = pytest.mark.parametrize("exact", [False, True], ids=["tiers", "exact"])


def line_of(fn, text: str) -> int:
    """Line number of the line of FN's source holding TEXT."""
    lines, first = inspect.getsourcelines(fn)
    return first + next(i for i, line in enumerate(lines) if text in line)


def stops(fn, exact, **options):
    got = []
    with watch(on_violation=got.append, exact=exact, **options):
        kept = fn()       # (alive at the watch's last read, on the device path)
    del kept
    return got


def train(x, steps=3):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(x.shape[1], 8), nn.ReLU(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def test_a_mask_written_in_place_and_its_softmax_in_place_are_no_stop(device, exact):
    # (on a device each op is judged at the read, when later in-place ops have written
    # the memory it read: sub_ read the -inf that masked_fill_ wrote, not a finite value)
    def program():
        p = torch.randn(2, 4, 4, device=device)
        p.masked_fill_(torch.ones(4, 4, dtype=torch.bool, device=device).triu(1),
                       float("-inf"))
        p.sub_(p.amax(-1, keepdim=True)).exp_()
        p.div_(p.sum(-1, keepdim=True))
        return p

    assert stops(program, exact) == []


def test_missing_values_marked_with_nan_and_cleaned_are_no_stop(device, exact):
    def program():
        torch.manual_seed(0)
        x = torch.randn(32, 6)
        x[x > 1.0] = float("nan")                        # missing: marked on purpose
        means = x.nanmean(0)
        clean = torch.where(torch.isnan(x), means.expand_as(x), x)
        train(torch.cat([clean, torch.nan_to_num(x)], 1))

    assert stops(program, exact) == []


def test_every_way_of_writing_a_constant_is_judged_alike(device, exact):
    def program():
        x = torch.randn(4, 5)
        mask = x > 0
        a = x.clone()
        a[mask] = float("nan")                           # index_put_
        b = x.masked_fill(mask, float("nan"))
        c = torch.full((3,), float("nan"))
        d = torch.zeros(3).fill_(float("-inf"))
        e = torch.tensor([[1.0, float("nan")], [float("inf"), 2.0]])
        f = torch.where(mask, x, float("nan"))
        g = x.clone()
        g[:, 1] = float("-inf")
        h = x.index_fill(1, torch.tensor([0]), float("nan"))
        flows = [a * 2, b.sum(), c + 1, d.exp(), e.t() @ e, f.nanmean(), g.amax(1), h.abs()]
        del flows

    assert stops(program, exact) == []


@pytest.mark.parametrize("how", ["index_put", "copied_in"])
def test_a_nan_marker_that_reaches_the_model_is_a_stop_naming_its_line(device, exact, how):
    def program():
        torch.manual_seed(0)
        x = torch.randn(32, 6)
        if how == "index_put":
            x[x > 1.0] = float("nan")                    # written: index_put
        else:
            # (on a device the read judges full_like after copy_ wrote x: what it read
            # of x is the x before that write, not the NaN now there)
            x.copy_(torch.full_like(x, float("nan")))    # written: copied_in
        train(x)                                          # forgot to clean it

    got = stops(program, exact)
    assert len(got) == 1                   # (what flows from it after is not a new stop)
    v = got[0]
    assert (v.kind, v.stage, v.created) == ("nan", "forward", False)
    assert v.line == line_of(program, f"# written: {how}") and v.function == "program"
    assert v.reached.startswith("the model call Sequential at test_written_marks.py:")
    assert "written there on purpose, it reaches the model call Sequential" in v.headline()
    assert v.micro_batch is None           # (one backward a step: no micro-batch to name)


@pytest.mark.parametrize("at", [0, 1])
def test_a_marker_names_its_micro_batch(device, exact, at):
    """Gradient accumulation, a marker reaching the model in micro-batch AT + 1 of step
    1: one stop, naming it (on a device the model call's arguments are judged at the
    step's read, after both backwards)."""
    def program():
        torch.manual_seed(0)
        model = nn.Linear(6, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        for step in range(2):
            for micro in range(2):
                x = torch.randn(8, 6)
                if step == 1 and micro == at:
                    x[0, 0] = float("nan")               # written
                model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    got = stops(program, exact)
    assert [(v.line, v.step, v.micro_batch) for v in got] == [
        (line_of(program, "# written"), 1, at + 1)]


def test_a_literal_that_reaches_the_loss_is_a_stop_naming_the_literal(device, exact):
    def program():
        model = nn.Linear(3, 1)
        weights = torch.tensor([1.0, float("nan"), 2.0])     # literal
        loss = model(torch.ones(2, 3)).sum() * weights.sum()
        loss.backward()

    got = stops(program, exact)
    assert [(v.kind, v.line) for v in got][:1] == [("nan", line_of(program, "# literal"))]
    assert got[0].reached.startswith("the loss")
    assert got[0].micro_batch is None


def test_a_nan_written_into_a_gradient_is_a_stop_at_the_step(exact):
    def program():
        model = nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.ones(2, 3)).sum().backward()
        with torch.no_grad():
            model.weight.grad[0, 1] = float("nan")           # into a gradient
        opt.step()

    got = stops(program, exact)
    assert len(got) == 1
    v = got[0]
    assert (v.kind, v.stage, v.line) == ("nan", "optimizer", line_of(program, "# into a"))
    assert "it reaches the" in v.headline()


def test_a_nan_read_from_a_file_stops_where_the_program_first_reads_it(device, exact,
                                                                       tmp_path):
    saved = np.array([[1.0, np.nan], [2.0, 3.0]], dtype=np.float32)
    np.save(tmp_path / "x.npy", saved)

    def program():
        x = torch.from_numpy(np.load(tmp_path / "x.npy"))
        y = x * 2                                        # first read
        return x, y

    got = stops(program, exact)
    assert [(v.op, v.created, v.reached) for v in got] == [("aten.mul.Tensor", False, "")]
    assert got[0].line == line_of(program, "# first read")


def test_a_nan_an_op_makes_from_masked_infs_is_still_a_stop(device, exact):
    def program():
        scores = torch.randn(2, 3)
        masked = scores.masked_fill(torch.tensor([[True] * 3, [False] * 3]), float("-inf"))
        p = masked.softmax(-1)                           # a fully masked row: NaN
        del p

    got = stops(program, exact)
    assert [(v.op, v.created, v.line) for v in got] == [
        ("aten._softmax.default", True, line_of(program, "# a fully masked row"))]


def test_inf_all_stops_where_an_inf_is_written(exact):
    def program():
        x = torch.randn(4, 5)
        x[x > 0] = float("-inf")                         # written

    got = stops(program, exact, break_on=("nan", "inf-all"))
    assert [(v.op, v.line) for v in got] == [("aten.index_put_.default",
                                              line_of(program, "# written"))]


def test_inf_all_alone_adds_infs_not_nan(device, exact):
    """`inf-all` asks for every Inf; a NaN marker reaching the model stops only when
    'nan' is asked for too, as every other NaN."""
    def program():
        torch.manual_seed(0)
        x = torch.randn(32, 6)
        x[x > 1.0] = float("nan")                        # written
        train(x)

    assert stops(program, exact, break_on=("inf-all",)) == []
    got = stops(program, exact, break_on=("nan", "inf-all"))
    assert [(v.kind, v.line) for v in got] == [("nan", line_of(program, "# written"))]


# the program: missing values marked with NaN, cleaned (or not) before the model
MARKED = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    x = torch.randn(16, 4)
    x[x > 1.0] = float('nan')          # marked on purpose
    if sys.argv[1] == "clean":
        x = torch.nan_to_num(x)
    model = nn.Linear(4, 1)
    loss = model(x).pow(2).mean()      # the model call
    loss.backward()
    print("missing", int(torch.isnan(x).sum()), "loss", loss.item())
"""


@pytest.mark.parametrize("path", ["host", "device"])
def test_through_the_cli_a_marker_stops_at_the_model_call_only_when_it_reaches_it(
        write_program, tmp_path, path, exact):
    prog = write_program(MARKED)
    env = clean_env(MLDEBUG_SIMULATE_DEVICE="1") if path == "device" else clean_env()
    if path == "host":
        env.pop("MLDEBUG_SIMULATE_DEVICE", None)
    watch_mode = ["--watch", "exact"] if exact else []
    clean = run_cli(["--batch", *watch_mode, str(prog), "clean"], env=env)
    assert clean.returncode == 0, clean.stderr
    assert "missing 0" in clean.stdout and "mldebug" not in clean.stdout + clean.stderr
    report = tmp_path / "r.jsonl"
    marked = run_cli(["--batch", *watch_mode, "--report", str(report), str(prog), "marked"],
                     env=env)
    assert marked.returncode == 3, marked.stderr
    (stop,) = read_report(report)
    source = prog.read_text().splitlines()
    written = next(i for i, line in enumerate(source, 1) if "marked on purpose" in line)
    called = next(i for i, line in enumerate(source, 1) if "the model call" in line)
    assert (stop["file"], stop["line"], stop["reason"]) == (str(prog), written, "nan")
    assert re.fullmatch(rf"\d+ NaN at prog.py:{written} \[forward\]; written there on "
                        rf"purpose, it reaches the model call Linear at prog.py:{called}",
                        stop["message"]), stop["message"]
