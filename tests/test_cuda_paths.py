"""The device paths, on a real GPU: the summary's one-transfer reduction, the view's
slices, the recorder's one read per step and the watched CLI on a CUDA program.

Every test here needs CUDA and is skipped without it (CI has no GPU); they were run on a
lent H100. The watch's and the recorder's own tests also take the `device` fixture.
"""
from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

import mldebug
from mldebug.summaries import slicing
from mldebug.record import open_run
from mldebug.summaries import summary

from conftest import BLOWUP, clean_env, marker_line, needs_cuda, read_report, run_cli

pytestmark = needs_cuda


def _with_bad_values(n=1 << 21):
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x[n // 17] = float("nan")
    x[n // 10] = float("inf")
    x[-1] = float("-inf")
    return x


ZOO = [
    lambda: torch.randn(3, 4, generator=torch.Generator().manual_seed(1)),
    _with_bad_values,                                       # pieces, first NaN/Inf index
    lambda: _with_bad_values(5000).half(),
    lambda: _with_bad_values(5000).bfloat16(),
    lambda: torch.arange(-5, 15),
    lambda: torch.tensor([True, False, True]),
    lambda: torch.tensor([3 + 4j, 1j, float("nan")]),
    lambda: torch.full((1000,), 3e38),                      # Σx² overflows in float32
    lambda: torch.tensor(2.5),
    lambda: torch.empty(0, 3),
]


@pytest.mark.parametrize("make", ZOO)
def test_a_cuda_tensors_summary_is_the_host_summary(make):
    host = make()
    dev = summary(host.cuda()).to_dict()
    ref = summary(host).to_dict()
    assert dev.pop("device") == "cuda:0" and ref.pop("device") == "cpu"
    assert dev.keys() == ref.keys()
    for key, want in ref.items():
        got = dev[key]
        if isinstance(want, float) and not math.isnan(want):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), key
        else:
            assert got == want or (got != got and want != want), key


def test_a_cuda_slice_is_the_host_slice():
    host = _with_bad_values(1 << 20).reshape(2, 512, 1024)
    a = slicing.slice_plane(host.cuda(), "x", index=[1, 0, 0], max_side=256)
    b = slicing.slice_plane(host, "x", index=[1, 0, 0], max_side=256)
    np.testing.assert_array_equal(a["kinds"], b["kinds"])
    np.testing.assert_allclose(a["shown"], b["shown"], rtol=1e-6, equal_nan=True)
    assert a["hist"]["counts"] == b["hist"]["counts"]
    assert (a["min"], a["max"]) == pytest.approx((b["min"], b["max"]))


def _syncs_by_thread(body):
    """The synchronizing CUDA calls BODY makes, as (thread id, message): torch warns
    in the thread that made the call."""
    import threading
    seen = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = lambda message, *a, **k: seen.append(
                (threading.get_ident(), str(message)))
            body()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [(ident, m) for ident, m in seen if "synchroniz" in m]


def test_a_recorded_cuda_step_reads_back_once_not_per_tensor(tmp_path):
    """The statistics of a step's ~40 tensors stay on the GPU until the step ends; the
    main thread never waits for them: the writer thread reads them, once a step."""
    import threading
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.GELU()) for _ in range(4)],
                          nn.Linear(64, 10)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 64, device="cuda")
    y = torch.randint(0, 10, (32,), device="cuda")

    def step():
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    with mldebug.record(model, run_dir=tmp_path, run="gpu") as rec:
        step()
        syncs = _syncs_by_thread(lambda: [step() for _ in range(3)])
    main = threading.get_ident()
    assert [m for ident, m in syncs if ident == main] == []
    with open_run(rec.path) as run:
        assert run.steps() == [0, 1, 2, 3]
        row = run.stats("4.weight:param_grad", steps=[3])[0]
        assert row["numel"] == 640 and row["nan"] == 0 and row["abs_max"] > 0


NAN_ON_CUDA = """
    import torch
    from torch import nn

    class Head(nn.Module):
        def forward(self, x):
            return torch.sqrt(x - 10)  # here

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Head(), nn.Linear(8, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        opt.zero_grad()
        loss = model(torch.randn(16, 4, device="cuda")).pow(2).mean()
        loss.backward()
        opt.step()
    print("finished")
"""


def test_the_cli_pins_a_nan_made_on_the_gpu_at_its_line(write_program, tmp_path):
    prog = write_program(NAN_ON_CUDA)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)])
    assert result.returncode == 3, result.stderr
    first = read_report(report)[0]
    assert (first["stage"], first["op"], first["module"], first["line"]) == (
        "forward", "aten.sqrt.default", "2", marker_line(prog))


TRAIN_ON_CUDA = """
    import sys
    import torch
    from torch import nn

    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Flatten(), nn.Dropout(0.1), nn.Linear(8 * 8 * 8, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mask = torch.full((4, 4), float("-inf"), device="cuda").triu(1)
    for step in range(5):
        x = torch.randn(16, 3, 8, 8, device="cuda")
        y = torch.randint(0, 10, (16,), device="cuda")
        opt.zero_grad()
        attn = torch.softmax(torch.randn(4, 4, device="cuda") + mask, dim=-1)
        loss = nn.functional.cross_entropy(model(x), y) + attn.sum() * 0
        loss.backward()
        opt.step()
    torch.save({"state": model.state_dict(), "rng": torch.cuda.get_rng_state()}, sys.argv[1])
    print("trained", loss.item())
"""


def test_a_watched_cuda_training_is_bitwise_the_plain_one(write_program, tmp_path):
    import subprocess
    import sys
    prog = write_program(TRAIN_ON_CUDA)
    env = clean_env(CUBLAS_WORKSPACE_CONFIG=":4096:8")
    plain = subprocess.run([sys.executable, str(prog), str(tmp_path / "plain.pt")],
                           capture_output=True, text=True, env=env)
    assert plain.returncode == 0, plain.stderr
    for mode in ("tiers", "exact"):
        out = tmp_path / f"{mode}.pt"
        args = ["--batch"] + (["--watch", "exact"] if mode == "exact" else [])
        watched = run_cli(args + [str(prog), str(out)], env=env)
        assert watched.returncode == 0, watched.stderr
        assert watched.stdout == plain.stdout
        a, b = torch.load(tmp_path / "plain.pt"), torch.load(out)
        assert torch.equal(a["rng"], b["rng"])
        for name, tensor in a["state"].items():
            assert torch.equal(tensor, b["state"][name]), (mode, name)


def _on_cuda(program: str) -> str:
    """PROGRAM with its model and input on the GPU."""
    cuda = program.replace("Head())\n", "Head()).cuda()\n").replace(
        "torch.randn(32, 4)", 'torch.randn(32, 4, device="cuda")')
    assert cuda.count(".cuda()") == 1 and cuda.count('device="cuda"') == 1
    return cuda


BLOWUP_ON_CUDA = _on_cuda(BLOWUP)


def test_at_a_cuda_stop_the_prompt_inspects_and_shows_the_history(write_program):
    """The stop, `inspect` of a CUDA tensor in the re-run's frame and `history` (the
    recorder's device path), as a user at the prompt would see them."""
    prog = write_program(BLOWUP_ON_CUDA)
    result = run_cli(["--plain", "--break-on", "nan,inf", str(prog)],
                     stdin="inspect x\nhistory\nq\n")
    out = result.stdout
    assert "+Inf from aten.exp.default" in out and "in module 2 (Head)" in out, out
    assert "tensor[32, 8] f32" in out and "cuda:0" in out
    assert "history of 2: steps 0.." in out and "‖2.lin.weight‖" in out
    assert "finished" not in out


GRAPHED_TRAINING = """
    import sys
    import torch
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if "mldebug" in sys.modules:         # under the CLI: a recording as well
        import mldebug
        rec = mldebug.record(model, run_dir=sys.argv[1], run="graphed")
    x, y = torch.randn(8, 16, device="cuda"), torch.randn(8, 1, device="cuda")
    # PyTorch's recipe for a whole step in one graph: warm up on a side stream, capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    for step in range(5):
        x.copy_(torch.randn(8, 16, device="cuda"))
        graph.replay()
    print("loss", loss.item())
    print("weights", [p.detach().double().sum().item().hex() for p in model.parameters()])
"""


def test_a_step_captured_in_a_cuda_graph_trains_as_without_mldebug(write_program, tmp_path):
    """Under the CLI (watch, graph capture, assertions, history, and a recording) the
    capture succeeds (no read or op of mldebug's inside it), the replays compute the
    same weights bit for bit, and each part says once that it does not look inside."""
    import subprocess
    import sys
    prog = write_program(GRAPHED_TRAINING)
    plain = subprocess.run([sys.executable, str(prog), str(tmp_path)], capture_output=True,
                           text=True, env=clean_env(), timeout=300)
    assert plain.returncode == 0, plain.stderr
    result = run_cli(["--batch", str(prog), str(tmp_path)], timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout
    err = result.stderr
    assert "Traceback" not in err
    for part in ("the watch", "the assertions", "mldebug.record", "the step history"):
        assert err.count(f"a CUDA graph is being captured: {part}") == 1, err


GRAPH_THAT_MAKES_A_NAN = """
    import torch
    from torch import nn


    class Log(nn.Module):
        def forward(self, x):
            return torch.log(x)


    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Log()).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.rand(4, 8, device="cuda")
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(1.0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            opt.zero_grad(set_to_none=True)
            model(x).mean().backward()
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        out = model(x)
        out.mean().backward()
        opt.step()
    graph.replay()
    with torch.no_grad():
        model[0].bias.fill_(-1.0)     # finite: the next replay takes the log of negatives
    graph.replay()  # here
    print("finished")
"""


def test_a_nan_made_inside_a_cuda_graph_stops_at_the_replay(write_program, tmp_path):
    prog = write_program(GRAPH_THAT_MAKES_A_NAN)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)], timeout=300)
    assert result.returncode == 3, result.stderr       # a stop (batch mode)
    assert "Traceback" not in result.stderr, result.stderr
    first = read_report(report)[0]
    assert (first["reason"], first["torch_op"], first["line"], first["module_type"]) == (
        "nan", "CUDAGraph.replay", marker_line(prog), "Sequential")
    assert first["count"] == 32 and "finished" not in result.stdout
