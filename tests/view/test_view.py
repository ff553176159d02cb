"""The browser view (mldebug/view) driven for real: its Bokeh page in headless Chromium
(Debian's /usr/bin/chromium through Playwright), the CLI in a subprocess, and raw HTTP /
websocket requests for the security checks.

In-process tests share one view started by `mldebug.view(0)`; the stop / Continue / Step
over tests run `python -m mldebug --view 0 prog.py` with a pipe on stdin that stays open
and empty, so only the page's buttons drive the prompt.
"""
from __future__ import annotations

import asyncio
import io
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from conftest import CHROMIUM, CHROMIUM_ARGS, clean_env, headless_chromium  # noqa: F401

NAN_RGB, POSINF_RGB, NEGINF_RGB = (255, 0, 255), (255, 40, 40), (0, 230, 255)

needs_chromium = pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                    reason=f"{CHROMIUM} missing: apt-get install chromium")

# Pixels of the heatmap canvas (Bokeh draws a plot on <canvas class="bk-layer">).
PIXELS_JS = """c => {
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  const seen = new Set(); const has = {nan: 0, posinf: 0, neginf: 0};
  for (let i = 0; i < d.length; i += 4) {
    const key = (d[i] << 16) | (d[i + 1] << 8) | d[i + 2];
    seen.add(key);
    if (d[i] === %d && d[i + 1] === %d && d[i + 2] === %d) has.nan++;
    if (d[i] === %d && d[i + 1] === %d && d[i + 2] === %d) has.posinf++;
    if (d[i] === %d && d[i + 1] === %d && d[i + 2] === %d) has.neginf++;
  }
  return {colours: seen.size, ...has};
}""" % (NAN_RGB + POSINF_RGB + NEGINF_RGB)

# All text of the page, shadow roots included (Bokeh renders every widget in one).
TEXT_JS = """() => {
  const out = [];
  const walk = (root) => {
    const it = document.createTreeWalker(root, NodeFilter.SHOW_ELEMENT | NodeFilter.SHOW_TEXT);
    for (let n = it.currentNode; n; n = it.nextNode()) {
      if (n.nodeType === Node.TEXT_NODE) {
        const tag = n.parentNode && n.parentNode.nodeName;
        if (tag !== 'STYLE' && tag !== 'SCRIPT') out.push(n.nodeValue);
      } else if (n.shadowRoot) walk(n.shadowRoot);
    }
  };
  walk(document);
  return out.join(' ');
}"""


def page_text(page) -> str:
    return " ".join(page.evaluate(TEXT_JS).split())


def wait_text(page, pattern: str, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = page_text(page)
        if re.search(pattern, text):
            return text
        if time.monotonic() > deadline:
            raise AssertionError(f"no {pattern!r} in the page; it shows: {text[-1500:]}")
        page.wait_for_timeout(100)


def wait_until(page, read, ok, timeout: float = 20.0):
    """READ() again and again until OK(value) holds; returns that value. Waits on the
    state the test needs (a drawn canvas), never on a fixed time: a loaded machine
    draws late."""
    deadline = time.monotonic() + timeout
    while True:
        value = read()
        if ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"still not there after {timeout} s: {value!r}")
        page.wait_for_timeout(100)


def div_text(page, css_class: str) -> str:
    return " ".join(page.locator(f".{css_class}").first.evaluate(
        "e => (e.shadowRoot || e).textContent").split())


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as b:
        yield b


@pytest.fixture(scope="module")
def view_url():
    import mldebug
    from mldebug import view as _view
    url = mldebug.view(0)
    yield url
    _view.close()


@pytest.fixture
def page(browser, view_url):
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    p = context.new_page()
    yield p
    context.close()


def open_page(page, url):
    page.goto(url)
    wait_text(page, "Inspect list")


# -- the URL, the API --------------------------------------------------------------------
def test_view_returns_the_same_url_with_its_token(view_url):
    import mldebug
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+/\?token=[\w-]{20,}", view_url)
    assert mldebug.view() == view_url          # idempotent
    assert mldebug.view.url() == view_url


def test_inspect_returns_its_argument_and_names_it_from_the_call(view_url):
    import torch

    import mldebug
    from mldebug.view import state
    weights = torch.ones(3)
    assert mldebug.inspect(weights) is weights
    assert state.hub().entries[-1].name == "weights"
    mldebug.inspect(weights * 2, name="doubled")
    assert state.hub().entries[-1].name == "doubled"
    with pytest.raises(TypeError, match="name must be a str"):
        mldebug.inspect(weights, name=3)


# -- security --------------------------------------------------------------------------
def _get(url, headers=None):
    request = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, dict(r.headers), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read().decode()


def test_the_page_needs_the_token(view_url):
    base = view_url.split("?")[0]
    assert _get(base)[0] == 403
    assert _get(base + "?token=wrong")[0] == 403
    status, headers, body = _get(view_url)
    assert status == 200 and "bokeh" in body.lower()
    assert "HttpOnly" in headers.get("Set-Cookie", "") and "SameSite=Strict" in headers["Set-Cookie"]
    # the session metadata endpoint is behind the token too
    assert _get(base + "metadata")[0] in (403, 404)


def test_the_websocket_needs_its_origin_and_the_token(view_url):
    from tornado.httpclient import HTTPClientError, HTTPRequest
    from tornado.websocket import websocket_connect

    from mldebug.view import running
    server = running()
    host = f"127.0.0.1:{server.port}"
    cookie = f"{server.cookie}={server.token}"

    async def status(origin, with_cookie):
        headers = {"Origin": origin}
        if with_cookie:
            headers["Cookie"] = cookie
        request = HTTPRequest(f"ws://{host}/ws", headers=headers)
        try:
            conn = await websocket_connect(request, subprotocols=["bokeh", "x"])
        except HTTPClientError as e:
            return e.code
        # "x" is no Bokeh session token: the server closes the socket after logging
        # why. Wait for that, so the server thread is done formatting its traceback
        # before the next test runs (CPython 3.11's AST parser, which traceback
        # formatting uses, is not safe against a parse on another thread).
        closed = await asyncio.wait_for(conn.read_message(), timeout=10)
        conn.close()
        return 101 if closed is None else f"open, got {closed!r}"

    async def all_three():
        return (await status("http://evil.example", True),
                await status(f"http://{host}", False),
                await status(f"http://{host}", True))
    foreign, no_token, good = asyncio.run(all_three())
    assert foreign == 403
    assert no_token == 403
    assert good == 101     # the handshake itself is allowed: the refusals are the guard


def test_a_port_in_use_gives_a_note_and_another_port():
    from mldebug.view.server import bind
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    out = io.StringIO()
    try:
        sockets, got = bind(port, out=out)
    finally:
        taken.close()
    for s in sockets:
        s.close()
    assert got != port
    assert f"port {port} is in use; using port {got} instead" in out.getvalue()


def test_cli_view_does_not_eat_the_script_name_and_checks_the_port(tmp_path):
    from mldebug.cli import build_parser, split_argv
    own, rest = split_argv(["--view", "train.py", "--lr", "1"])
    args = build_parser().parse_args(own)
    assert (args.view, args.target, rest) == ("", "train.py", ["--lr", "1"])
    own, rest = split_argv(["--view", "8000", "train.py"])
    assert build_parser().parse_args(own).view == "8000"
    (tmp_path / "x.py").write_text("print('ran')\n")
    r = subprocess.run([sys.executable, "-m", "mldebug", "--view=http", str(tmp_path / "x.py")],
                       capture_output=True, text=True, env=clean_env(), timeout=60)
    assert r.returncode == 2
    assert "--view: the view's port must be a number in 0..65535, got 'http'" in r.stderr
    assert "ran" not in r.stdout


# -- the tensor panel ---------------------------------------------------------------------
@needs_chromium
def test_heatmap_renders_nonfinite_in_their_colours_and_hover_shows_index_and_value(page, view_url):
    import torch

    import mldebug
    torch.manual_seed(0)
    grid = torch.randn(200, 300)
    grid[10:30, 10:30] = float("nan")
    grid[50:70, 50:70] = float("inf")
    grid[90:110, 90:110] = -float("inf")
    mldebug.inspect(grid, name="grid")
    open_page(page, view_url)
    wait_text(page, r"grid tensor\[200, 300\] f32")
    wait_text(page, r"NaN\s*400")                       # the stats table, full pass
    canvas = page.locator(".mld-heatmap canvas").first
    # not blank (a real heatmap) and every non-finite block drawn in its colour
    wait_until(page, lambda: canvas.evaluate(PIXELS_JS),
               lambda px: px["colours"] > 50 and px["nan"] > 100 and px["posinf"] > 100
               and px["neginf"] > 100)

    # hover at the centre of the 20x20 NaN block, then over a finite cell
    box = canvas.bounding_box()
    for _ in range(2):
        page.mouse.move(box["x"] + box["width"] * 0.5, box["y"] + box["height"] * 0.5)
        page.wait_for_timeout(200)
    text = wait_text(page, r"index:\s*\[\d+, \d+\]\s*value:\s*-?\d")
    r, c, v = re.search(r"index:\s*\[(\d+), (\d+)\]\s*value:\s*(-?[\d.e+-]+)", text).groups()
    assert float(v) == pytest.approx(float(grid[int(r), int(c)]), rel=1e-4, abs=1e-5)


@needs_chromium
def test_image_view_shows_an_image_and_the_gradient_toggle(page, view_url):
    import torch

    import mldebug
    images = torch.rand(2, 3, 32, 32, requires_grad=True)
    (images * images).sum().backward()
    mldebug.inspect(images, name="images")
    open_page(page, view_url)
    wait_text(page, r"images tensor\[2, 3, 32, 32\]")
    img = page.locator(".mld-image img.mld-img")
    img.wait_for(timeout=20000)
    size = img.evaluate("i => [i.complete, i.naturalWidth, i.naturalHeight]")
    assert size == [True, 32, 32]
    # the batch slider and the dims (rows 2, columns 3) are there
    text = page_text(page)
    assert "dim 0 index (batch)" in text and "dim 1 index" in text
    page.get_by_role("button", name="gradient").click()
    wait_text(page, r"images\.grad tensor\[2, 3, 32, 32\]")
    wait_text(page, r"max\s*1\.99")                     # d(x²)/dx = 2x, x < 1


# -- the program under the CLI: stops, Continue, Step over ---------------------------------
NAN_PROGRAM = """\
import torch
torch.manual_seed(0)
weights = torch.randn(4, 6)
shifted = weights - 10
logs = torch.log(shifted)
after = 1
print("finished", after, flush=True)
"""

GRAPH_PROGRAM = """\
import torch
from torch import nn

class Explode(nn.Module):
    shift = -100.0

    def forward(self, x):
        return torch.log(x - self.shift)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Explode())
x = torch.randn(2, 4)
model(x)               # two healthy calls: the watch knows the model's call by now
model(x)
Explode.shift = 100.0  # log of values below 0 from here
out = model(x)
print("finished", flush=True)
"""


def start_cli(tmp_path, source: str, *options, env=None):
    prog = tmp_path / "prog.py"
    prog.write_text(source)
    proc = subprocess.Popen([sys.executable, "-m", "mldebug", "--view", "0", *options, str(prog)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or clean_env(),
                            cwd=tmp_path)
    deadline = time.monotonic() + 60
    seen = []
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        seen.append(line)
        m = re.search(r"browser view at (http://\S+)", line)
        if m:
            return proc, m.group(1)
        if not line and proc.poll() is not None:
            break
    proc.kill()
    raise AssertionError(f"no URL printed: {''.join(seen)}")


def finish(proc, timeout=30):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the program did not end: {out}\n{err}")
    return out, err


@needs_chromium
def test_nan_stop_banner_then_step_over_and_continue_drive_the_prompt(browser, tmp_path):
    # as rank 1 of a launched job (the launcher's variables): the page says which rank
    proc, url = start_cli(tmp_path, NAN_PROGRAM,
                          env=clean_env(RANK="1", LOCAL_RANK="1", WORLD_SIZE="2"))
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    page = context.new_page()
    try:
        page.goto(url)
        text = wait_text(page, r"paused at the mldebug prompt at prog\.py:5")
        assert page.title() == "mldebug view [rank 1]"
        assert "rank 1" in text
        assert re.search(r"Stop: \d+ NaN from aten\.log", text)
        assert "reason nan" in text and "op aten.log.default" in text
        assert "at prog.py:5" in text and "stage forward" in text
        assert "Hint: log of 24 values outside its domain x > 0" in text   # (remedies/hints.py)
        page.get_by_role("button", name="Step over").click()
        wait_text(page, r"paused at the mldebug prompt at prog\.py:6")
        page.get_by_role("button", name="Continue").click()
        out, err = finish(proc)
    finally:
        context.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "finished 1" in out
    # the transcript shows the buttons' commands as typed lines
    assert "(mldebug) n   # from the browser view" in out
    assert "(mldebug) c   # from the browser view" in out


@needs_chromium
def test_graph_colours_the_bad_module_and_a_click_shows_a_node_output(browser, tmp_path):
    proc, url = start_cli(tmp_path, GRAPH_PROGRAM)
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    page = context.new_page()
    try:
        page.goto(url)
        wait_text(page, r"Stop: \d+ NaN from aten\.log")
        labels_js = """() => { const doc = Bokeh.documents[0];
            const src = doc && doc.get_model_by_name('mld-graph-nodes');
            return src ? Array.from(src.data.label) : []; }"""
        deadline = time.monotonic() + 20
        while not any("NaN/Inf!" in x for x in page.evaluate(labels_js)):
            assert time.monotonic() < deadline, page.evaluate(labels_js)
            page.wait_for_timeout(100)
        labels = page.evaluate(labels_js)     # what the graph draws, row by row
        assert labels[0].startswith("(root) (Sequential)")
        assert "0 (Linear) [2, 8] f32" in labels and "1 (ReLU) [2, 8] f32" in labels
        assert any(re.fullmatch(r"2 \(Explode\).* NaN/Inf!", x) for x in labels), labels
        canvas = page.locator(".mld-graph canvas").first
        red_js = """c => { const d = c.getContext('2d').getImageData(0, 0,
            c.width, c.height).data; let n = 0; for (let i = 0; i < d.length; i += 4)
            if (d[i] === 255 && d[i+1] === 107 && d[i+2] === 107) n++; return n; }"""
        # the Explode row is drawn in the non-finite colour
        wait_until(page, lambda: canvas.evaluate(red_js), lambda red: red > 50)
        # a click on the Explode row (what the TapTool does: select it in its source)
        page.evaluate("""() => { const doc = Bokeh.documents[0];
            const src = doc.get_model_by_name('mld-graph-nodes');
            const i = src.data.id.indexOf('2#0'); src.selected.indices = [i]; }""")
        wait_text(page, r"2 output tensor\[2, 8\] f32")
        wait_text(page, r"NaN\s*16")       # its stats: every element is NaN
        page.get_by_role("button", name="Continue").click()
        out, err = finish(proc)
    finally:
        context.close()
        if proc.poll() is None:
            proc.kill()
    assert "finished" in out, err


WAIT_PROGRAM = """\
import torch
import mldebug
x = torch.arange(12.).reshape(3, 4)
mldebug.inspect(x, wait=True)
print("after the wait", flush=True)
"""


@needs_chromium
def test_inspect_wait_blocks_until_continue_in_the_page(browser, tmp_path):
    prog = tmp_path / "waits.py"
    prog.write_text(WAIT_PROGRAM)
    proc = subprocess.Popen([sys.executable, str(prog)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=clean_env(), cwd=tmp_path)
    url = None
    for _ in range(20):
        m = re.search(r"browser view at (http://\S+)", proc.stderr.readline())
        if m:
            url = m.group(1)
            break
    assert url, "no URL printed"
    context = browser.new_context()
    page = context.new_page()
    try:
        page.goto(url)
        wait_text(page, r"paused by mldebug\.inspect\(\.\.\., wait=True\) at waits\.py:4")
        wait_text(page, r"x tensor\[3, 4\] f32")
        time.sleep(0.5)
        assert proc.poll() is None          # still waiting
        page.get_by_role("button", name="Continue").click()
        out, err = finish(proc)
    finally:
        context.close()
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert out == "after the wait\n"


# -- the prompt (no browser) ------------------------------------------------------------
PROMPT_PROGRAM = """\
import torch
x = torch.ones(2, 3)
breakpoint()
print("finished", flush=True)
"""


def test_view_at_the_prompt_starts_it_and_inspect_fills_the_list(tmp_path):
    prog = tmp_path / "prog.py"
    prog.write_text(PROMPT_PROGRAM)
    # every line arrives at once: the ones after `view 0` sit in sys.stdin's buffer and
    # must still be read once the prompt reads through the view
    commands = ("view 0\nview\ninspect x\n"
                "!import mldebug.view.state as s; print('entries:', [e.name for e in s.hub().entries])\n"
                "c\n")
    r = subprocess.run([sys.executable, "-m", "mldebug", str(prog)], input=commands,
                       capture_output=True, text=True, env=clean_env(), timeout=90)
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert re.search(r"\(mldebug\) browser view at http://127\.0\.0\.1:\d+/\?token=\S+", out)
    assert re.search(r"\(mldebug\) the browser view runs at http://127\.0\.0\.1:\d+/", out)
    assert "x: tensor[2, 3] f32" in out
    assert "entries: ['x']" in out
    assert "finished" in out


def test_the_server_threads_are_hidden_from_pydevd(view_url):
    from mldebug.view import running
    server = running()
    for thread in (server.thread, server.worker):
        assert thread.daemon
        assert thread.pydev_do_not_trace is True and thread.is_pydev_daemon_thread is True
    assert server.thread.name == "mldebug-view"


def test_on_a_terminal_the_prompt_reads_typed_commands_while_the_view_runs(tmp_path):
    pexpect = pytest.importorskip("pexpect")
    prog = tmp_path / "prog.py"
    prog.write_text(PROMPT_PROGRAM.replace('print("finished"', 'y = 2\nprint("finished"'))
    child = pexpect.spawn(sys.executable, ["-m", "mldebug", "--view", "0", str(prog)],
                          cwd=str(tmp_path), env=clean_env(), encoding="utf-8", timeout=60,
                          dimensions=(40, 160))
    child.expect(r"browser view at http://127\.0\.0\.1:\d+/\?token=")
    child.expect(r"\(mldebug\) ")
    ansi = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
    assert "----> 4" in ansi.sub("", child.before)      # breakpoint() stops on line 4
    child.sendline("n")                                  # typed at the terminal
    child.expect(r"\(mldebug\) ")
    assert "----> 5" in ansi.sub("", child.before)
    child.sendline("c")
    child.expect("finished")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


@needs_chromium
def test_a_stop_no_prompt_pauses_for_still_reaches_the_banner(page, view_url):
    """The view is a listener of the session's stops: a --batch or DAP stop, which the
    page's prompt never pauses for, still shows in the banner."""
    from mldebug.core import session as _session
    from mldebug.core.records import Stop
    open_page(page, view_url)
    _session.current().record(Stop(reason="nan", op="aten.div.Tensor", module="fc",
                                   message="3 NaN from aten.div.Tensor in module fc (Linear)"))
    wait_text(page, r"Stop: 3 NaN from aten\.div\.Tensor in module fc")


def test_after_the_end_of_input_note_the_prompt_is_drawn_again_for_the_page_command():
    """The note about a closed stdin can come while a prompt is already drawn (the CI run
    that found this read EOF at the second prompt): the page's command must still show as
    typed at a prompt."""
    import threading
    from mldebug.view import state
    from mldebug.view.prompt import LineSource
    hub = state.Hub()
    out = io.StringIO()
    source = LineSource(hub, stdin=io.StringIO(""), stdout=out, prompt="(mldebug) ")
    out.write("(mldebug) ")                       # what cmd.Cmd draws before readline()
    # stdin ends first (an empty stream), the page's Continue comes a moment later
    threading.Timer(0.3, hub.commands.put, args=("c",)).start()
    assert source.readline() == "c\n"
    text = out.getvalue()
    assert "mldebug: stdin is closed" in text
    assert text.endswith("\n(mldebug) c   # from the browser view\n"), text


def test_the_banner_names_the_sample_a_nan_came_in_with():
    from mldebug.view.data import banner_html
    stop = {"reason": "nan", "message": "16 NaN ...", "stage": "forward",
            "data": {"variable": "batch['pixel_values']", "rows": [3, 9],
                     "dataset_indices": [77, 120]}, "rank": 0}
    html = banner_html({"mode": "prompt", "where": None, "stop": stop})
    assert "<i>rank</i> 0" in html                         # rank 0 of a job is shown too
    assert ("<i>data</i> batch[&#x27;pixel_values&#x27;] rows 3, 9 "
            "(dataset indices 77, 120)") in html
