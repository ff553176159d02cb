"""Transcript tests of the real CLI: commands on stdin, the session text and the exit
status checked, as a user would see them."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import clean_env, marker_line, read_report, run_cli

ARGV_PROGRAM = """
    import sys
    print("argv=%r" % (sys.argv,))
    print("path0=%s" % sys.path[0])
    print("name=%s file=%s" % (__name__, __file__))
"""


def test_program_runs_as_main_with_argv_and_path_as_python_gives(write_program, tmp_path):
    prog = write_program(ARGV_PROGRAM)
    plain = subprocess.run([sys.executable, "prog.py", "a", "--lr", "0.1"], cwd=tmp_path,
                           capture_output=True, text=True, env=clean_env())
    result = run_cli(["prog.py", "a", "--lr", "0.1"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout
    assert f"path0={prog.parent}" in result.stdout
    assert "argv=['prog.py', 'a', '--lr', '0.1']" in result.stdout


def test_dash_m_runs_a_module_like_python_dash_m(write_program, tmp_path):
    write_program(ARGV_PROGRAM, name="pkg/mod.py")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    plain = subprocess.run([sys.executable, "-m", "pkg.mod", "-v", "x"], cwd=tmp_path,
                           capture_output=True, text=True, env=clean_env())
    result = run_cli(["-m", "pkg.mod", "-v", "x"], cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout == plain.stdout


def test_does_not_stop_at_start_and_exit_status_is_the_programs(write_program):
    prog = write_program("""
        print("running")
        raise SystemExit(7)
    """)
    result = run_cli([str(prog)])
    assert result.returncode == 7
    assert result.stdout == "running\n"
    assert "(mldebug)" not in result.stdout


def test_stop_at_start_stops_on_the_first_line_like_pdb(write_program):
    prog = write_program("""
        x = 41
        x += 1
        print("x is", x)
    """)
    result = run_cli(["--stop-at-start", str(prog)], stdin="n\np x\nc\n")
    assert result.returncode == 0, result.stderr
    assert f"> {prog}(2)<module>()" in result.stdout
    assert "(mldebug) 41" in result.stdout
    assert "x is 42" in result.stdout


def test_breakpoint_opens_mldebug_and_inspect_summarises_a_tensor(write_program):
    prog = write_program("""
        import torch
        weights = torch.arange(6, dtype=torch.float32).reshape(2, 3)
        breakpoint()  # here
        print("after", weights.sum().item())
    """)
    result = run_cli([str(prog)], stdin="inspect weights\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "(mldebug) " in out
    assert "tensor[2, 3] f32" in out
    assert "after 15.0" in out


def test_bad_expression_is_one_error_line_and_the_prompt_stays(write_program):
    prog = write_program("""
        class Grumpy:
            def __repr__(self):
                raise RuntimeError("no repr for you")
        g = Grumpy()
        value = 3
        breakpoint()
        print("value", value)
    """)
    result = run_cli([str(prog)], stdin="inspect nosuchname\ninspect 1 +\ninspect g\n"
                                        "inspect\np value\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "*** inspect nosuchname: NameError: name 'nosuchname' is not defined" in out
    assert "*** inspect 1 +: SyntaxError" in out
    assert "repr failed: RuntimeError: no repr for you" in out
    assert "*** usage: inspect EXPR" in out
    assert "(mldebug) 3\n" in out
    assert "value 3" in out


def test_uncaught_exception_opens_post_mortem_at_the_user_frame_and_exits_1(write_program):
    prog = write_program("""
        import torch

        def project(x, w):
            return x @ w  # here

        project(torch.ones(2, 3), torch.ones(4, 5))
    """)
    result = run_cli([str(prog)], stdin="p x.shape\nup\np __name__\nq\n")
    assert result.returncode == 1
    line = marker_line(prog)
    assert f"> {prog}({line})project()" in result.stdout
    assert "(mldebug) torch.Size([2, 3])" in result.stdout
    assert "mldebug: uncaught RuntimeError" in result.stdout
    assert "Traceback (most recent call last)" in result.stderr
    assert "mldebug/cli.py" not in result.stderr  # our own frames are not the user's business


@pytest.mark.parametrize("where", ["an op", "a hook in backward"])
def test_an_uncaught_exception_prints_the_traceback_plain_python_prints(write_program, where):
    # the watch's dispatch (the op's own error) and the wrappers around backward() are
    # mldebug's: the frames printed are those of the program and the libraries it called
    prog = write_program(f"""
        import torch
        net = torch.nn.Linear(4, 3)
        if {where == "a hook in backward"}:
            net.weight.register_hook(lambda g: g.view(-1, 5))
            net(torch.ones(2, 4)).sum().backward()
        net(torch.ones(2, 5))
    """)
    plain = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True,
                           env=clean_env(), timeout=120)
    result = run_cli(["--batch", str(prog)])
    assert result.returncode == plain.returncode == 1, result.stderr

    def frames(text):
        return [line.strip() for line in text.splitlines() if line.strip().startswith("File ")]
    # (nn.Module's call takes its slower path under the watch's global module hooks:
    # other lines of torch's module.py, and one more frame of it, `inner`)
    shown, expected = frames(result.stderr), frames(plain.stderr)
    assert [f for f in shown if "nn/modules/module.py" not in f] == [
        f for f in expected if "nn/modules/module.py" not in f], result.stderr
    assert not [f for f in shown if "/mldebug/" in f], result.stderr
    assert plain.stderr.strip().splitlines()[-1] in result.stderr


def test_dash_c_runs_commands_at_the_first_prompt(write_program):
    prog = write_program("""
        secret = 1234
        breakpoint()
        print("done")
    """)
    result = run_cli(["-c", "p secret * 2", "-c", "continue", str(prog)])
    assert result.returncode == 0, result.stderr
    assert "2468" in result.stdout
    assert "done" in result.stdout


def test_batch_reports_and_never_prompts(write_program, tmp_path):
    prog = write_program("""
        x = 1
        breakpoint()  # a plain breakpoint does not end a batch run
        print("went on")
        def fail():
            raise ValueError("bad value")  # here
        fail()
    """)
    report = tmp_path / "stops.jsonl"
    result = run_cli(["--batch", "--report", str(report), str(prog)])
    assert result.returncode == 1  # an uncaught exception keeps 1
    assert "went on" in result.stdout
    assert "(mldebug)" not in result.stdout
    assert "mldebug: stop: breakpoint at prog.py:3" in result.stderr
    assert "mldebug: stop: uncaught ValueError: bad value" in result.stderr
    records = read_report(report)
    assert [r["reason"] for r in records] == ["breakpoint", "exception"]
    exc = records[1]
    for key in ("reason", "message", "file", "line", "function", "stage", "op", "module",
                "assertion"):
        assert key in exc
    assert exc["file"] == str(prog)
    assert exc["line"] == marker_line(prog)
    assert exc["function"] == "fail"
    assert exc["stage"] == "other"
    assert exc["op"] == "" and exc["module"] == "" and exc["assertion"] == ""


def test_report_appends_across_runs(write_program, tmp_path):
    prog = write_program("breakpoint()\n")
    report = tmp_path / "r.jsonl"
    for _ in range(2):
        assert run_cli(["--batch", "--report", str(report), str(prog)]).returncode == 0
    assert len(read_report(report)) == 2


@pytest.mark.parametrize("args, needle", [
    (["nosuch.py"], "mldebug: error: no such file: 'nosuch.py'"),
    (["--bogus", "x.py"], "mldebug: error: unrecognized arguments: --bogus"),
    (["--break-on", "nan,bogus", "x.py"], "unknown break-on kind 'bogus'"),
    ([], "mldebug: error: no program given"),
    (["-m", "no_such_module_xyz"], "cannot run module 'no_such_module_xyz'"),
])
def test_bad_command_lines_are_one_line_and_exit_2(args, needle, tmp_path):
    result = run_cli(args, cwd=tmp_path)
    assert result.returncode == 2
    assert needle in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr


def test_help_explains_every_option_with_examples():
    result = run_cli(["--help"])
    assert result.returncode == 0
    for option in ("-m", "-c", "--stop-at-start", "--batch", "--report", "--break-on",
                   "--watch", "--allow", "--plain"):
        assert option in result.stdout
    assert "examples:" in result.stdout
    assert "python -m mldebug --batch --report stops.jsonl train.py" in result.stdout


def test_pythonbreakpoint_env_works_without_the_cli(write_program, tmp_path):
    prog = write_program("""
        import torch
        t = torch.tensor([1.0, float('nan'), 3.0])
        breakpoint()
        print("resumed")
    """)
    result = subprocess.run([sys.executable, str(prog)], input="inspect t\nc\n",
                            capture_output=True, text=True,
                            env=clean_env(PYTHONBREAKPOINT="mldebug.set_trace"))
    assert result.returncode == 0, result.stderr
    assert "(mldebug) " in result.stdout
    assert "NaN" in result.stdout
    assert "resumed" in result.stdout


def test_mldebug_set_trace_from_python(write_program):
    prog = write_program("""
        import mldebug
        answer = 42
        mldebug.set_trace()
        print("resumed")
    """)
    result = subprocess.run([sys.executable, str(prog)], input="p answer\nc\n",
                            capture_output=True, text=True, env=clean_env())
    assert result.returncode == 0, result.stderr
    assert "(mldebug) 42" in result.stdout
    assert "resumed" in result.stdout


def test_pdb_commands_keep_working(write_program):
    prog = write_program("""
        def inner(a):
            b = a * 2
            breakpoint()
            return b + 1

        def outer():
            return inner(5)

        print("result", outer())
    """)
    result = run_cli([str(prog)], stdin="where\nup\np __name__\ndown\npp {'b': b}\n"
                                        "display b\nn\nn\nc\n")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "outer()" in out and "inner()" in out
    assert "{'b': 10}" in out
    assert "display b: 10" in out
    assert "result 11" in out


def test_help_inspect_prints_its_syntax(write_program):
    prog = write_program("breakpoint()\n")
    result = run_cli([str(prog)], stdin="help inspect\nhelp why\nc\n")
    assert "inspect EXPR" in result.stdout
    assert "why" in result.stdout


def test_console_script_is_the_same_cli(write_program):
    import shutil

    exe = shutil.which("mldebug")
    if exe is None:
        pytest.skip("the mldebug console script is not installed (run scripts/setup.sh)")
    prog = write_program("import sys; print('hello from', sys.argv[1:]); sys.exit(5)\n")
    result = subprocess.run([exe, str(prog), "x"], capture_output=True, text=True,
                            env=clean_env())
    assert result.returncode == 5
    assert result.stdout == "hello from ['x']\n"


def test_inspect_module_and_container_at_the_prompt(write_program):
    prog = write_program("""
        import torch
        from torch import nn
        net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        batch = {"x": torch.zeros(2, 3), "y": torch.tensor([1, 0])}
        breakpoint()
    """)
    result = run_cli([str(prog)], stdin="inspect net\ninspect batch\nc\n")
    out = result.stdout
    assert "Sequential (training): 4 parameter tensors, 21 elements" in out
    assert "0.weight  [4, 3]" in out
    assert "x: tensor[2, 3] f32" in out
    assert "y: tensor[2] i64" in out


# -- the prompt keeps pdb's promises (end of input, why, watch exact, shutdown) --------

NAN_PROGRAM = """
    import torch
    x = torch.zeros(3)
    y = torch.log(x) * 0      # -inf * 0 = NaN
    print("after", y)
"""


def test_end_of_input_at_a_stop_says_so_and_exits_3(write_program):
    prog = write_program(NAN_PROGRAM)
    result = run_cli([str(prog)], stdin="")          # stdin ends at the NaN stop
    assert result.returncode == 3, result.stderr
    assert "mldebug: input ended at a stop; use --batch in scripts" in result.stderr
    assert "after" not in result.stdout


def test_end_of_input_at_a_breakpoint_also_exits_3(write_program):
    prog = write_program("""
        x = 1
        breakpoint()
        print("after", x)
    """)
    result = run_cli([str(prog)], stdin="p x\n")
    assert result.returncode == 3, result.stderr
    assert result.stderr.count("input ended at a stop") == 1
    assert "after 1" not in result.stdout      # the program did not run on


def test_end_of_input_in_post_mortem_keeps_exit_status_1(write_program):
    prog = write_program("""
        raise ValueError("boom")
    """)
    result = run_cli([str(prog)], stdin="")
    assert result.returncode == 1, result.stderr
    assert "input ended at a stop" in result.stderr


def test_why_before_any_stop_is_one_line(write_program):
    prog = write_program("""
        x = 1
        print("x", x)
    """)
    result = run_cli(["--stop-at-start", str(prog)], stdin="why\nc\n")
    assert result.returncode == 0, result.stderr
    assert "why: nothing has stopped the program yet" in result.stdout
    assert "internal error" not in result.stdout + result.stderr
    assert "Error" not in result.stdout.split("why:")[1].splitlines()[0]


def test_a_breakpoint_still_set_at_exit_prints_nothing_extra(write_program):
    prog = write_program("""
        def f(x):
            return x + 1
        breakpoint()
        print("done")
    """)
    result = run_cli([str(prog)], stdin="b 3\nc\n")
    assert result.returncode == 0, result.stderr
    assert "done" in result.stdout
    assert result.stderr == ""          # no "Exception ignored ... fnmatch" at shutdown


@pytest.mark.parametrize("how", ["PYTHONBREAKPOINT", "set_trace"])
def test_a_breakpoint_still_set_at_exit_prints_nothing_extra_without_the_cli(write_program, how):
    """The API path: `PYTHONBREAKPOINT=mldebug.set_trace python prog.py` and a call of
    mldebug.set_trace() in the program, with a breakpoint still set when it ends."""
    stop = "breakpoint()" if how == "PYTHONBREAKPOINT" else "import mldebug; mldebug.set_trace()"
    prog = write_program(f"""
        def f(x):
            return x + 1
        {stop}
        print("done", f(1))
    """)
    env = clean_env(PYTHONBREAKPOINT="mldebug.set_trace", MLDEBUG_PLAIN="1")
    result = subprocess.run([sys.executable, str(prog)], input="b 3\nc\nc\n",
                            capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "done 2" in result.stdout
    assert result.stderr == ""          # no "Exception ignored ... fnmatch" at shutdown


def test_breakpoint_under_stop_at_start_lands_in_the_users_code(write_program):
    prog = write_program("""
        x = 1
        breakpoint()
        print("done", x)
    """)
    result = run_cli(["--stop-at-start", str(prog)], stdin="c\nc\n")
    assert result.returncode == 0, result.stderr
    assert f"> {prog}(4)<module>()" in result.stdout
    assert "bdb.py" not in result.stdout and "pdb.py" not in result.stdout


def test_watch_exact_at_the_prompt_as_on_the_command_line(write_program):
    prog = write_program("""
        import torch
        breakpoint()
        x = torch.zeros(3)
        y = torch.log(x) * 0
        print("after")
    """)
    result = run_cli(["--watch", "off", str(prog)],
                     stdin="watch\nwatch exact\nwatch\nc\nwhy\nq\n")
    out = result.stdout
    assert "watch is off" in out
    assert "watch is on (exact)" in out
    assert "watch is on (exact); break on:" in out
    assert "from aten.log.default" in out     # the exact watch stopped at the op
    assert "after" not in out
