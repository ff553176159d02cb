"""What a careless user gives mldebug: odd tensors, odd exceptions, odd command lines.
Each answer is a clear message, and the program's own behaviour is untouched."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env, marker_line, read_report, run_cli


def test_fake_meta_nested_mkldnn_and_export_run_unchanged_under_the_watch(write_program):
    prog = write_program("""
        import torch
        from torch import nn
        from torch._subclasses.fake_tensor import FakeTensorMode
        torch.export.export(nn.Linear(4, 2), (torch.ones(1, 4),))
        with FakeTensorMode():
            print("fake", tuple((torch.ones(3, 4) * 2).sum(0).shape))
        with torch.device("meta"):
            nn.Sequential(*[nn.Linear(4, 4) for _ in range(300)])
        print("meta", tuple((torch.ones(3, device="meta") * 2).shape))
        print("nested", (torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]) * 2).is_nested)
        print("mkldnn", (torch.ones(2, 2).to_mkldnn() * 2).layout)
    """)
    result = run_cli(["--batch", str(prog)])
    assert result.returncode == 0, result.stderr
    assert "fake (4,)" in result.stdout and "meta (3,)" in result.stdout
    assert "nested True" in result.stdout and "mkldnn torch._mkldnn" in result.stdout
    assert "Traceback" not in result.stderr


def test_inspect_at_a_breakpoint_does_not_eat_the_real_stop(write_program, tmp_path):
    prog = write_program("""
        import numpy as np, torch
        x = torch.from_numpy(np.array([1., np.nan, 3.], dtype=np.float32))
        breakpoint()
        y = x * 2  # here
    """)
    report = tmp_path / "r.jsonl"
    result = run_cli(["--report", str(report), str(prog)], stdin="inspect x\nc\nc\n")
    assert result.returncode == 0, result.stderr
    stops = read_report(report)
    assert [s["reason"] for s in stops] == ["breakpoint", "nan"]
    assert stops[1]["op"] == "aten.mul.Tensor" and stops[1]["line"] == marker_line(prog)


WATCHED_SCRIPT = """
    import torch, mldebug
    with mldebug.watch():
        y = torch.log(torch.zeros(2))  # here
    print("after", y)
"""


def test_watch_from_python_without_the_cli_pauses_at_the_prompt(write_program):
    pexpect = pytest.importorskip("pexpect")
    prog = write_program(WATCHED_SCRIPT)
    child = pexpect.spawn(sys.executable, [str(prog)], env=clean_env(MLDEBUG_PLAIN="1"),
                          encoding="utf-8", timeout=120)
    child.expect(r"\(mldebug\)")
    screen = child.before
    child.sendline("p 6 * 7")
    child.expect("42")
    child.sendline("c")
    child.expect(pexpect.EOF)
    screen += child.before
    child.close()
    assert child.exitstatus == 0, screen
    assert f"> {prog}({marker_line(prog)})<module>()" in screen
    assert "after tensor([-inf, -inf])" in screen


def test_watch_from_python_without_a_terminal_ends_at_the_stop_in_a_few_lines(write_program):
    """No terminal (stdin /dev/null, a scheduler's job): no prompt can be answered, so the
    stop's report line, then one StopError with the program's own frames; exit 1."""
    prog = write_program(WATCHED_SCRIPT)
    result = subprocess.run([sys.executable, str(prog)], stdin=subprocess.DEVNULL,
                            capture_output=True, text=True, env=clean_env())
    assert result.returncode == 1
    line = marker_line(prog)
    report = (f"mldebug: stop: 2 -Inf from aten.log.default (torch.log) at prog.py:{line} "
              "[forward]; this op made it from finite inputs")
    lines = result.stderr.splitlines()
    assert lines[0].startswith(report)
    assert lines[1] == "Traceback (the program's frames, most recent call last):"
    assert f'File "{prog}", line {line}, in <module>' in lines[2]
    assert f"mldebug.core.errors.StopError: {lines[0]}" in lines
    assert len(lines) <= 8 and "BdbQuit" not in result.stderr, lines
    assert "after" not in result.stdout


def test_batch_stop_stands_even_if_the_program_catches_base_exception(write_program):
    prog = write_program("""
        import torch
        for step in range(3):
            try:
                y = torch.log(torch.zeros(2)) if step == 1 else torch.ones(2)
            except BaseException as exc:
                print("caught", type(exc).__name__)
    """)
    result = run_cli(["--batch", str(prog)])
    assert result.returncode == 3
    assert "mldebug: stop:" in result.stderr


def test_watch_off_and_on_at_the_prompt_keeps_allow(write_program):
    prog = write_program("""
        import torch
        breakpoint()
        a = torch.log(torch.zeros(1))          # allowed: no stop
        b = torch.sqrt(torch.tensor([-1.0]))   # here
        print("done")
    """)
    result = run_cli(["--allow", "aten.log*", str(prog)], stdin="watch off\nwatch on\nc\nc\n")
    assert result.returncode == 0, result.stderr
    assert "from aten.log" not in result.stdout
    assert "NaN from aten.sqrt.default" in result.stdout
    assert "RuntimeWarning" not in result.stderr


def test_breakon_nan_at_the_prompt_starts_the_watch_when_it_was_not_running(write_program):
    prog = write_program("""
        import torch
        breakpoint()
        b = torch.sqrt(torch.tensor([-1.0]))   # here
        print("done")
    """)
    result = run_cli(["--break-on", "exception", str(prog)], stdin="breakon nan\nc\nc\n")
    assert "watch is on" in result.stdout
    assert "NaN from aten.sqrt.default" in result.stdout


def test_why_explains_the_current_stop_not_an_older_nan(write_program):
    prog = write_program("""
        import torch
        y = torch.log(torch.zeros(2))
        raise ValueError("later failure")
    """)
    result = run_cli([str(prog)], stdin="c\nwhy\nq\n")
    after = result.stdout.split("uncaught ValueError", 1)[1]
    assert "uncaught ValueError: later failure" in after.split("(mldebug) ", 2)[1]


def test_an_exception_whose_str_raises_still_gets_a_post_mortem(write_program):
    prog = write_program("""
        class Weird(Exception):
            def __str__(self):
                raise RuntimeError("no str")
        raise Weird()
    """)
    result = run_cli([str(prog)], stdin="q\n")
    assert result.returncode == 1
    assert "uncaught Weird: <str() failed: RuntimeError: no str>" in result.stdout
    assert "mldebug/session.py" not in result.stderr


def test_dash_m_module_whose_import_raises_is_a_clear_error(write_program, tmp_path):
    write_program("raise RuntimeError('broken package')\n", name="pkg/__init__.py")
    write_program("print('never')\n", name="pkg/m.py")
    result = run_cli(["-m", "pkg.m"], cwd=tmp_path)
    assert result.returncode == 2
    assert "RuntimeError: broken package" in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        "mldebug: error: cannot run module 'pkg.m': RuntimeError while importing it")
    assert "mldebug/cli.py" not in result.stderr


def test_double_dash_protects_a_script_name_that_starts_with_a_dash(write_program, tmp_path):
    write_program("import sys; print(sys.argv)\n", name="-dash.py")
    result = run_cli(["--", "-dash.py", "a"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "['-dash.py', 'a']" in result.stdout


def test_record_into_a_folder_that_cannot_be_written_is_one_clear_oserror(write_program, tmp_path):
    (tmp_path / "afile").write_text("not a folder")
    prog = write_program("""
        import torch, mldebug
        model = torch.nn.Linear(4, 2)
        try:
            mldebug.record(model, run_dir="afile/runs")
        except OSError as exc:
            print("caught", type(exc).__name__, exc)
        print("hooks left", len(model._forward_hooks))
    """)
    result = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                            cwd=tmp_path, env=clean_env(), timeout=120)
    assert result.returncode == 0, result.stderr
    assert ("caught NotADirectoryError mldebug.record: cannot write runs in "
            "run_dir='afile/runs'") in result.stdout
    assert "pass run_dir= a folder you can write to" in result.stdout
    assert "hooks left 0" in result.stdout


def test_verbose_shows_the_recorders_fallback_once_and_is_quiet_without(write_program, tmp_path):
    prog = write_program("""
        import torch, mldebug
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with mldebug.record(model, run_dir="runs", run="r"):
            for _ in range(3):
                optimizer.zero_grad()
                model(torch.randn(3, 4)).sum().backward()
                optimizer.step()
        print("recorded")
    """)
    env = clean_env(MLDEBUG_NATIVE="0")
    loud = run_cli(["-v", str(prog)], cwd=tmp_path, env=env)
    assert loud.returncode == 0, loud.stderr
    assert loud.stderr.count("the recorder's C kernel is not used (MLDEBUG_NATIVE=0)") == 1
    quiet = run_cli([str(prog)], cwd=tmp_path, env=env)
    assert quiet.returncode == 0 and "recorded" in quiet.stdout
    assert "kernel" not in quiet.stderr
