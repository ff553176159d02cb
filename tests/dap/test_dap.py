"""The DAP front end, end to end, against the REAL debugpy adapter (`python -m debugpy.adapter`),
plus the panel's JSON functions called directly.

Suites are named after what the VS Code extension does: launch mldebug as a module, attach
to `--listen`, stop on a NaN, look at variables, ask the panel for JSON, continue.
"""
from __future__ import annotations

import gc
import json
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import TESTS, clean_env, marker_line
from dap_client import DapClient, free_port

PROGRAMS = TESTS / "programs_dap"
NAN_STEP = PROGRAMS / "nan_step.py"
TENSORS_BP = PROGRAMS / "tensors_bp.py"
RAISES = PROGRAMS / "raises.py"
NAN_MODEL = PROGRAMS / "nan_model.py"
MODEL_BP = PROGRAMS / "model_bp.py"
PANEL = "__import__('mldebug.dap.panel', fromlist=['_'])"
SUMMARY_LINE = re.compile(r"^(tensor|ndarray)\[[\d, ]*\] \w+")


def launch_args(*args, **extra) -> dict:
    """What the VS Code extension sends: mldebug as the module, the program as its args."""
    config = {"name": "mldebug", "type": "python", "request": "launch", "module": "mldebug",
              "args": [str(a) for a in args], "justMyCode": True,
              "console": "internalConsole", "env": {"PYTHONUNBUFFERED": "1"}}
    config.update(extra)
    return config


@pytest.fixture
def adapter(tmp_path):
    client = DapClient.start_adapter(env=clean_env())
    client.initialize()
    yield client
    client.close()


def stopped_frame(dap: DapClient, reason: str, timeout: float = 25):
    stopped = dap.wait_event("stopped", timeout=timeout)
    assert stopped["reason"] == reason, stopped
    thread = stopped["threadId"]
    return stopped, thread, dap.top_frame(thread)


def evaluate_json(dap: DapClient, expression: str, frame_id: int) -> dict:
    """What the panel does: `evaluate` with context "repl" and pydevd's `rawString`
    format, then JSON.parse. (Without rawString debugpy returns the str's repr, quoted,
    and cuts it at 65,536 characters.)"""
    body = dap.request("evaluate", {"expression": expression, "frameId": frame_id,
                                    "context": "repl", "format": {"rawString": True}})
    return json.loads(body["result"])


TWO_RANKS = """
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
    for step in range(3):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        if rank == 1 and step == 1:
            bad = torch.log(-torch.ones(1))  # here
        opt.zero_grad()
        loss.backward()
        opt.step()
    sys.stdout.write(f"rank {rank} weights {[p.detach().sum().item() for p in model.parameters()]}\\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(0)     # (torch 2.13's gloo teardown aborts now and then at interpreter exit)
"""


def _kill_job(job: subprocess.Popen) -> None:
    """End a torchrun job that a failed test left running: SIGTERM first (torchrun ends
    its workers), then its whole process group."""
    import os
    import signal
    job.terminate()
    try:
        job.wait(timeout=15)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(job.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        job.kill()
    job.wait(timeout=10)


# -- launch: a NaN stops in the user's frame --------------------------------------------------
class TestLaunchStopsOnNaN:
    def test_a_nan_stops_at_the_users_line_with_the_op_in_exception_info(self, adapter, tmp_path):
        dap = adapter
        dap.start("launch", launch_args(NAN_STEP, cwd=str(tmp_path)))
        stopped, thread, top = stopped_frame(dap, "exception")
        assert stopped.get("text") == "NonFiniteError"
        assert Path(top["source"]["path"]).resolve() == NAN_STEP.resolve()
        assert top["line"] == marker_line(NAN_STEP)
        assert top["name"] == "step"

        info = dap.request("exceptionInfo", {"threadId": thread})
        assert info["exceptionId"] == "NonFiniteError"
        assert "NaN" in info["description"] and "log" in info["description"]
        assert "mldebug.core.errors.NonFiniteError" in info["details"]["stackTrace"]

        # the custom event the panel listens to came before the stop
        stop_event = dap.wait_event("mldebug.stop", timeout=5)
        assert stop_event["stop"]["reason"] == "nan"

        # justMyCode: mldebug's own frames (cli.py, the pauser) are not shown
        frames = dap.request("stackTrace", {"threadId": thread})["stackFrames"]
        assert [f["name"] for f in frames] == ["step", "<module>"], frames

        # the user's locals are alive and shown as one-line summaries
        local = dap.variables_of_frame(top["id"])
        assert SUMMARY_LINE.match(local["h"]["value"]), local["h"]
        assert local["h"]["value"].startswith("tensor[4, 2] f32")
        children = dap.request("variables", {"variablesReference": local["h"]["variablesReference"]})
        names = [c["name"] for c in children["variables"]]
        for expected in ("summary", "shape", "dtype", "device", "stats", "requires_grad"):
            assert expected in names, names
        assert any(n.startswith("preview") for n in names), names

        dap.request("continue", {"threadId": thread})
        exited = dap.wait_event("exited", timeout=25)
        assert exited["exitCode"] == 0
        assert "finished nan" in "".join(dap.output)

    def test_on_a_device_a_stop_read_at_the_programs_end_shows_a_frame_over_its_globals(
            self, adapter, write_program, tmp_path):
        """On a GPU (the device path, simulated) a NaN made outside any model, last thing
        in the program, is judged by the read at its end: VS Code shows a frame of the
        program (`<end of program>`, after its last line) where its names evaluate; it
        used to show no frame at all (justMyCode hides mldebug's)."""
        prog = write_program("""
            import torch
            x = torch.zeros(3)
            y = torch.log(x) * 0  # here
        """)
        config = launch_args("--break-on", "nan", prog, cwd=str(tmp_path))
        config["env"]["MLDEBUG_SIMULATE_DEVICE"] = "1"
        dap = adapter
        dap.start("launch", config)
        _, thread, top = stopped_frame(dap, "exception")
        assert (top["name"], Path(top["source"]["path"]).resolve()) == \
            ("<end of program>", prog.resolve())
        assert top["line"] == len(prog.read_text().splitlines()) + 1
        info = dap.request("exceptionInfo", {"threadId": thread})
        assert f"prog.py:{marker_line(prog)}" in info["description"], info
        value = dap.request("evaluate", {"expression": "x + 1", "frameId": top["id"],
                                         "context": "repl"})["result"]
        assert value.startswith("tensor[3] f32") and "[1., 1., 1.]" in value, value
        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 0

    def test_the_panel_functions_answer_json_in_the_paused_frame(self, adapter, tmp_path):
        dap = adapter
        dap.start("launch", launch_args(NAN_STEP, cwd=str(tmp_path)))
        _, thread, top = stopped_frame(dap, "exception")
        fid = top["id"]

        stop = evaluate_json(dap, f"{PANEL}.stop_json()", fid)["stop"]
        assert stop["reason"] == "nan" and "log" in stop["op"]
        assert stop["line"] == marker_line(NAN_STEP) and stop["function"] == "step"
        assert stop["cause"] == "outside_domain" and "log of 3 values outside" in stop["hint"]

        frame = evaluate_json(dap, f"{PANEL}.frame_json(locals())", fid)
        names = [t["name"] for t in frame["tensors"]]
        assert names == sorted(names) and {"h", "w", "x"} <= set(names), names
        h = next(t for t in frame["tensors"] if t["name"] == "h")
        assert h["line"].startswith("tensor[4, 2] f32") and h["summary"]["shape"] == [4, 2]

        heat = evaluate_json(dap, f"{PANEL}.tensor_json(h, 'h')", fid)
        assert heat["shape"] == [4, 2] and heat["dims"] == [0, 1] and heat["rows"] == 4
        assert len(heat["data"]) == 4 and len(heat["data"][0]) == 2
        assert heat["summary"]["numel"] == 8

        # a payload far over debugpy's 64K repr limit arrives whole with rawString
        wide = evaluate_json(dap, f"{PANEL}.tensor_json(torch.randn(256, 256), 'r')", fid)
        assert wide["rows"] == 256 and len(wide["data"][255]) == 256

        # no module was called: no graph, and the note says why
        assert evaluate_json(dap, f"{PANEL}.graph_json()", fid)["graph"] is None
        assert "error" in evaluate_json(dap, f"{PANEL}.tensor_json(42)", fid)

        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 0


    def test_graph_json_at_a_nan_in_a_module_marks_it_and_its_output_shows(self, adapter, tmp_path):
        """What the panel's graph asks at a stop inside a model: the view's figure with the
        module the NaN came from marked, and that module's output through node_tensor_json."""
        from bokeh.document import Document

        dap = adapter
        dap.start("launch", launch_args(NAN_MODEL, cwd=str(tmp_path)))
        _, thread, top = stopped_frame(dap, "exception")
        fid = top["id"]
        assert top["line"] == marker_line(NAN_MODEL) and top["name"] == "forward"

        graph = evaluate_json(dap, f"{PANEL}.graph_json()", fid)["graph"]
        assert graph["marked"] == ["head#0"] and graph["modules"] == 4
        assert graph["expanded"] == ["root#0"]
        assert Path(graph["bokeh"]["js"][0]).name == "bokeh.min.js"
        src = Document.from_json(graph["item"]["doc"]).select_one({"name": "mld-graph-nodes"})
        assert src.data["id"] == ["root#0", "fc#0", "act#0", "head#0"]
        assert src.data["color"][3] == "#ff6b6b" and src.data["color"][1] == "#dee2e6"
        assert "NaN/Inf!" in src.data["label"][3] and "[2, 3] f32" in src.data["label"][3]

        out = evaluate_json(dap, f"{PANEL}.node_tensor_json('head#0')", fid)
        assert out["name"] == "head output" and out["shape"] == [2, 3]
        assert out["nonfinite_total"] == 6 and out["summary"]["nan"] == 6
        # a closed root: one row
        closed = evaluate_json(dap, f"{PANEL}.graph_json([], mark=False)", fid)["graph"]
        assert Document.from_json(closed["item"]["doc"]).select_one(
            {"name": "mld-graph-nodes"}).data["id"] == ["root#0"]

        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 0


# -- attach: --listen ---------------------------------------------------------------------------
class TestListenAndAttach:
    def test_a_client_attaches_to_listen_and_stops_on_the_nan(self, tmp_path):
        port = free_port()
        debuggee = subprocess.Popen(
            [sys.executable, "-m", "mldebug", "--listen", f"127.0.0.1:{port}", "--wait-for-client",
             str(NAN_STEP)], cwd=tmp_path, env=clean_env(), stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            with DapClient.connect("127.0.0.1", port, timeout=25) as dap:
                dap.initialize()
                dap.start("attach", {"name": "attach", "type": "python", "request": "attach",
                                     "connect": {"host": "127.0.0.1", "port": port},
                                     "justMyCode": True})
                _, thread, top = stopped_frame(dap, "exception")
                assert top["line"] == marker_line(NAN_STEP)
                info = dap.request("exceptionInfo", {"threadId": thread})
                assert "log" in info["description"]
                dap.request("continue", {"threadId": thread})
                dap.wait_event("terminated", timeout=25)
            out, err = debuggee.communicate(timeout=25)
            assert debuggee.returncode == 0, err
            assert "finished nan" in out
            assert f"listens on 127.0.0.1:{port}" in err
        finally:
            if debuggee.poll() is None:
                debuggee.kill()
                debuggee.wait(timeout=10)

    def test_rank_r_of_a_job_listens_on_port_plus_r(self, tmp_path):
        """Under a launcher (RANK/WORLD_SIZE, as torchrun sets them) each rank has a port
        of its own: VS Code attaches to the rank that stopped."""
        port = free_port()
        while True:                      # PORT+1 must be free too
            try:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                port = free_port()
        debuggee = subprocess.Popen(
            [sys.executable, "-m", "mldebug", "--listen", f"127.0.0.1:{port}", "--wait-for-client",
             str(NAN_STEP)], cwd=tmp_path, env=clean_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2"),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            with DapClient.connect("127.0.0.1", port + 1, timeout=25) as dap:
                dap.initialize()
                dap.start("attach", {"name": "attach", "type": "python", "request": "attach",
                                     "connect": {"host": "127.0.0.1", "port": port + 1},
                                     "justMyCode": True})
                _, thread, top = stopped_frame(dap, "exception")
                assert top["line"] == marker_line(NAN_STEP)
                dap.request("continue", {"threadId": thread})
                dap.wait_event("terminated", timeout=25)
            out, err = debuggee.communicate(timeout=25)
            assert debuggee.returncode == 0, err
            assert f"[rank 1] mldebug: debugpy listens on 127.0.0.1:{port + 1}" in err
        finally:
            if debuggee.poll() is None:
                debuggee.kill()
                debuggee.wait(timeout=10)

    def test_vs_code_attaches_to_every_rank_of_a_torchrun_job(self, write_program, tmp_path):
        """The workflow of docs/multirank.md: `torchrun ... -m mldebug --listen PORT
        --wait-for-client`, one attach a rank (the compound), on PORT+R. Rank 1's NaN
        stops in its own session, rank 0 waits; Continue there lets both ranks finish."""
        prog = write_program(TWO_RANKS)
        port = free_port()
        while True:                      # PORT+1 must be free too
            try:
                with socket.socket() as probe:
                    probe.bind(("127.0.0.1", port + 1))
                break
            except OSError:
                port = free_port()
        log = tmp_path / "job.log"
        # (a file, not a pipe: debugpy's adapter processes hold the pipe open while a
        # client is connected)
        with open(log, "w") as out_file:
            job = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node", "2", "-m", "mldebug", "--listen", f"127.0.0.1:{port}",
                 "--wait-for-client", str(prog)], cwd=tmp_path, env=clean_env(),
                stdout=out_file, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        clients = []
        try:
            for rank in (0, 1):
                dap = DapClient.connect("127.0.0.1", port + rank, timeout=60)
                clients.append(dap)
                dap.initialize()
                dap.start("attach", {"name": f"mldebug: rank {rank}", "type": "python",
                                     "request": "attach", "justMyCode": True,
                                     "connect": {"host": "127.0.0.1", "port": port + rank}})
            _, thread, top = stopped_frame(clients[1], "exception", timeout=60)
            assert top["line"] == marker_line(prog)
            assert "log" in clients[1].request("exceptionInfo", {"threadId": thread})["description"]
            time.sleep(3)                 # a user looks around; rank 0 says it waits
            assert not clients[0].has_event("stopped")        # rank 0 holds, no stop of its own
            clients[1].request("continue", {"threadId": thread})
            for dap in clients:
                dap.wait_event("terminated", timeout=60)
            job.wait(timeout=60)
        finally:
            for dap in clients:
                dap.close()
            if job.poll() is None:
                _kill_job(job)
        out = log.read_text()
        assert job.returncode == 0, out
        assert f"[rank 1] mldebug: debugpy listens on 127.0.0.1:{port + 1}" in out
        assert re.search(rf"\[rank 0\] waiting: rank 1 stopped at prog\.py:{marker_line(prog)} "
                         r"\(NaN from aten\.log\)", out), out
        assert sorted(re.findall(r"rank (\d) weights", out)) == ["0", "1"]

    def test_a_bad_listen_address_is_a_usage_error(self, tmp_path):
        result = subprocess.run([sys.executable, "-m", "mldebug", "--listen", "nope:port",
                                 str(NAN_STEP)], capture_output=True, text=True,
                                env=clean_env(), timeout=60)
        assert result.returncode == 2
        assert "--listen expects [HOST:]PORT, got 'nope:port'" in result.stderr


# -- breakpoint(), variables, the 10k x 10k tensor -------------------------------------------
class TestBreakpointAndVariables:
    def test_breakpoint_stops_like_debugpy_and_tensors_show_summaries(self, adapter, tmp_path):
        dap = adapter
        dap.start("launch", launch_args(TENSORS_BP, cwd=str(tmp_path)))
        _, thread, top = stopped_frame(dap, "breakpoint")
        assert top["name"] == "show"
        assert marker_line(TENSORS_BP) <= top["line"] <= marker_line(TENSORS_BP) + 1
        local = dap.variables_of_frame(top["id"])
        assert local["small"]["value"].startswith("tensor[2, 2] f32")
        assert "NaN!1" in local["small"]["value"] and "grad" in local["small"]["value"]
        assert local["arr"]["value"].startswith("ndarray[3, 4] f32")
        arr_children = dap.request("variables",
                                   {"variablesReference": local["arr"]["variablesReference"]})
        arr_names = [c["name"] for c in arr_children["variables"]]
        assert arr_names[:3] == ["summary", "shape", "dtype"], arr_names   # ours, not pydevd's
        small_children = {c["name"]: c for c in dap.request(
            "variables", {"variablesReference": local["small"]["variablesReference"]})["variables"]}
        assert small_children["shape"]["value"] == "(2, 2)"
        assert small_children["grad"]["value"] == "None"
        stats = {c["name"]: c["value"] for c in dap.request(
            "variables", {"variablesReference": small_children["stats"]["variablesReference"]})["variables"]}
        assert stats["'nan'"] == "1" and stats["'max'"] == "4.0", stats

        threads = [t["name"] for t in dap.request("threads")["threads"]]
        assert "mldebug-hidden" not in threads and "MainThread" in threads, threads

        dap.request("continue", {"threadId": thread})
        _, thread, top = stopped_frame(dap, "breakpoint")
        assert top["name"] == "only_big"
        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 0

    def test_at_a_breakpoint_the_graph_is_the_last_pass_with_nothing_marked(self, adapter, tmp_path):
        from bokeh.document import Document

        dap = adapter
        dap.start("launch", launch_args(MODEL_BP, cwd=str(tmp_path)))
        _, thread, top = stopped_frame(dap, "breakpoint")
        graph = evaluate_json(dap, f"{PANEL}.graph_json()", top["id"])["graph"]
        assert graph["marked"] == [] and graph["modules"] == 4 and graph["note"] == "4 module calls"
        src = Document.from_json(graph["item"]["doc"]).select_one({"name": "mld-graph-nodes"})
        assert src.data["id"] == ["root#0", "0#0", "1#0", "2#0"]
        assert set(src.data["color"]) == {"#dee2e6"}
        last = evaluate_json(dap, f"{PANEL}.node_tensor_json('2#0')", top["id"])   # `out`
        assert last["name"] == "2 output" and last["shape"] == [3, 2]
        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 0

    def test_a_10k_by_10k_tensor_value_arrives_fast(self, tmp_path):
        """A plain debugpy session (no mldebug CLI): the plugin loads from the install."""
        with DapClient.start_adapter(env=clean_env()) as dap:
            dap.initialize()
            dap.start("launch", {"type": "python", "request": "launch",
                                 "program": str(TENSORS_BP), "justMyCode": True,
                                 "console": "internalConsole", "cwd": str(tmp_path)})
            _, thread, top = stopped_frame(dap, "breakpoint")
            warm = dap.variables_of_frame(top["id"])      # loads the plugin, mldebug.summary
            assert warm["small"]["value"].startswith("tensor[2, 2] f32")
            dap.request("continue", {"threadId": thread})
            _, thread, top = stopped_frame(dap, "breakpoint")
            scopes = dap.request("scopes", {"frameId": top["id"]})["scopes"]
            started = time.perf_counter()
            variables = dap.request("variables", {
                "variablesReference": scopes[0]["variablesReference"]})["variables"]
            elapsed_ms = (time.perf_counter() - started) * 1000
            big = next(v for v in variables if v["name"] == "big")
            print(f"\n10000x10000 float32 variables response: {elapsed_ms:.1f} ms "
                  f"(value: {big['value']})")
            assert big["value"].startswith("tensor[10000, 10000] f32 n=100000000 (381Mb)")
            # the summary's worker thread is neither listed nor suspended by pydevd
            threads = [t["name"] for t in dap.request("threads")["threads"]]
            assert "mldebug-summaries" not in threads and "mldebug-hidden" not in threads, threads
            # the full summary follows: the client is told to refresh, and then has it
            dap.wait_event("invalidated", timeout=20)
            again = dap.request("variables", {"variablesReference": scopes[0]["variablesReference"]})
            big = next(v for v in again["variables"] if v["name"] == "big")
            assert "x∈[1.000, 1.000]" in big["value"] and "NaN!100000" in big["value"], big
            dap.request("continue", {"threadId": thread})
            assert dap.wait_event("exited", timeout=25)["exitCode"] == 0


# -- uncaught exceptions stay debugpy's -----------------------------------------------------------
class TestUncaughtException:
    def test_an_uncaught_exception_is_reported_by_debugpy_not_pdb(self, adapter, tmp_path):
        dap = adapter
        dap.start("launch", launch_args(RAISES, cwd=str(tmp_path)))
        _, thread, top = stopped_frame(dap, "exception")
        assert top["line"] == marker_line(RAISES)
        info = dap.request("exceptionInfo", {"threadId": thread})
        assert info["exceptionId"].endswith("ValueError") and info["breakMode"] == "unhandled"
        dap.request("continue", {"threadId": thread})
        assert dap.wait_event("exited", timeout=25)["exitCode"] == 1
        assert "(Pdb)" not in "".join(dap.output) and "(mldebug)" not in "".join(dap.output)


# -- the panel's JSON, called directly --------------------------------------------------------------
class TestPanelJson:
    def panel(self):
        from mldebug.dap import panel
        return panel

    def test_tensor_json_downsamples_to_max_side_and_marks_nonfinite(self):
        x = torch.randn(3, 300, 500)
        x[1, 7, 9] = float("nan")
        x[1, 299, 499] = float("-inf")
        d = json.loads(self.panel().tensor_json(x, "x", dims=[1, 2], index=[1, None, None],
                                                max_side=100))
        assert d["shape"] == [3, 300, 500] and d["dims"] == [1, 2] and d["index"] == [1, None, None]
        assert d["stride"] == [3, 5] and d["rows"] == 100 and d["cols"] == 100
        assert len(d["data"]) == 100 and all(len(r) == 100 for r in d["data"])
        assert d["data"][2][1] is None and [2, 1, "nan"] in d["nonfinite"]
        assert [99, 99, "-inf"] in d["nonfinite"] and d["nonfinite_total"] == 2
        assert d["min"] < d["max"] and len(d["hist"]["counts"]) == 20
        assert d["summary"]["shape"] == [3, 300, 500]
        assert d["summary"]["nan"] == 1 if not d["pending"] else d["summary"]["note"]
        assert d["image"] is not None   # (C, H, W) with C == 3 looks like an image

    def test_tensor_json_finds_a_nan_a_stride_skips_in_a_huge_slice(self):
        x = torch.zeros(6000, 3000)
        x[1, 1] = float("nan")
        d = json.loads(self.panel().tensor_json(x, max_side=100))
        assert d["block_mean"] is False and d["stride"] == [60, 30]
        assert d["nonfinite"] == [[0, 0, "nan"]] and d["data"][0][0] is None

    def test_tensor_json_of_1d_0d_numpy_and_grad(self):
        panel = self.panel()
        one = json.loads(panel.tensor_json(np.arange(5.0)))
        assert one["dims"] == [None, 0] and one["data"] == [[0, 1, 2, 3, 4]]
        zero = json.loads(panel.tensor_json(torch.tensor(2.5)))
        assert zero["dims"] == [None, None] and zero["data"] == [[2.5]]
        w = torch.ones(2, 2, requires_grad=True)
        (w * 3).sum().backward()
        g = json.loads(panel.tensor_json(w, "w", grad=True))
        assert g["name"] == "w.grad" and g["data"] == [[3, 3], [3, 3]]

    def test_tensor_json_errors_name_the_bad_value(self):
        panel = self.panel()
        x = torch.zeros(2, 3, 4)
        assert "dims=[1, 1]" in json.loads(panel.tensor_json(x, dims=[1, 1]))["error"]
        assert "index[0]=5" in json.loads(panel.tensor_json(x, index=[5, 0, 0]))["error"]
        assert "no .grad" in json.loads(panel.tensor_json(x, "x", grad=True))["error"]
        assert "got str" in json.loads(panel.tensor_json("nope"))["error"]

    def test_payloads_stay_under_a_megabyte(self):
        d = self.panel().tensor_json(torch.randn(2000, 2000), max_side=256)
        assert len(d) < 1_000_000 and json.loads(d)["rows"] == 250

    def test_frame_json_finds_tensors_one_level_inside_containers(self):
        ns = {"x": torch.ones(3), "batch": [torch.zeros(2), 5], "out": {"logits": np.ones(4)},
              "n": 3, "__builtins__": {}}
        d = json.loads(self.panel().frame_json(ns))
        assert [t["name"] for t in d["tensors"]] == ["batch[0]", "out['logits']", "x"]
        assert d["tensors"][2]["line"].startswith("tensor[3] f32")
        assert d["tensors"][2]["summary"]["numel"] == 3
        assert json.loads(self.panel().frame_json(ns, limit=1))["truncated"] == 2

    def test_stop_json_and_graph_json(self):
        from mldebug.core import records as _records
        from mldebug.core import session as _session
        panel = self.panel()
        saved = _session._current
        try:
            s = _session.install(_session.Session())
            assert json.loads(panel.stop_json()) == {"stop": None}
            s.record(_records.Stop(reason="nan", message="1 NaN from aten.log.default", op="aten.log.default"))
            assert json.loads(panel.stop_json())["stop"]["op"] == "aten.log.default"
        finally:
            _session._current = saved
        assert json.loads(panel.graph_json())["graph"] is None

    def test_graph_json_is_the_views_figure_with_toggles_marks_and_node_outputs(self):
        from bokeh.document import Document
        from bokeh.resources import Resources
        import bokeh
        from mldebug import graph as G

        class Block(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = torch.nn.Linear(3, 3)
                self.act = torch.nn.Tanh()

            def forward(self, x):
                return self.act(self.lin(x))

        model = torch.nn.Sequential(Block(), Block(), torch.nn.Linear(3, 2))
        panel = self.panel()

        def rows(payload):
            doc = Document.from_json(payload["item"]["doc"])
            return (doc.select_one({"name": "mld-graph-nodes"}).data,
                    doc.select_one({"name": "mld-graph-toggles"}).data)

        with G.Capture():
            out = model(torch.randn(4, 3))
            G.last_graph().mark("1.lin", "nan")
            text = panel.graph_json()
            graph = json.loads(text)["graph"]       # strict JSON: no NaN literals
            assert json.loads(text, parse_constant=lambda c: pytest.fail(c))
            assert graph["marked"] == ["1.lin#0"] and graph["modules"] == 8
            # the roots and the path to the mark are open, as in the view
            assert graph["expanded"] == ["1#0", "root#0"]
            nodes, toggles = rows(graph)
            assert nodes["id"] == ["root#0", "0#0", "1#0", "1.lin#0", "1.act#0", "2#0"]
            assert nodes["color"][3] == "#ff6b6b"
            assert toggles["id"] == ["root#0", "0#0", "1#0"]
            assert toggles["arrow"] == ["\u25be", "\u25b8", "\u25be"]
            assert graph["item"]["doc"]["roots"][0]["attributes"]["sizing_mode"] == "stretch_width"
            assert graph["bokeh"] == {"version": bokeh.__version__, "js": Resources(
                mode="absolute", components=["bokeh"]).js_files}
            assert all(Path(f).is_file() for f in graph["bokeh"]["js"])

            # what a click on a toggle asks: exactly the open set, no mark re-opening
            opened = json.loads(panel.graph_json(["root#0", "0#0"], mark=False))["graph"]
            assert opened["expanded"] == ["0#0", "root#0"]
            assert rows(opened)[0]["id"] == ["root#0", "0#0", "0.lin#0", "0.act#0", "1#0", "2#0"]
            # ids of another pass are dropped
            assert json.loads(panel.graph_json(["gone#3"], mark=False))["graph"]["expanded"] == []

            # a click on a node: its output, then its gradient
            act = json.loads(panel.node_tensor_json("1.act#0"))   # alive: 2 saved it
            assert act["name"] == "1.act output" and act["shape"] == [4, 3]
            assert "freed" in json.loads(panel.node_tensor_json("1.lin#0"))["error"]
            assert "no gradient" in json.loads(panel.node_tensor_json("2#0", grad=True))["error"]
            out.sum().backward()
            grad = json.loads(panel.node_tensor_json("2#0", grad=True))
            assert grad["name"] == "2.weight.grad" and grad["shape"] == [2, 3]
            assert "no node" in json.loads(panel.node_tensor_json("nope#0"))["error"]
        del out
        gc.collect()


def test_parse_address():
    from mldebug.dap import parse_address
    assert parse_address("5678") == ("127.0.0.1", 5678)
    assert parse_address("0.0.0.0:5678") == ("0.0.0.0", 5678)
    assert parse_address("[::1]:5678") == ("::1", 5678)
    with pytest.raises(ValueError, match="got 'x'"):
        parse_address("x")
