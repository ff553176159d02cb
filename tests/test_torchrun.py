"""Multi-rank jobs as a user launches them: `torchrun --nproc-per-node 2 -m mldebug ...`
(and `accelerate launch`) on CPU (gloo, DDP, FSDP2, a device mesh). A stop names its
rank; the other rank writes a `peer_stop` line and exits 3; a NaN that reaches a rank
through the gradient all-reduce names the rank that made it; interactively the other
ranks wait, outwait the process group's timeout, and end with the stopped rank; mldebug
adds no collective to a healthy step; nothing hangs (every run has a timeout, and hitting
it fails the test)."""
from __future__ import annotations

import ast
import io
import re
import subprocess
import sys
import time

import pytest

from conftest import clean_env, marker_line, read_report

TRAIN = """
    import sys
    import os
    import time
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    where = sys.argv[1]           # none | forward | allreduce | raise


    class Norm(nn.Module):
        def forward(self, h):
            return torch.sqrt(h * h + 0.0)  # here allreduce


    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8, bias=False), Norm(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if where == "allreduce" and rank == 0:
        # rank 0's second call of step 2 is the watch's re-run of it (rank 1's Inf came
        # in through the all-reduce): slow, so that rank 1's stop is heard meanwhile
        calls = {}

        def slow_rerun(module, args, out):
            calls[step] = calls.get(step, 0) + 1
            if step == 2 and calls[step] == 2:
                time.sleep(1.5)

        model.module.register_forward_hook(slow_rerun)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        if where == "allreduce" and rank == 1 and step == 2:
            x = torch.zeros_like(x)     # sqrt'(0): an Inf made in rank 1's backward only
        out = model(x)
        if where == "forward" and rank == 1 and step == 2:
            out = out / torch.zeros_like(out)  # here forward
        if where == "raise" and rank == 1 and step == 2:
            raise ValueError("a bad batch on rank 1")  # here raise
        loss = ((out - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    # one write: the ranks share the launcher's stdout
    sys.stdout.write(f"rank {rank} weights "
                     f"{[p.detach().double().sum().item().hex() for p in model.parameters()]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # torch 2.13's gloo teardown aborts 1 plain torchrun run in 5 or so at interpreter exit
    # ("terminate called without an active exception"), mldebug or not: end here
    os._exit(0)
"""


def _torchrun(args, cwd, timeout=120):
    # `python -m torch.distributed.run` is torchrun; the launcher's own agent store is
    # what the ranks talk through
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=clean_env(), timeout=timeout)


def _expect_each(child, patterns: list[str]) -> None:
    """Wait until each pattern has been printed, in whatever order the ranks print them
    (pexpect drops what precedes a match, so one pattern expected at a time could drop
    another printed before it)."""
    left = list(patterns)
    while left:
        left.pop(child.expect(left))


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


def test_an_uncaught_exception_on_rank_1_ends_rank_0_with_peer_stop(write_program, tmp_path):
    """--batch: rank 1 raises (no NaN); rank 0, by then blocked in the step's all-reduce,
    writes its peer_stop line naming rank 1's exception and exits 3; rank 1 keeps an
    uncaught exception's status 1; nothing waits for gloo's timeout."""
    prog = write_program(TRAIN)
    started = time.monotonic()
    result = _torchrun(["-m", "mldebug", "--batch", "--report", tmp_path / "r.jsonl", prog,
                        "raise"], cwd=tmp_path, timeout=90)
    assert time.monotonic() - started < 60
    stops = {s["rank"]: s for s in read_report(tmp_path / "r.jsonl")}
    assert sorted(stops) == [0, 1], result.stdout + result.stderr
    raised = stops[1]
    assert (raised["reason"], raised["line"]) == ("exception", marker_line(prog, "# here raise"))
    assert "ValueError: a bad batch on rank 1" in raised["message"]
    peer = stops[0]
    assert peer["reason"] == "peer_stop" and peer["exception"] == ""
    assert peer["peer"]["rank"] == 1 and peer["peer"]["line"] == raised["line"]
    assert peer["message"].startswith(f"rank 1 stopped at prog.py:{raised['line']} (uncaught "
                                      "ValueError: a bad batch on rank 1")
    combined = result.stdout + result.stderr
    assert "[rank 0] mldebug: stop: rank 1 stopped" in combined
    assert "Connection closed by peer" not in combined
    assert _exit_codes(combined) == {0: 3, 1: 1}


def test_accelerate_launch_runs_the_job_the_same_way(write_program, tmp_path):
    """`accelerate launch --multi_gpu --num_processes 2 -m mldebug ...` (accelerate's
    multi-process launcher is torchrun's, run in-process; --multi_gpu is its name for it
    even on CPU: `--cpu` would launch one process): no config file, no network, a free
    port. Rank 1 stops, rank 0 writes its peer_stop line, both exit 3."""
    pytest.importorskip("accelerate")
    prog = write_program(TRAIN)
    result = subprocess.run(
        [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
         "2", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
         "--main_process_port", "0", "-m", "mldebug", "--batch", "--report",
         str(tmp_path / "r.jsonl"), str(prog), "forward"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env=clean_env(HF_HOME=str(tmp_path / "hf")))    # no accelerate config anywhere
    stops = {s["rank"]: s for s in read_report(tmp_path / "r.jsonl")}
    assert sorted(stops) == [0, 1], result.stdout + result.stderr
    assert (stops[1]["reason"], stops[1]["line"]) == ("inf", marker_line(prog, "# here forward"))
    assert stops[0]["reason"] == "peer_stop" and stops[0]["peer"]["rank"] == 1
    assert stops[0]["message"].startswith(
        f"rank 1 stopped at prog.py:{stops[1]['line']} (Inf from aten.div)")
    combined = result.stdout + result.stderr
    assert "[rank 0] mldebug: stop: rank 1" in combined
    assert "Connection closed by peer" not in combined
    assert _exit_codes(combined) == {0: 3, 1: 3}


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


WRAPPERS = """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn

    mode = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))


    class WithSpare(nn.Module):     # a parameter no forward uses: find_unused_parameters'
        def __init__(self, body):
            super().__init__()
            self.body = body
            self.spare = nn.Linear(4, 3)

        def forward(self, x):
            return self.body(x)


    if mode == "unused":
        net = WithSpare(net)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for layer in net:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        model = fully_shard(net)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP
        model = DDP(net, find_unused_parameters=mode == "unused", static_graph=mode == "static")
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(4):
        for micro in range(2):
            x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
            if mode == "nosync" and micro == 0:
                with model.no_sync():
                    ((model(x) - y) ** 2).mean().backward()
                continue
            ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    if mode == "unused":             # DDP found it unused: no gradient, never updated
        spare = model.module.spare.weight
        sys.stdout.write(f"rank {rank} spare grad {spare.grad} sum {spare.detach().sum().item()}\\n")
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    sys.stdout.write(f"rank {rank} weights {[p.detach().double().sum().item().hex() for p in full]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # torch 2.13's gloo teardown aborts 1 plain torchrun run in 5 or so at interpreter exit
    # ("terminate called without an active exception"), mldebug or not: end here
    os._exit(0)
"""


@pytest.mark.parametrize("mode", ["fsdp", "unused", "static", "nosync"])
def test_fsdp_and_ddp_options_run_clean_and_bitwise(write_program, tmp_path, mode):
    """FSDP2 (`fully_shard`, on CPU with gloo), DDP with find_unused_parameters,
    static_graph and gradient accumulation under no_sync(), with AdamW: no false stop,
    the same bits as without mldebug."""
    prog = write_program(WRAPPERS)
    plain = _torchrun([prog, mode], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    watched = _torchrun(["-m", "mldebug", "--batch", "--report", tmp_path / "r.jsonl", prog,
                         mode], cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr
    assert read_report(tmp_path / "r.jsonl") == []
    weights = lambda out: sorted(l for l in out.splitlines() if " weights " in l)  # noqa: E731
    assert weights(watched.stdout) == weights(plain.stdout) and len(weights(plain.stdout)) == 2
    if mode == "unused":
        spare = sorted(l for l in watched.stdout.splitlines() if " spare grad " in l)
        assert len(spare) == 2 and all(" spare grad None " in l for l in spare), spare
        assert spare == sorted(l for l in plain.stdout.splitlines() if " spare grad " in l)


MESH = """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # the mesh initialises the default group itself and makes a group a dimension
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard"))
    rank = dist.get_rank()
    timeout = lambda pg: pg._get_backend(torch.device("cpu")).options._timeout  # noqa: E731
    timeouts = [timeout(dist.group.WORLD), timeout(mesh.get_group("shard")),
                timeout(mesh.get_group("replicate"))]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    model = fully_shard(net, mesh=mesh["shard"])
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    for step in range(3):
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        ((model(x) - y) ** 2).mean().backward()
        opt.step()
        opt.zero_grad()
    full = [p.full_tensor() for p in model.parameters()]
    sys.stdout.write(f"rank {rank} timeouts {[str(t) for t in timeouts]} "
                     f"weights {[p.detach().double().sum().item().hex() for p in full]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)
"""


def test_a_device_mesh_job_gets_the_hold_interactively_and_trains_the_same(write_program,
                                                                         tmp_path):
    """init_device_mesh (2 ranks, a 1x2 mesh: groups made by the mesh) and FSDP2 on its
    'shard' dimension, with mldebug interactively and no stop: every group waits the
    6-hour hold (the backend's 30 minutes without mldebug, and with --batch), the wrapped
    calls keep the mesh working, and the weights are the same bits."""
    prog = write_program(MESH)
    lines = lambda out: sorted(l for l in out.splitlines() if " timeouts " in l)  # noqa: E731
    plain = _torchrun([prog], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    watched = _torchrun(["-m", "mldebug", prog], cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr
    batch = _torchrun(["-m", "mldebug", "--batch", prog], cwd=tmp_path)
    assert batch.returncode == 0, batch.stderr
    assert len(lines(plain.stdout)) == 2
    for line in lines(plain.stdout) + lines(batch.stdout):
        assert "timeouts ['0:30:00', '0:30:00', '0:30:00']" in line
    for line in lines(watched.stdout):
        assert "timeouts ['6:00:00', '6:00:00', '6:00:00']" in line
    weights = lambda out: [l.split(" weights ")[1] for l in lines(out)]  # noqa: E731
    assert weights(watched.stdout) == weights(plain.stdout) == weights(batch.stdout)
    assert "process groups wait up to 6:00:00" in watched.stderr
    assert "process groups wait" not in batch.stderr


COLLECTIVES = """
    import collections
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed import distributed_c10d as c10d
    from torch.nn.parallel import DistributedDataParallel as DDP

    # every collective the Python API is asked for, by name, whoever asks
    calls = collections.Counter()

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name in ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
                 "reduce_scatter_tensor", "reduce", "barrier", "all_gather_object",
                 "broadcast_object_list", "gather", "scatter", "all_to_all", "send", "recv"):
        fn = getattr(c10d, name)
        setattr(c10d, name, counting(name, fn))
        setattr(dist, name, c10d.__dict__[name])

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    world = dist.group.WORLD
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)
    per_step = []
    for step in range(5):
        # every collective on the job's group, Python or C++ (DDP's reducer): its sequence
        before, counted = world._get_sequence_number_for_group(), sum(calls.values())
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        per_step.append((world._get_sequence_number_for_group() - before,
                         sum(calls.values()) - counted))
    groups = len(c10d._world.pg_map)
    sys.stdout.write(f"rank {rank} collectives {per_step} groups {groups} calls {dict(calls)}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)
"""


@pytest.mark.parametrize("mode", ["--batch", "interactive"])
def test_the_watch_adds_no_collective_to_a_healthy_step(write_program, tmp_path, mode):
    """Per healthy step, the job's group runs as many collectives under mldebug as under
    plain python (its sequence number counts DDP's C++ all-reduce too), mldebug asks the
    Python API for none and makes no process group of its own."""
    prog = write_program(COLLECTIVES)
    counts = lambda out: sorted(l for l in out.splitlines() if " collectives " in l)  # noqa: E731
    plain = _torchrun([prog], cwd=tmp_path)
    assert plain.returncode == 0, plain.stderr
    watched = _torchrun(["-m", "mldebug", *([mode] if mode == "--batch" else []), prog],
                        cwd=tmp_path)
    assert watched.returncode == 0, watched.stderr
    assert counts(watched.stdout) == counts(plain.stdout) and len(counts(plain.stdout)) == 2
    # (the count is real: at least DDP's one gradient bucket, one all-reduce a step; the
    # 2nd step also syncs DDP's rebuilt buckets)
    found = re.search(r"collectives (\[.*?\]) groups 1 calls \{\}", plain.stdout)
    assert found and all(on_group >= 1 for on_group, _ in ast.literal_eval(found.group(1))), plain.stdout


PAUSE = """
    import sys
    import os
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        if rank == 1 and step == 1:
            bad = torch.log(-torch.ones(1))  # here
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} weights {[p.detach().sum().item() for p in model.parameters()]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # torch 2.13's gloo teardown aborts 1 plain torchrun run in 5 or so at interpreter exit
    # ("terminate called without an active exception"), mldebug or not: end here
    os._exit(0)
"""


@pytest.mark.parametrize("command", ["c", "q"])
def test_interactively_rank_1_prompts_rank_0_waits_and_follows(write_program, tmp_path,
                                                                 command):
    """The pty a user has: rank 1's prompt, rank 0's waiting line; `inspect` works on
    rank 1; `c` lets both ranks finish, `q` ends both (no stuck peer)."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(PAUSE)
    line = marker_line(prog)
    child = pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", "-m", "mldebug", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    try:
        # the two ranks write to the terminal in any order: rank 0 hears of the stop
        # (its doorbell rings) as rank 1 posts it, before rank 1 prints it
        _expect_each(child, [
            r"\[rank 1\] mldebug: 1 NaN from aten\.log",
            r"\(mldebug\)",
            rf"\[rank 0\] waiting: rank 1 stopped at prog\.py:{line} \(NaN from aten\.log\)"])
        child.sendline("inspect x")
        child.expect(r"x: tensor\[8, 4\] f32")
        child.sendline(command)
        if command == "q":
            child.expect(r"\[rank 0\] mldebug: rank 1 ended the program at its prompt")
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    finished = re.findall(r"rank (\d) weights", out)
    assert sorted(finished) == (["0", "1"] if command == "c" else [])


def test_a_rank_whose_output_is_filtered_serves_its_prompt_for_attach(write_program, tmp_path):
    """`--local-ranks-filter 0` hides rank 1's output: its stop says, on the launcher's
    terminal, how to reach its prompt; `mldebug attach` gets the prompt, `c` goes on."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(PAUSE)
    child = pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", "--local-ranks-filter", "0",
                                           "-m", "mldebug", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    client = None
    try:
        child.expect(r"\[rank 1\] mldebug: this rank's output is not on this terminal; its "
                     r"prompt: python -m mldebug attach (127\.0\.0\.1:\d+)")
        client = pexpect.spawn(sys.executable, ["-m", "mldebug", "attach", child.match.group(1)],
                               cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=30)
        client.expect(rf"-> bad = torch\.log\(-torch\.ones\(1\)\)  # here")
        client.expect(r"\(mldebug\) ")
        client.sendline("inspect x")
        client.expect(r"x: tensor\[8, 4\] f32")
        client.sendline("c")
        client.expect("the program goes on; this prompt closes")
        client.expect(pexpect.EOF)
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close(force=True)
        if client is not None:
            client.close(force=True)
    assert child.exitstatus == 0 and client.exitstatus == 0
    assert "rank 0 weights" in out                  # rank 1's own output stays filtered


def test_attach_says_what_is_wrong(tmp_path):
    bad = subprocess.run([sys.executable, "-m", "mldebug", "attach", "nowhere"],
                         capture_output=True, text=True, env=clean_env(), timeout=60)
    assert bad.returncode == 2 and "expected HOST:PORT, got 'nowhere'" in bad.stderr
    import socket
    with socket.socket() as probe:              # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    gone = subprocess.run([sys.executable, "-m", "mldebug", "attach", f"127.0.0.1:{port}"],
                          capture_output=True, text=True, env=clean_env(), timeout=60)
    assert gone.returncode == 1 and f"cannot connect to 127.0.0.1:{port}" in gone.stderr


SHORT_TIMEOUT = """
    import os
    import sys
    import time
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo", timeout=timedelta(seconds=5))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        if rank == 1 and step == 1:
            time.sleep(2)         # rank 0 is inside the backward's all-reduce by now
            bad = torch.log(-torch.ones(1))  # here
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} weights {[p.detach().sum().item() for p in model.parameters()]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)
"""


def test_a_rank_inside_a_collective_outwaits_the_prompt(write_program, tmp_path):
    """The program asks for a 5 s process group timeout; rank 0 is already blocked in
    DDP's all-reduce when rank 1 stops, and the user stays at the prompt longer than 5 s:
    mldebug's hold (core/pg_timeout.py) keeps rank 0 waiting, and `c` lets both finish."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(SHORT_TIMEOUT)
    child = pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", "-m", "mldebug", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    try:
        child.expect(r"\[rank 0\] mldebug: process groups wait up to 6:00:00 in a collective "
                     r"\(not the program's 0:00:05\)")
        child.expect(r"\[rank 1\] mldebug: 1 NaN from aten\.log")
        child.expect(r"\(mldebug\)")
        time.sleep(8)               # longer than the program's timeout
        child.sendline("c")
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close(force=True)
    # (with --hold-timeout 0 rank 0 dies here: the test below)
    assert "Timed out" not in out and "Connection closed by peer" not in out, out
    assert child.exitstatus == 0, out
    assert sorted(re.findall(r"rank (\d) weights", out)) == ["0", "1"]


def test_without_the_hold_that_rank_times_out(write_program, tmp_path):
    """The same job with `--hold-timeout 0` (the program's 5 s): rank 0, blocked in the
    all-reduce, dies with gloo's timeout while rank 1's prompt is open (what the hold is
    for); `q` there still ends both."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(SHORT_TIMEOUT)
    child = pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", "-m", "mldebug",
                                           "--hold-timeout", "0", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    # the whole transcript: rank 0's notice and its timeout's text come from two streams
    # of another process than rank 1's prompt, in no fixed order around the text matched
    child.logfile_read = transcript = io.StringIO()
    try:
        child.expect(r"\(mldebug\)")
        child.expect(r"Timed out waiting 5000ms", timeout=20)
        child.sendline("q")
        child.expect(pexpect.EOF)
        out = transcript.getvalue()
    finally:
        child.close(force=True)
    assert "process groups wait" not in out
    assert "rank 0 weights" not in out
    # rank 0's post-mortem waits for its turn at the terminal, and ends with rank 1's q
    assert "[rank 0] mldebug: rank 1's prompt has the terminal" in out, out
    assert "[rank 0] mldebug: rank 1 ended the program at its prompt" in out, out


RAISE_INTERACTIVELY = """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if rank == 1 and step == 1:
            raise ValueError("a bad batch on rank 1")  # here
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} finished\\n")
    dist.destroy_process_group()
    os._exit(0)
"""


def test_interactively_an_uncaught_exception_holds_the_others_and_ends_them(write_program,
                                                                            tmp_path):
    """Rank 1 raises: its post-mortem prompt opens, rank 0 (blocked in the all-reduce)
    says it waits for it; `q` there ends both (rank 1 keeps an exception's status 1)."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(RAISE_INTERACTIVELY)
    line = marker_line(prog)
    child = pexpect.spawn(sys.executable, ["-m", "torch.distributed.run", "--standalone",
                                           "--nproc-per-node", "2", "-m", "mldebug", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 200))
    try:
        _expect_each(child, [
            r"\[rank 1\] mldebug: uncaught ValueError: a bad batch on rank 1",
            r"\(mldebug\)",
            rf"\[rank 0\] waiting: rank 1 stopped at prog\.py:{line} \(uncaught "
            r"ValueError: a bad batch on rank 1"])
        child.sendline("q")
        child.expect(r"\[rank 0\] mldebug: rank 1 ended the program at its prompt")
        child.expect(pexpect.EOF)
        out = child.before
    finally:
        child.close(force=True)
    assert "finished" not in out and "Connection closed by peer" not in out, out
    assert _exit_codes(out) == {1: 1}, out
