"""docs/security.md's two tables held to the code.

- Inventory: every module of the package that opens or uses a socket, or writes a file,
  is named in the table of its kind, and every module a table names does so (an `ast`
  walk over the calls that do it). A new door or file without a row fails here.
- Each row's claim, checked on the thing itself: where a door binds by default, what
  guards it; how a file is written (appended, replaced whole) and with which
  permissions. A row without a check here fails too.
"""
from __future__ import annotations

import ast
import json
import os
import re
import socket
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, clean_env

PACKAGE = REPO / "mldebug"
DOC = REPO / "docs" / "security.md"

# the calls that open a door (a listening socket, or a client of a store) ...
DOOR_CALLS = {"create_server", "bind_sockets", "listen", "TCPStore", "HTTPServer",
              "add_sockets", "socket", "accept"}
# ... and those that write a file
FILE_CALLS = {"os.open", "sqlite3.connect", "mkstemp", "mkdtemp", "os.replace", "os.rename",
              "replace_atomically", "append_line", "write_text", "write_bytes", "copyfile",
              "SummaryWriter", "FileWriter", "wandb.init"}
# where such a call is not a door or a file of its own, and why
NOT_ROWS = {
    "mldebug/core/user_files.py": "the helpers the rows' code writes with",
}


def _call_name(node: ast.Call) -> str:
    f = node.func
    if isinstance(f, ast.Attribute):
        base = f.value.id if isinstance(f.value, ast.Name) else ""
        return f"{base}.{f.attr}" if base else f.attr
    return f.id if isinstance(f, ast.Name) else ""


def _writes_with_open(node: ast.Call) -> bool:
    """open(PATH, MODE) / open(PATH, mode=MODE) with a mode that writes."""
    if _call_name(node) not in ("open", "io.open"):
        return False
    mode = node.args[1] if len(node.args) > 1 else next(
        (k.value for k in node.keywords if k.arg == "mode"), None)
    return isinstance(mode, ast.Constant) and any(c in str(mode.value) for c in "wax+")


def _found(calls: set) -> dict:
    """module path -> the matching calls in it."""
    found: dict = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = str(path.relative_to(REPO))
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Call):
                continue
            name = _call_name(node)
            short = name.rsplit(".", 1)[-1]
            hit = name in calls or short in calls
            if calls is FILE_CALLS and _writes_with_open(node):
                hit, name = True, "open(..., 'w'/'a')"
            if calls is DOOR_CALLS and short == "socket" and not name.endswith("socket.socket"):
                hit = False
            if calls is DOOR_CALLS and short == "listen" and name != "debugpy.listen":
                hit = False        # a socket's own .listen(), listeners' lists ...
            if hit and rel not in NOT_ROWS:
                found.setdefault(rel, set()).add(name)
    return found


def _table(heading: str) -> dict:
    """row name -> {column: cell} of the table under `## HEADING` in docs/security.md."""
    text = DOC.read_text()
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    columns = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(columns, cells))
    return rows


def _modules(rows: dict) -> set:
    return {m for row in rows.values() for m in re.findall(r"`(mldebug/[\w/]+\.py)`", row["code"])}


DOORS, FILES = _table("Doors"), _table("Files")


def test_every_module_that_opens_a_door_is_in_the_doors_table():
    found = _found(DOOR_CALLS)
    named = _modules(DOORS)
    assert set(found) <= named, f"doors not in docs/security.md: { {m: found[m] for m in set(found) - named} }"
    assert named <= set(found), f"rows whose code opens no door: {named - set(found)}"


def test_every_module_that_writes_a_file_is_in_the_files_table():
    found = _found(FILE_CALLS)
    named = _modules(FILES)
    assert set(found) <= named, f"files not in docs/security.md: { {m: found[m] for m in set(found) - named} }"
    assert named <= set(found), f"rows whose code writes no file: {named - set(found)}"


# -- each door's row, checked ------------------------------------------------------------
def check_browser_view(row):
    from mldebug.view import server
    sockets, port = server.bind(0)
    try:
        assert {s.getsockname()[0] for s in sockets} == {"127.0.0.1"} == {server.HOST}
    finally:
        for s in sockets:
            s.close()
    assert "`127.0.0.1:5006`" in row["binds by default"] and server.DEFAULT_PORT == 5006
    assert "token" in row["guard"] and "origin" in row["guard"]


def check_remote_prompt(row, monkeypatch):
    from mldebug.core import prompt_key
    from mldebug.remote_prompt import RemotePrompt
    monkeypatch.delenv("MLDEBUG_ATTACH_HOST", raising=False)
    assert RemotePrompt(debugger=None).host == "127.0.0.1"
    assert row["binds by default"].startswith("`127.0.0.1`")
    assert "`MLDEBUG_ATTACH_HOST`" in row["binds by default"]
    # the key: a fresh challenge each time, answered only with the key
    key = prompt_key.new_key()
    assert len(bytes.fromhex(key)) == 32 and "32-byte key" in row["guard"]
    assert prompt_key.answer(key, "a") != prompt_key.answer(key, "b")
    assert prompt_key.answer(key, "a") != prompt_key.answer(prompt_key.new_key(), "a")


def check_dap(row, tmp_path):
    from mldebug import dap
    assert dap.parse_address("5678") == ("127.0.0.1", 5678)
    assert row["binds by default"] == "`127.0.0.1:PORT`"
    prog = tmp_path / "prog.py"
    prog.write_text("print('ran')\n")
    run = subprocess.run([sys.executable, "-m", "mldebug", "--listen", "0.0.0.0:0", str(prog)],
                         capture_output=True, text=True, env=clean_env(), timeout=120)
    assert run.returncode == 0 and "ran" in run.stdout, run.stderr
    assert "warning: any client that reaches 0.0.0.0:" in run.stderr
    assert "A HOST that is not loopback prints a warning" in row["guard"]


def check_store(row):
    """mldebug is a client of the launcher's store, never its server."""
    tree = ast.parse((PACKAGE / "peers.py").read_text())
    stores = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
              and _call_name(n).endswith("TCPStore")]
    assert stores and all(any(k.arg == "is_master" and k.value.value is False
                              for k in n.keywords) for n in stores)
    assert "it opens no port" in row["opened when"]


DOOR_CHECKS = {"browser view": check_browser_view, "a rank's remote prompt": check_remote_prompt,
               "DAP (VS Code)": check_dap, "the launcher's store": check_store}


@pytest.mark.parametrize("name", sorted(DOORS))
def test_each_door_row_says_what_the_code_does(name, monkeypatch, tmp_path):
    assert name in DOOR_CHECKS, f"docs/security.md's door {name!r} has no check here"
    check = DOOR_CHECKS[name]
    args = {"monkeypatch": monkeypatch, "tmp_path": tmp_path}
    check(DOORS[name], **{k: v for k, v in args.items()
                          if k in check.__code__.co_varnames[:check.__code__.co_argcount]})


# -- each file's row, checked -------------------------------------------------------------
def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _umasked(mode: int) -> int:
    umask = os.umask(0)
    os.umask(umask)
    return mode & ~umask


def check_report(row, tmp_path, monkeypatch):
    from mldebug.core.records import Stop
    from mldebug.core.session import ReportWriter
    path = tmp_path / "stops.jsonl"
    path.write_text("a line the user wrote\n")
    os.chmod(path, 0o640)
    ReportWriter(str(path))(Stop(reason="nan", message="1 NaN"))
    lines = path.read_text().splitlines()
    assert lines[0] == "a line the user wrote" and json.loads(lines[1])["reason"] == "nan"
    assert _mode(path) == 0o640                    # an existing file keeps its mode
    fresh = tmp_path / "new.jsonl"
    ReportWriter(str(fresh))(Stop(reason="nan", message="1 NaN"))
    assert _mode(fresh) == _umasked(0o644) and "`0644` (less your umask)" in row["permissions"]
    assert row["how"].startswith("appended")


def check_run(row, tmp_path, monkeypatch):
    import torch

    import mldebug
    model = torch.nn.Linear(2, 1)
    for _ in range(2):
        with mldebug.record(model, run_dir=str(tmp_path), run="r", background=False) as rec:
            model(torch.ones(1, 2)).sum().backward()
            rec.step()
    assert _mode(tmp_path / "r.sqlite") == _umasked(0o644)
    assert len(mldebug.record.open_run(str(tmp_path / "r.sqlite")).steps()) == 1
    # a file of the same name that is not a recorded run is not replaced
    other = tmp_path / "mine.sqlite"
    other.write_bytes(b"the user's own file")
    with pytest.raises(FileExistsError, match="not a run mldebug recorded"):
        mldebug.record(model, run_dir=str(tmp_path), run="mine", background=False)
    assert other.read_bytes() == b"the user's own file"
    assert 'replaces only a recorded run of mldebug\'s' in row["how"]


def check_connection_file(row, tmp_path, monkeypatch):
    from mldebug.core import prompt_key
    monkeypatch.setenv("MLDEBUG_CACHE_DIR", str(tmp_path / "cache"))
    file = prompt_key.ConnectionFile("127.0.0.1", 1234, prompt_key.new_key(), rank=1)
    assert Path(file.path).parent == tmp_path / "cache" / "attach"
    assert _mode(file.path) == 0o600 and _mode(Path(file.path).parent) == 0o700
    assert row["permissions"] == "file `0600`, folder `0700`"
    assert prompt_key.key_for("127.0.0.1", 1234) == file.record["key"]
    file.remove()
    assert not Path(file.path).exists() and "removed when the prompt closes" in row["how"]


def check_kernels(row, tmp_path, monkeypatch):
    from mldebug.core import native
    monkeypatch.setenv("MLDEBUG_CACHE_DIR", str(tmp_path / "kernels"))
    source = str(PACKAGE / "watch" / "finite.c")
    try:
        built = native.library(source, ("-O1", "-shared", "-fPIC"))
    except OSError as exc:
        pytest.skip(f"no C compiler here: {exc}")
    assert Path(built).parent == tmp_path / "kernels" and _mode(tmp_path / "kernels") == 0o700
    assert [p.name for p in (tmp_path / "kernels").iterdir()] == [Path(built).name]  # no temp left
    assert row["permissions"] == "folder `0700`"


LAUNCHER = """
import os, subprocess, sys
log = open(sys.argv[1], sys.argv[2])           # the launcher's stderr: `> log` or `>> log`
os.dup2(log.fileno(), 2)
os.write(2, b"before\\n")
child_err = sys.argv[3]
with open(os.devnull if child_err == "same" else child_err, "w") as err:
    stderr = 2 if child_err == "same" else err.fileno()
    subprocess.run([sys.executable, "-c", "from mldebug.remote_prompt import announce; "
                    "import sys; sys.stdout.write(announce('the attach line\\\\n'))"],
                   stderr=stderr, start_new_session=True, check=True)
os.write(2, b"after\\n")
"""


def _announce_under(tmp_path, redirect, child):
    """A launcher whose stderr is a log opened REDIRECT ('w': `>`, 'a': `>>`) starts a
    rank in a session of its own (no terminal) whose stderr is the same log ('same') or a
    file of its own; the rank announces a line. Returns (the log, where the line went,
    the rank's own file)."""
    launcher = tmp_path / "launcher.py"
    launcher.write_text(LAUNCHER)
    log, own = tmp_path / "train.log", tmp_path / "rank.err"
    run = subprocess.run([sys.executable, str(launcher), str(log), redirect,
                          "same" if child == "same" else str(own)],
                         capture_output=True, text=True, env=clean_env(), timeout=60,
                         start_new_session=True)
    assert run.returncode == 0, run.stderr
    return log.read_text(), run.stdout, own.read_text() if own.exists() else None


@pytest.mark.parametrize("redirect, child, expected_log, told_at", [
    # `torchrun > log`: the rank's own stderr is the log (handed down): in order there
    ("w", "same", "before\nthe attach line\nafter\n", "stderr"),
    # `torchrun --redirects 3 > log`: the log is written without O_APPEND by the launcher
    # only; reopening it would write at an offset of its own: the rank's own file instead
    ("w", "own", "before\nafter\n", "stderr"),
    # `torchrun --redirects 3 >> log`: appended, so a line there harms nothing
    ("a", "own", "before\nthe attach line\nafter\n", "launcher"),
])
def test_the_announcement_never_writes_over_the_launchers_log(tmp_path, redirect, child,
                                                            expected_log, told_at):
    log, told, own = _announce_under(tmp_path, redirect, child)
    assert log == expected_log and told == told_at
    if child == "own" and told_at == "stderr":
        assert own == "the attach line\n"


def check_announcement(row, tmp_path, monkeypatch):
    log, told, _ = _announce_under(tmp_path, "w", "same")
    assert (log, told) == ("before\nthe attach line\nafter\n", "stderr")
    assert row["how"].startswith("appended (`O_APPEND`), never truncated")


def check_tensorboard(row, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    import torch

    import mldebug
    from mldebug.record.export import export
    model = torch.nn.Linear(2, 1)
    with mldebug.record(model, run_dir=str(tmp_path / "runs"), run="r", background=False) as rec:
        model(torch.ones(1, 2)).sum().backward()
        rec.step()
    out = tmp_path / "tb" / "r"
    out.mkdir(parents=True)
    (out / "notes.txt").write_text("the user's own file")
    export(str(tmp_path / "runs"), tensorboard=str(tmp_path / "tb"))
    export(str(tmp_path / "runs"), tensorboard=str(tmp_path / "tb"))    # again: one more
    events = sorted(p.name for p in out.iterdir() if p.name != "notes.txt")
    assert len(events) == 2 and all(e.startswith("events.out.tfevents.") and
                                    e.endswith(".mldebug") for e in events)
    assert (out / "notes.txt").read_text() == "the user's own file"
    assert all(_mode(out / e) == _umasked(0o644) or _mode(out / e) == _umasked(0o666)
               for e in events)
    assert row["how"].startswith("new files only")


FILE_CHECKS = {"the JSON report": check_report, "a recorded run": check_run,
               "an attach connection file": check_connection_file,
               "built C kernels": check_kernels,
               "a recording in TensorBoard": check_tensorboard,
               "the line that says where a rank's prompt is": check_announcement}


@pytest.mark.parametrize("name", sorted(FILES))
def test_each_file_row_says_how_the_code_writes_it(name, tmp_path, monkeypatch):
    assert name in FILE_CHECKS, f"docs/security.md's file {name!r} has no check here"
    FILE_CHECKS[name](FILES[name], tmp_path, monkeypatch)


