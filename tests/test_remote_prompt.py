"""A rank's remote prompt and its door (mldebug/remote_prompt.py, core/prompt_key.py,
attach.py), as a user on a shared node meets them: the job's log survives a stop, only
the job's user gets the prompt, and bad clients at the door harm nothing.

Most tests run one process that says it is rank 1 of 2 (RANK, WORLD_SIZE), output to
files, stdin closed, in a session of its own (no controlling terminal): the way a rank
under `torchrun ... > train.log` runs, without the cost of a launcher. One test runs the
real torchrun job.
"""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import clean_env, marker_line

from mldebug.core import prompt_key

STOPS = """
    import torch
    x = torch.ones(3)
    print("before the stop", flush=True)
    bad = torch.log(-x)  # here
    print("after the stop", flush=True)
"""
ANNOUNCED = re.compile(r"its prompt: python -m mldebug attach ([\d.]+):(\d+)")


class PausedRank:
    """`python -m mldebug prog.py` as rank 1 of 2, paused at its stop, serving its prompt."""

    def __init__(self, tmp_path, source=STOPS, **env):
        self.tmp = tmp_path
        prog = tmp_path / "prog.py"
        prog.write_text(__import__("textwrap").dedent(source))
        self.out, self.err = tmp_path / "out.txt", tmp_path / "err.txt"
        self.env = clean_env(RANK="1", WORLD_SIZE="2", LOCAL_RANK="1",
                             MLDEBUG_CACHE_DIR=str(tmp_path / "cache"), **env)
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, "-m", "mldebug", str(prog)],
                                         cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out,
                                         stderr=err, env=self.env, start_new_session=True)
        found = self.wait_for(ANNOUNCED)
        self.host, self.port = found.group(1), int(found.group(2))

    def wait_for(self, pattern, timeout=60.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            text = self.err.read_text(errors="replace") + self.out.read_text(errors="replace")
            found = re.search(pattern, text)
            if found:
                return found
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r}; stderr:\n{self.err.read_text()}")

    def attach(self, *commands, extra=(), env=None):
        return subprocess.run([sys.executable, "-m", "mldebug", "attach", *extra],
                              input="".join(c + "\n" for c in commands), text=True,
                              capture_output=True, timeout=60, env=env or self.env)

    def finish(self):
        try:
            return self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()

    def connect(self):
        conn = socket.create_connection((self.host, self.port), timeout=20)
        return conn

    @property
    def address(self):
        return f"{self.host}:{self.port}"


def read_all(conn, limit=1 << 16) -> bytes:
    data = b""
    try:
        while len(data) < limit:
            chunk = conn.recv(4096)
            if not chunk:
                break
            data += chunk
    except OSError:
        pass
    return data


@pytest.fixture
def paused(tmp_path):
    rank = PausedRank(tmp_path)
    yield rank
    if rank.proc.poll() is None:
        rank.proc.kill()
        rank.proc.wait()


def test_a_raw_connection_without_the_key_runs_nothing_and_the_prompt_waits(paused):
    """What a stranger on the node tries: a line of Python straight at the port."""
    evidence = paused.tmp / "ran"
    conn = paused.connect()
    first = conn.recv(200).decode()
    assert first.startswith(prompt_key.PROTOCOL + " ")
    conn.sendall(f"import pathlib; pathlib.Path({str(evidence)!r}).write_text('x')\n".encode())
    said = read_all(conn).decode()
    conn.close()
    assert said.startswith("mldebug: refused: this prompt needs its key") and \
        said.count("\n") == 1
    assert not evidence.exists()
    paused.wait_for(r"\[rank 1\] mldebug: the prompt refused a wrong key from 127\.0\.0\.1")
    # the right client still gets in, and the program goes on
    good = paused.attach("p x.sum()", "c", extra=[paused.address])
    assert good.returncode == 0, good.stderr
    assert "-> bad = torch.log(-x)  # here" in good.stdout and "tensor(3.)" in good.stdout
    assert paused.finish() == 0
    assert paused.out.read_text() == "before the stop\nafter the stop\n"
    assert not evidence.exists()


def test_bad_clients_at_the_door_harm_nothing(paused):
    """Binary junk, a 10 MB line, half a line then a closed write side, a client that
    connects and never speaks, and a wrong key: all at once, with the right client."""
    silent = paused.connect()
    junk = paused.connect()
    junk.sendall(os.urandom(5000).replace(b"\n", b"\0"))
    huge = paused.connect()
    huge_said = []

    def send_huge():
        try:
            huge.sendall(b"p 1" + b"x" * (10 << 20) + b"\n")
        except OSError:
            pass                    # the door closed on it before it was all sent
        huge_said.append(read_all(huge))

    sender = threading.Thread(target=send_huge)
    sender.start()
    half = paused.connect()
    half.sendall(b"p 1")
    half.shutdown(socket.SHUT_WR)
    wrong = paused.connect()
    nonce = prompt_key.parse_challenge(wrong.recv(200).decode())
    wrong.sendall((prompt_key.answer("0" * 64, nonce) + "\n").encode())
    # the right client, while the silent one still holds its connection open
    good = paused.attach("p 6 * 7", "c", extra=[paused.address])
    assert good.returncode == 0, good.stderr
    assert "\n42\n" in good.stdout.replace("(mldebug) ", "\n")
    sender.join(timeout=60)
    assert b"refused" in read_all(junk)
    # (what follows the challenge line, whose random nonce may hold "42" itself: nothing
    # the right client's prompt printed reaches another client)
    assert huge_said and b"refused" in huge_said[0] \
        and b"42" not in huge_said[0].partition(b"\n")[2]
    assert b"refused: this prompt needs its key" in read_all(wrong)
    silent.settimeout(30)
    assert read_all(silent).startswith(prompt_key.PROTOCOL.encode())   # closed on, unserved
    for conn in (silent, junk, huge, half, wrong):
        conn.close()
    assert paused.finish() == 0
    assert paused.out.read_text() == "before the stop\nafter the stop\n"


def test_the_key_is_the_users_alone_and_goes_with_the_prompt(paused):
    folder = paused.tmp / "cache" / "attach"
    files = list(folder.glob("prompt-*.json"))
    assert len(files) == 1
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(files[0].stat().st_mode) == 0o600
    record = json.loads(files[0].read_text())
    assert record["port"] == paused.port and len(record["key"]) == 64 and record["rank"] == 1
    assert str(files[0]) in paused.err.read_text()        # the stop says where it is
    assert record["key"] not in paused.err.read_text() + paused.out.read_text()
    # without the file (another user, another host without the home folder): no key
    elsewhere = dict(paused.env, MLDEBUG_CACHE_DIR=str(paused.tmp / "other"))
    refused = paused.attach("c", extra=[paused.address], env=elsewhere)
    assert refused.returncode == 1 and f"no key for {paused.address}" in refused.stderr
    # a key file with another key is refused; the connection file itself works from anywhere
    wrong = paused.tmp / "wrong.key"
    wrong.write_text("f" * 64)
    refused = paused.attach("c", extra=[paused.address, "--key-file", str(wrong)], env=elsewhere)
    assert refused.returncode == 1 and "refused" in refused.stderr
    good = paused.attach("c", extra=[paused.address, "--key-file", str(files[0])], env=elsewhere)
    assert good.returncode == 0 and "the program goes on" in good.stdout
    assert paused.finish() == 0
    assert not files[0].exists()


def test_attach_without_an_address_finds_the_one_waiting_prompt(paused):
    found = paused.attach("c")
    assert found.returncode == 0, found.stderr
    assert "the program goes on; this prompt closes" in found.stdout
    assert paused.finish() == 0
    none = paused.attach()
    assert none.returncode == 1 and "no prompt of yours is waiting" in none.stderr


def test_a_client_that_leaves_detaches_and_the_next_one_gets_the_prompt(paused):
    """Ctrl-D (or a dropped ssh session) is not `quit`: the program stays paused."""
    first = paused.attach("p 'first'", extra=[paused.address])   # ends with end of input
    assert first.returncode == 0 and "'first'" in first.stdout
    assert "detached; the program stays paused" in first.stdout
    paused.wait_for(r"the prompt's client left; the program stays paused")
    assert paused.proc.poll() is None
    second = paused.attach("p 'second'", "c", extra=[paused.address])
    assert second.returncode == 0 and "'second'" in second.stdout
    assert "3 NaN from aten.log" in second.stdout          # the stop, said again
    assert "-> bad = torch.log(-x)  # here" in second.stdout
    assert paused.finish() == 0


def test_a_second_client_is_turned_away_while_one_is_attached(paused):
    key = json.loads(next((paused.tmp / "cache" / "attach").glob("*.json")).read_text())["key"]
    first = paused.connect()
    nonce = prompt_key.parse_challenge(first.recv(200).decode())
    first.sendall((prompt_key.answer(key, nonce) + "\n").encode())
    first.settimeout(20)
    assert first.recv(100).startswith(prompt_key.ACCEPTED.encode())
    second = paused.connect()
    assert read_all(second) == b"mldebug: refused: another client has this prompt\n"
    second.close()
    first.sendall(b"c\n")
    assert b"the program goes on" in read_all(first)
    first.close()
    assert paused.finish() == 0


def test_over_the_network_the_stop_says_the_line_is_plain_text(tmp_path):
    rank = PausedRank(tmp_path, MLDEBUG_ATTACH_HOST="0.0.0.0")
    try:
        rank.wait_for(r"crosses the network as plain text; an ssh tunnel to 127\.0\.0\.1 is "
                      rf"the usual answer: ssh -L {rank.port}:127\.0\.0\.1:{rank.port} ")
        good = rank.attach("c", extra=[f"127.0.0.1:{rank.port}"])
        assert good.returncode == 0, good.stderr
        assert rank.finish() == 0
    finally:
        if rank.proc.poll() is None:
            rank.proc.kill()


LOGGED = """
    import os
    import sys
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(100):
        x = torch.randn(8, 4)
        loss = model(x).pow(2).mean()
        if rank == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)
        if rank == 1 and step == 50:
            bad = torch.log(-torch.ones(1))  # here
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} done\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)
"""


def test_a_stop_under_torchrun_redirected_to_a_log_keeps_every_line(write_program, tmp_path):
    """`torchrun ... > train.log 2>&1` with no terminal: the stop's attach line lands in
    the log after every line the job printed, and the log keeps every line printed
    before, during and after the stop."""
    prog = write_program(LOGGED)
    log = tmp_path / "train.log"
    env = clean_env(MLDEBUG_CACHE_DIR=str(tmp_path / "cache"))
    with open(log, "w") as out:
        job = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                "--nproc-per-node", "2", "-m", "mldebug", str(prog)],
                               cwd=tmp_path, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not ANNOUNCED.search(log.read_text(errors="replace")):
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        port = int(ANNOUNCED.search(log.read_text()).group(2))
        attach = subprocess.run([sys.executable, "-m", "mldebug", "attach", f"127.0.0.1:{port}"],
                                input="p step\nc\n", text=True, capture_output=True,
                                timeout=60, env=env)
        assert attach.returncode == 0 and "\n50\n" in attach.stdout.replace("(mldebug) ", "\n")
        assert job.wait(timeout=120) == 0
    finally:
        if job.poll() is None:
            os.killpg(job.pid, 9)
    text = log.read_bytes().decode("utf-8")
    assert "\0" not in text
    steps = [int(s) for s in re.findall(r"^step (\d+) loss", text, re.M)]
    assert steps == list(range(100))
    assert "rank 0 done" in text and "rank 1 done" in text
    announced = text.index("its prompt: python -m mldebug attach")
    assert text.index(f"prog.py:{marker_line(prog)} [forward, step 50]") < announced
    assert text.index("step 49 loss") < announced      # after what the job printed before
