"""What mldebug costs the launcher's store, counted on the store's Python methods in the
ranks of real torchrun jobs (gloo, CPU): a healthy job adds no request while it runs
(each rank's watcher sleeps in one store wait), a stop reaches every rank of a job of
two launcher agents x two ranks with a few requests a rank, and a rank whose watcher is
waiting in the store exits as any program does.

Each test program starts with COUNT: every call of a `torch.distributed.Store` method
appends `time who method key` to the rank's log at once (`who`: mldebug's package or
the job), so that a rank ended by `os._exit` loses none. A call made before the program
started (the watcher's first wait, from mldebug's start-up) is not in the log.
"""
from __future__ import annotations

import io
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

from conftest import clean_env, read_report

COUNT = """
    import os
    import sys
    import time

    import torch.distributed as _dist


    def count_store_calls(folder):
        import mldebug
        root = os.path.dirname(mldebug.__file__) + os.sep
        fd = os.open(os.path.join(folder, f"calls-{os.environ['RANK']}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

        def log(who, what, key=""):
            os.write(fd, f"{time.time():.6f} {who} {what} {key}\\n".encode())

        def counting(name, method):
            def counted(self, *args, **kwargs):
                key = args[0] if args else ""
                if not isinstance(key, str):
                    key = f"[{len(key)} keys]" if len(key) != 1 else key[0]
                caller = sys._getframe(1).f_code.co_filename
                log("mldebug" if caller.startswith(root) else "job", name, key)
                return method(self, *args, **kwargs)
            return counted

        for name in ("add", "append", "check", "compare_set", "delete_key", "get",
                     "multi_get", "multi_set", "num_keys", "set", "wait", "queue_push",
                     "queue_pop", "list_keys"):
            setattr(_dist.Store, name, counting(name, getattr(_dist.Store, name)))
        return lambda label: log("mark", label)


    mark = count_store_calls(sys.argv[1])
"""

HEALTHY = COUNT + """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.distributed_c10d._get_default_store().set(f"probe-{rank}", "1")  # counted: the job's
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(rank)


    def step():
        x, y = torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


    step()
    mark("start")
    for _ in range(30):          # 3 s and more of training, the same steps on each rank
        step()
        time.sleep(0.1)
    mark("end")
    sys.stdout.write(f"rank {rank} trained\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    # torch 2.13's gloo teardown aborts 1 plain torchrun run in 5 or so at interpreter exit
    # ("terminate called without an active exception"), mldebug or not: end here
    os._exit(0)
"""


def _calls(folder: Path, rank: int) -> list[tuple[float, str, str, str]]:
    """(time, who, method, key) of each store call rank RANK's log holds."""
    rows = []
    for line in (folder / f"calls-{rank}.log").read_text().splitlines():
        when, who, what, *key = line.split(" ")
        rows.append((float(when), who, what, " ".join(key).strip()))
    return rows


def _mark(rows, label: str) -> float:
    return next(t for t, who, what, _ in rows if who == "mark" and what == label)


def _by_mldebug(rows, after: float, before: float = float("inf")) -> list[str]:
    return [f"{what} {key}".strip() for t, who, what, key in rows
            if who == "mldebug" and after <= t <= before]


def _past_the_arm(calls: list[str], rank: int) -> list[str]:
    """CALLS without the watcher's first wait, when the program's COUNT was installed
    before it (the watcher's thread connects while mldebug starts the program)."""
    return calls[1:] if calls[:1] == [f"wait wake/{rank}"] else calls


def _torchrun(args, cwd, timeout=120, **env):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, env=clean_env(**env), timeout=timeout)


@pytest.mark.parametrize("mode", ["--batch", "interactive"])
def test_a_healthy_job_asks_the_store_nothing_while_it_trains(write_program, tmp_path, mode):
    """Two DDP ranks train for 3 s and more: mldebug makes no store call in that time
    (each rank's watcher waits in one store request sent before the program started;
    a watcher that looked every 0.1 s would make 30 and more a rank)."""
    prog = write_program(HEALTHY)
    result = _torchrun(["-m", "mldebug", *([mode] if mode == "--batch" else []), prog,
                        tmp_path], cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert sorted(re.findall(r"rank (\d) trained", result.stdout)) == ["0", "1"]
    for rank in (0, 1):
        rows = _calls(tmp_path, rank)
        start, end = _mark(rows, "start"), _mark(rows, "end")
        assert end - start >= 3.0
        # the count is real: the job's own store call before the window is in the log
        assert any(who == "job" and what == "set" and key == f"probe-{rank}"
                   for _, who, what, key in rows), rows
        window = _past_the_arm(_by_mldebug(rows, start, end), rank)
        assert window == [], (rank, window)
        print(f"rank {rank}: {len(window)} store calls from mldebug "
              f"in {end - start:.1f} s of training; "
              f"{sum(1 for t, who, *_ in rows if who == 'job' and start <= t <= end)} "
              "from the job")


EXIT = COUNT + """
    # no process group: the watcher still waits in torchrun's agent store
    rank = int(os.environ["RANK"])
    if rank == 1:
        import types


        class SlowEnd:
            def __init__(self):
                self.sleep = time.sleep

            def __del__(self):
                self.sleep(3)


        # rank 1's interpreter shutdown takes 3 s: it clears the modules' names
        sys.modules["slow_end"] = types.ModuleType("slow_end")
        sys.modules["slow_end"].it = SlowEnd()
        time.sleep(1)
    else:
        from datetime import timedelta
        from mldebug.peers import _prefix
        time.sleep(2.5)             # rank 1 is shutting down: ring its doorbell now
        _dist.PrefixStore(_prefix(), _dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timedelta(seconds=30))).set("wake/1", "1")
    print(f"rank {rank} done", flush=True)
    # the interpreter's own exit: atexit, then its shutdown
"""


@pytest.mark.parametrize("mode", ["--batch", "interactive"])
def test_a_rank_exits_cleanly_while_its_watcher_waits_in_the_store(write_program, tmp_path,
                                                                    mode):
    """A rank's program ends the plain way while its watcher is blocked in a store wait:
    at exit the rank rings its own doorbell (one `set`), the watcher leaves the store
    and is joined before the interpreter shuts down. A ring that comes during the
    shutdown (rank 0 rings rank 1's doorbell while rank 1's takes 3 s) finds no thread
    in the store's C++ to wake (a daemon thread woken there aborts the process:
    'terminate called without an active exception'): status 0, no traceback, no c10d
    warning."""
    prog = write_program(EXIT)
    result = _torchrun(["-m", "mldebug", *([mode] if mode == "--batch" else []), prog,
                        tmp_path], cwd=tmp_path, timeout=60)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    assert sorted(re.findall(r"rank (\d) done", out)) == ["0", "1"], out
    for noise in ("terminate called", "Traceback", "[W", "Exception raised"):
        assert noise not in out, out
    for rank in (0, 1):
        assert _past_the_arm(_by_mldebug(_calls(tmp_path, rank), 0), rank) == \
            [f"set wake/{rank}"]


STOP = COUNT + """
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # the second rank of the agent told to stop (MLDEBUG_TEST_STOP_HERE): where it stops
    stops = os.environ.get("MLDEBUG_TEST_STOP_HERE") == "1" and os.environ["LOCAL_RANK"] == "1"
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(4):
        x = torch.randn(8, 4)
        out = model(x)
        if stops and step == 2:
            mark("stop")
            out = out / torch.zeros_like(out)  # here
        loss = out.pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} finished\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)
"""


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _agents(args, cwd, stop_on: int, spawn):
    """Two torchrun agents of one job on this host (c10d rendezvous), 2 ranks each;
    the second rank of agent STOP_ON stops. SPAWN(command, env) starts each."""
    endpoint = f"127.0.0.1:{_free_port()}"
    agents = []
    for node in (0, 1):
        command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                   "--nproc-per-node", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint",
                   endpoint, "--rdzv-id", f"store-test-{endpoint}", "--node-rank", str(node),
                   "--max-restarts", "0", *map(str, args)]
        env = clean_env(MLDEBUG_TEST_STOP_HERE="1" if node == stop_on else "0")
        agents.append(spawn(command, env))
    return agents


def _popen(command, cwd, env) -> subprocess.Popen:
    """An agent in a process group of its own, with its ranks (see _end)."""
    return subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _end(agent: subprocess.Popen) -> None:
    """An agent a failed test left running ends with its ranks."""
    try:
        os.killpg(agent.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    agent.wait(timeout=30)


def _exit_codes(out: str) -> dict:
    """rank -> exit code, from torchrun's failure summary."""
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)",
                       out)
    return {int(r): int(c) for r, c in found}


def test_a_stop_reaches_every_rank_of_two_agents_with_a_few_requests_each(write_program,
                                                                          tmp_path):
    """2 launcher agents x 2 ranks, --batch: one rank's Inf; the three others (one on its
    agent, two on the other) each write a peer_stop line and exit 3 after five store
    requests (clear the doorbell, look for the first stop, read it, say the line is
    written, wait for the stopped rank's line), whatever the job's size; the stopped rank
    rings every doorbell with one request. The time from the stop to each peer's line is
    printed: it is the store's round trips, not a polling period."""
    prog = write_program(STOP)
    report = tmp_path / "r.jsonl"
    spawn = lambda command, env: _popen(command, tmp_path, env)  # noqa: E731
    agents = _agents(["-m", "mldebug", "--batch", "--report", report, prog, tmp_path],
                     tmp_path, stop_on=1, spawn=spawn)
    try:
        outs = [agent.communicate(timeout=120)[0] for agent in agents]
    finally:
        for agent in agents:
            _end(agent)
    combined = "\n".join(outs)
    stops = {s["rank"]: s for s in read_report(report)}
    assert sorted(stops) == [0, 1, 2, 3], combined
    stopped = [rank for rank, s in stops.items() if s["reason"] == "inf"]
    assert len(stopped) == 1, stops
    first = stopped[0]
    peers = [rank for rank in stops if rank != first]
    for rank in peers:
        assert stops[rank]["reason"] == "peer_stop" and stops[rank]["peer"]["rank"] == first
    assert {**_exit_codes(outs[0]), **_exit_codes(outs[1])} == {0: 3, 1: 3, 2: 3, 3: 3}
    assert "Connection closed by peer" not in combined

    rows = {rank: _calls(tmp_path, rank) for rank in range(4)}
    stop_at = _mark(rows[first], "stop")
    after = {rank: _by_mldebug(rows[rank], stop_at) for rank in range(4)}
    for rank in peers:
        assert _past_the_arm(_by_mldebug(rows[rank], 0, stop_at), rank) == []  # waiting
        assert after[rank] == [f"delete_key wake/{rank}", "check first_stop",
                               "get first_stop", "add acks", "wait first_stop_done"], after
    # (at exit the stopped rank rings its own doorbell once more when its watcher has
    # not yet left the store: that thread may still be reading the first stop, its own)
    own = list(after[first])
    done = own.index("set first_stop_done")
    if f"set wake/{first}" in own[done:]:
        del own[own.index(f"set wake/{first}", done)]
    mine = Counter(call.split(" ")[0] for call in own)
    assert (mine["compare_set"], mine["multi_set"], mine["set"]) == (1, 1, 1), after[first]
    assert "multi_set [4 keys]" in after[first]             # one request rings all four
    latency = {rank: next(t for t, who, what, _ in rows[rank]
                          if who == "mldebug" and what == "add" and t >= stop_at) - stop_at
               for rank in peers}
    print(f"stop on rank {first}: requests after it, by rank: "
          f"{ {rank: len(calls) for rank, calls in after.items()} }; "
          "from the stop to each peer's peer_stop line: "
          + ", ".join(f"rank {rank} {seconds * 1000:.0f} ms" for rank, seconds in latency.items()))


def test_on_the_default_groups_store_a_stop_reaches_the_other_rank_the_same_way(
        write_program, tmp_path):
    """Without torchrun's shared store (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1: the default
    group's store, served from rank 0's process, as other launchers do): the watcher
    waits there once the program has initialised the group (one request), and a stop
    reaches the other rank with the same five requests."""
    prog = write_program(STOP)
    report = tmp_path / "r.jsonl"
    result = _torchrun(["-m", "mldebug", "--batch", "--report", report, prog, tmp_path],
                       cwd=tmp_path, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                       MLDEBUG_TEST_STOP_HERE="1")
    combined = result.stdout + result.stderr
    stops = {s["rank"]: s for s in read_report(report)}
    assert (stops[1]["reason"], stops[0]["reason"]) == ("inf", "peer_stop"), combined
    assert stops[0]["peer"]["rank"] == 1
    assert _exit_codes(combined) == {0: 3, 1: 3}
    # (the watcher's first wait comes after the program's init_process_group: counted)
    calls = _by_mldebug(_calls(tmp_path, 0), 0)
    assert calls == ["wait wake/0", "delete_key wake/0", "check first_stop", "get first_stop",
                     "add acks", "wait first_stop_done"], calls


def test_interactively_a_prompt_holds_the_ranks_of_both_agents_and_quit_ends_them(
        write_program, tmp_path):
    """2 launcher agents x 2 ranks, interactively: the stopped rank's prompt opens on its
    agent's terminal, the three other ranks print their waiting line, `q` there ends all
    four (status 0), each other rank having made a bounded number of store requests."""
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(STOP)
    children, transcript = [], io.StringIO()

    def spawn(command, env):
        if env["MLDEBUG_TEST_STOP_HERE"] == "1":       # the prompt's terminal
            child = pexpect.spawn(command[0], command[1:], cwd=str(tmp_path), env=env,
                                  encoding="utf-8", timeout=90, dimensions=(40, 200))
            child.logfile_read = transcript       # (its ranks write in any order)
        else:
            child = _popen(command, tmp_path, env)
        children.append(child)
        return child

    other, prompting = _agents(["-m", "mldebug", prog, tmp_path], tmp_path, stop_on=1,
                               spawn=spawn)
    try:
        prompting.expect(r"\[rank (\d)\] mldebug: [^\r\n]*Inf from aten\.div")
        first = int(prompting.match.group(1))
        prompting.expect(r"\(mldebug\)")
        prompting.sendline("q")
        prompting.expect(pexpect.EOF)
        prompt_out = transcript.getvalue()
        other_out = other.communicate(timeout=60)[0]
    finally:
        for child in children:
            if isinstance(child, subprocess.Popen):
                _end(child)
            else:
                child.close(force=True)
    assert prompting.exitstatus == 0 and other.returncode == 0, prompt_out + other_out
    combined = prompt_out + other_out
    peers = [rank for rank in range(4) if rank != first]
    for rank in peers:
        assert re.search(rf"\[rank {rank}\] waiting: rank {first} stopped at prog\.py:\d+ "
                         r"\(Inf from aten\.div\)", combined), combined
        assert f"[rank {rank}] mldebug: rank {first} ended the program at its prompt" \
            in combined, combined
    assert "finished" not in combined
    rows = {rank: _calls(tmp_path, rank) for rank in range(4)}
    stop_at = _mark(rows[first], "stop")
    after = {rank: _by_mldebug(rows[rank], stop_at) for rank in range(4)}
    # three rings (the first stop, the prompt, its end): at most five requests each
    assert all(len(after[rank]) <= 15 for rank in peers), after
    assert Counter(c.split(" ")[0] for c in after[first])["multi_set"] == 3, after[first]
    latency = {rank: next(t for t, who, what, key in rows[rank]
                          if who == "mldebug" and what == "get" and key == "pause/1") - stop_at
               for rank in peers}
    print(f"stop on rank {first}: requests after it, by rank: "
          f"{ {rank: len(calls) for rank, calls in after.items()} }; "
          "from the stop to each peer's waiting line: "
          + ", ".join(f"rank {rank} {seconds * 1000:.0f} ms" for rank, seconds in latency.items()))


# -- the watcher in this process, against a store of the test's own -----------------------
def _peers_on(monkeypatch, port: int):
    """Rank 1 of 2 (--batch) whose launcher's store is the one on PORT."""
    from mldebug import peers
    from mldebug.core.ranks import RankInfo
    from mldebug.core.session import Session
    for name, value in {"TORCHELASTIC_USE_AGENT_STORE": "True", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "unit",
                        "TORCHELASTIC_RESTART_COUNT": "0"}.items():
        monkeypatch.setenv(name, value)
    looks = []
    look = peers.Peers._look
    monkeypatch.setattr(peers.Peers, "_look", lambda self, store: looks.append(1) or
                        look(self, store))
    return peers.Peers(Session(batch=True, out=io.StringIO()),
                       RankInfo(rank=1, local_rank=1, world_size=2, host="here")), looks


def _until(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_quiet_watcher_rings_itself_before_its_wait_reaches_its_limit(monkeypatch, capfd):
    """The doorbell wait's own limit (WAIT_S, 5 s here) is never reached: the rank rings
    its own doorbell every REARM_S (0.3 s here) and the watcher waits again, so c10d
    never prints its timeout warnings; at exit the watcher leaves at once."""
    from datetime import timedelta

    import torch.distributed as dist
    from mldebug import peers
    monkeypatch.setattr(peers, "WAIT_S", 5.0)
    monkeypatch.setattr(peers, "REARM_S", 0.3)
    server = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=30))
    watcher, looks = _peers_on(monkeypatch, server.port)
    try:
        assert _until(lambda: len(looks) >= 4), looks      # four waits, each rung
    finally:
        watcher._close()
    assert not watcher._thread.is_alive()
    err = capfd.readouterr().err
    assert "timed out" not in err and "likely a timeout" not in err, err


def test_the_watcher_ends_quietly_when_the_store_goes_away(monkeypatch, capfd, tmp_path):
    """The launcher's store ends under a waiting watcher: the watcher returns (no hang,
    no Python traceback; c10d itself logs that the connection closed) and this rank's
    exit asks nothing of the dead store."""
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys\nfrom datetime import timedelta\n"
         "import torch.distributed as dist\n"
         "s = dist.TCPStore('127.0.0.1', 0, None, True, timedelta(seconds=30))\n"
         "print(s.port, flush=True)\nsys.stdin.read()\n"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=clean_env())
    try:
        port = int(server.stdout.readline())
        watcher, looks = _peers_on(monkeypatch, port)
        import torch.distributed as dist
        from datetime import timedelta
        from mldebug import peers
        ringer = dist.PrefixStore(peers._prefix(), dist.TCPStore(
            "127.0.0.1", port, is_master=False, timeout=timedelta(seconds=30)))
        ringer.set("wake/1", "1")
        assert _until(lambda: len(looks) == 1)            # connected, rung, waiting again
        server.kill()
        server.wait(timeout=30)
        watcher._thread.join(timeout=30)
        assert not watcher._thread.is_alive()
        before_exit = capfd.readouterr().err
        watcher._close()
        assert capfd.readouterr().err == ""               # nothing asked of the dead store
    finally:
        server.kill()
    assert "Traceback" not in before_exit and "Exception in thread" not in before_exit, \
        before_exit
