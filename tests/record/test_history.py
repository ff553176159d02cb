"""The CLI's in-memory history: `history` at a NaN stop shows the culprit's last steps."""
from __future__ import annotations

import re

import torch
import torch.nn as nn

from conftest import BLOWUP, run_cli



def _column(text: str, header: str) -> list:
    """Numbers of the column HEADER in the `history` table of TEXT."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines)
                 if header in line.split() and line.split()[:1] == ["step"])
    cols = lines[start].split()
    j = cols.index(header)
    values = []
    for line in lines[start + 1:]:
        parts = line.split()
        if not parts or not re.fullmatch(r"\d+", parts[0]):
            break
        values.append(float(parts[j]))
    return values


def test_history_at_a_nan_stop_shows_the_culprits_weight_climbing(write_program):
    prog = write_program(BLOWUP)
    result = run_cli(["--plain", "--break-on", "nan,inf", str(prog)],
                     stdin="history\nhistory 0\nhistory nope\nq\n")
    out = result.stdout
    assert "+Inf from aten.exp.default" in out and "in module 2 (Head)" in out
    # default: the stop's module (2, the Head) and its parameters
    assert "history of 2: steps 0.." in out
    norms = _column(out, "‖2.lin.weight‖")
    assert len(norms) >= 3
    assert all(b > 2.5 * a for a, b in zip(norms, norms[1:])), norms   # ×3 per step
    assert re.search(r"‖2\.lin\.weight‖ grew ×\d", out)
    # any module by path; an unknown one says what there is
    assert "history of 0: steps" in out and "‖0.weight‖" in out
    assert "history: no parameters under 'nope' were recorded (recorded: 0.weight" in out
    assert "finished" not in out     # `q` ended the program at the stop


def test_history_off_and_before_any_step(write_program):
    prog = write_program("""
        import torch
        w = torch.ones(3, requires_grad=True)
        opt = torch.optim.SGD([w], lr=0.1)
        breakpoint()
        (w * 2).sum().backward()
        opt.step()
        breakpoint()
        print("done")
    """)
    result = run_cli(["--plain", str(prog)], stdin="history\nc\nhistory\nhistory ''\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "history: no optimizer step seen yet" in out
    # no graph capture of a module: the parameter is named by its optimizer
    assert "history of the model: steps 0..0" in out
    assert "‖param 0 of optimizer 0‖" in out and "done" in out
    result = run_cli(["--plain", "--history", "off", str(prog)], stdin="history\nc\nc\n")
    assert result.returncode == 0, result.stderr
    assert "history: no history is kept (the CLI keeps one unless --history off)" in result.stdout
    result = run_cli(["--history", "maybe", str(prog)])
    assert result.returncode == 2 and "--history" in result.stderr


def test_history_costs_nothing_when_off_and_keeps_the_program_bitwise_equal(write_program,
                                                                           tmp_path):
    prog = write_program("""
        import torch, torch.nn as nn
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        for _ in range(30):
            opt.zero_grad()
            model(torch.randn(16, 4)).pow(2).mean().backward()
            opt.step()
        torch.save(model.state_dict(), "out.pt")
    """)
    for flag in ("on", "off"):
        result = run_cli(["--history", flag, str(prog)], cwd=tmp_path)
        assert result.returncode == 0, result.stderr
        (tmp_path / "out.pt").rename(tmp_path / f"{flag}.pt")
    on = torch.load(tmp_path / "on.pt")
    off = torch.load(tmp_path / "off.pt")
    assert all(torch.equal(on[k], off[k]) for k in on)


def test_history_rows_are_the_norms_torch_computes():
    from mldebug.graph import Capture
    from mldebug.record.history import History

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    expected = []
    with Capture(), History(steps=3) as h:
        for _ in range(5):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            expected.append((model[1].weight.norm().item(), model[1].weight.grad.norm().item()))
            opt.step()
    assert [s for s, _ in h.rows] == [2, 3, 4]          # a ring of the last 3 steps
    for (step, row), (w, g) in zip(h.rows, expected[2:]):
        assert row["1.weight"][0] == __import__("pytest").approx(w, rel=1e-6)
        assert row["1.weight"][1] == __import__("pytest").approx(g, rel=1e-6)
    d = h.to_dict()
    assert d["steps"] == [2, 3, 4] and len(d["params"]["0.bias"]["grad_norm"]) == 3


def test_while_a_recording_gives_the_norms_the_history_computes_none(tmp_path):
    """One code path, two sources: on the steps `mldebug.record` records (params and
    params_grad logs), the history takes the norms the recorder derives from its
    summaries and computes nothing; on the others it computes them itself."""
    import pytest

    import mldebug
    from mldebug.graph import Capture
    from mldebug.record.history import History

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 4)
    expected = []
    # (no time budget: on a loaded machine the history would record every 2nd step)
    with Capture(), History(budget=float("inf")) as h:
        with mldebug.record(model, every=2, run_dir=str(tmp_path), run="r"):
            for _ in range(6):
                opt.zero_grad()
                model(x).pow(2).mean().backward()
                expected.append({n: (p.norm().item(), p.grad.norm().item())
                                 for n, p in model.named_parameters()})
                opt.step()
    assert (h.from_recorder, h.computed) == (3, 3)       # steps 0, 2, 4 | 1, 3, 5
    assert [s for s, _ in h.rows] == list(range(6))
    for (step, row), want in zip(h.rows, expected):
        assert set(row) == set(want)
        for name, (w, g) in want.items():
            assert row[name][0] == pytest.approx(w, rel=1e-5), (step, name)
            assert row[name][1] == pytest.approx(g, rel=1e-5), (step, name)


def test_history_says_the_rank_in_a_job(monkeypatch):
    """One rank of a launched job (RANK/WORLD_SIZE, as torchrun sets them): `history`
    starts with '[rank R]', as the stop lines do; a single process has no tag."""
    from mldebug.record.history import History

    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with History() as h:
        model(torch.randn(8, 4)).sum().backward()
        opt.step()
    assert h.format("").startswith("history of the model: steps 0..0")
    assert h.to_dict()["rank"] is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert h.format("").startswith("[rank 1] history of the model: steps 0..0")
    assert h.format("nope").startswith("[rank 1] history: no parameters under 'nope'")
    assert h.to_dict()["rank"] == 1
