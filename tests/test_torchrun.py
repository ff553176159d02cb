"""Multi-rank jobs as a user launches them: `torchrun --nproc-per-node 2 -m mldebug ...`
on CPU (gloo, DDP). A stop names its rank; the other rank writes a `peer_stop` line and
exits 3; a NaN that reaches a rank through the gradient all-reduce names the rank that
made it; nothing hangs (every run has a timeout, and hitting it fails the test)."""
from __future__ import annotations

import re
import subprocess
import sys

from conftest import clean_env, marker_line, read_report

TRAIN = """
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    where = sys.argv[1]           # none | forward | allreduce


    class Norm(nn.Module):
        def forward(self, h):
            return torch.sqrt(h * h + 0.0)  # here allreduce


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8, bias=False), Norm(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if where == "allreduce" and rank == 1 and step == 2:
            x = torch.zeros_like(x)     # sqrt'(0): an Inf made in rank 1's backward only
        out = model(x)
        if where == "forward" and rank == 1 and step == 2:
            out = out / torch.zeros_like(out)  # here forward
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    print(f"rank {rank} weights",
          [p.detach().double().sum().item().hex() for p in model.parameters()], flush=True)
    dist.destroy_process_group()
"""


def _torchrun(args, cwd, timeout=120):
    # `python -m torch.distributed.run` is torchrun; the launcher's own agent store is
    # what the ranks talk through
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=clean_env(), timeout=timeout)


def _exit_codes(out: str) -> dict:
    """rank -> exit code, from torchrun's failure summary."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                       out)
    return {int(r): int(c) for r, c in found}


def test_a_nan_on_rank_1_stops_it_and_rank_0_writes_peer_stop(write_program, tmp_path):
    prog = write_program(TRAIN)
    result = _torchrun(["-m", "mldebug", "--batch", "--report", tmp_path / "r.jsonl", prog,
                        "forward"], cwd=tmp_path)
    stops = {s["rank"]: s for s in read_report(tmp_path / "r.jsonl")}
    assert sorted(stops) == [0, 1], result.stderr          # one whole line each
    first = stops[1]
    assert (first["reason"], first["stage"], first["line"]) == (
        "inf", "forward", marker_line(prog, "# here forward"))
    assert (first["world_size"], first["local_rank"]) == (2, 1) and first["host"]
    peer = stops[0]
    assert peer["reason"] == "peer_stop"
    assert peer["peer"]["rank"] == 1 and peer["peer"]["line"] == first["line"]
    assert peer["message"].startswith(
        f"rank 1 stopped at prog.py:{first['line']} (Inf from aten.div)")
    assert peer["exception"] == ""           # no gloo error recorded as the program's
    combined = result.stdout + result.stderr
    assert "[rank 1] mldebug: stop: " in combined and "[rank 0] mldebug: stop: rank 1" in combined
    assert "Connection closed by peer" not in combined
    assert _exit_codes(combined) == {0: 3, 1: 3}             # --batch's status, no kill


def test_a_nan_made_on_rank_1_reaches_rank_0_through_the_all_reduce(write_program, tmp_path):
    prog = write_program(TRAIN)
    result = _torchrun(["-m", "mldebug", "--batch", "--report", tmp_path / "r.jsonl", prog,
                        "allreduce"], cwd=tmp_path)
    stops = {s["rank"]: s for s in read_report(tmp_path / "r.jsonl")}
    assert sorted(stops) == [0, 1], result.stderr
    made = stops[1]
    assert (made["reason"], made["stage"], made["created"]) == ("inf", "backward", True)
    assert made["line"] == marker_line(prog, "# here allreduce")
    reached = stops[0]                         # rank 0 does not blame its own ops
    assert reached["created"] is False
    assert reached["culprit"] == "a gradient collective from rank 1"
    assert reached["peer"]["rank"] == 1 and reached["peer"]["line"] == made["line"]
    assert _exit_codes(result.stdout + result.stderr) == {0: 3, 1: 3}


def test_a_clean_two_rank_run_is_bitwise_the_run_without_mldebug(write_program, tmp_path):
    prog = write_program(TRAIN)
    plain = _torchrun([prog, "none"], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    watched = _torchrun(["-m", "mldebug", "--batch", "--report", tmp_path / "r-{rank}.jsonl",
                         prog, "none"], cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr
    weights = lambda out: sorted(l for l in out.splitlines() if " weights " in l)  # noqa: E731
    assert weights(watched.stdout) == weights(plain.stdout) and len(weights(plain.stdout)) == 2
    # `{rank}` in --report: one file a rank, both empty
    assert [p.name for p in sorted(tmp_path.glob("r-*.jsonl"))] == ["r-0.jsonl", "r-1.jsonl"]
    assert all(read_report(p) == [] for p in tmp_path.glob("r-*.jsonl"))
