"""End to end in a real VS Code: the mldebug extension in code-server (VS Code's own
workbench and extension host, headless), driven by Playwright with Debian's chromium.

The freshly built .vsix is installed into a private code-server; a workspace holds a
small program that makes a NaN on its `# here` line and a launch.json of type `mldebug`.
The test starts debugging, waits for the stop at that line, reads the stop banner and a
tensor's summary from the Tensors panel (a webview: two iframes deep), presses Continue and
sees the program finish. A second program makes its NaN inside a model's module: the panel
draws the graph of the pass (the view's Bokeh figure, by the program's BokehJS), the marked
row is that module, and a click on it shows the module's output.

Needs `bash scripts/setup_vscode_e2e.sh` first (Node 24, code-server, chromium, the .vsix
under vscode-extension/.e2e/); skipped with that reason when it has not been run.
Artifacts of the last run (screenshots, logs): vscode-extension/.e2e/last-run/.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXT = REPO / "vscode-extension"
E2E = Path(os.environ.get("MLDEBUG_E2E_DIR", EXT / ".e2e"))
ENV_FILE = E2E / "env.sh"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-background-networking", "--disable-component-update",
                 "--no-first-run", "--disable-sync"]

pytestmark = pytest.mark.skipif(
    not ENV_FILE.exists(),
    reason=f"VS Code e2e not set up ({ENV_FILE} missing): run `bash scripts/setup_vscode_e2e.sh`")

PROGRAM = """\
import torch

w = torch.linspace(-1.0, 1.0, 12).reshape(3, 4)
x = torch.log(torch.zeros(2))       # -inf, not a stop with breakOn ["nan"]
y = x - x  # here
print("finished", y.tolist())
"""

# a NaN inside a model's module (the DAP tests' program): the panel's graph marks head#0
MODEL_PROGRAM = (REPO / "tests" / "programs_dap" / "nan_model.py").read_text()

USER_SETTINGS = {
    "security.workspace.trust.enabled": False,
    "workbench.startupEditor": "none",
    "workbench.tips.enabled": False,
    "workbench.enableExperiments": False,
    "workbench.secondarySideBar.defaultVisibility": "hidden",
    "telemetry.telemetryLevel": "off",
    "update.mode": "none",
    "extensions.autoCheckUpdates": False,
    "extensions.autoUpdate": False,
    "extensions.ignoreRecommendations": True,
    "workbench.welcomePage.walkthroughs.openOnInstall": False,
    "chat.disableAIFeatures": True,
    "debug.openDebug": "openOnDebugBreak",
    "debug.internalConsoleOptions": "openOnSessionStart",
    "window.restoreWindows": "none",
    "remote.autoForwardPorts": False,
}


def read_env() -> dict:
    pairs = (line.split("=", 1) for line in ENV_FILE.read_text().splitlines() if "=" in line)
    return {k.strip(): v.strip() for k, v in pairs}


def marker_line(text: str, marker: str = "# here") -> int:
    return next(n for n, line in enumerate(text.splitlines(), 1) if marker in line)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fresh_vsix(vsix: Path) -> Path:
    """Rebuild the .vsix when a source is newer than it (setup built it once)."""
    sources = [EXT / "package.json", *(EXT / "src").rglob("*.ts"), *(EXT / "media").iterdir()]
    if not vsix.exists() or max(p.stat().st_mtime for p in sources) > vsix.stat().st_mtime:
        subprocess.run(["npm", "run", "-s", "package", "--", "-o", str(vsix)], cwd=EXT, check=True,
                       timeout=300, capture_output=True)
    return vsix


class CodeServer:
    """A private code-server: own HOME, TMPDIR, config, user data and extensions; started
    as a process-group leader and stopped by killing the group (its extension host,
    debug adapter and debuggee included)."""

    def __init__(self, root: Path, cs_bin: str, node24: str):
        self.root, self.cs_bin = root, cs_bin
        self.port = free_port()
        self.env = dict(os.environ, HOME=str(root / "home"), TMPDIR=str(root / "tmp"),
                        PATH=f"{node24}/bin:{os.environ.get('PATH', '')}",
                        PYTHONPATH=f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        for key in ("PYTHONBREAKPOINT", "VSCODE_IPC_HOOK_CLI", "NODE_OPTIONS"):
            self.env.pop(key, None)
        for sub in ("home", "tmp", "ud/User", "ext", "ws/.vscode"):
            (root / sub).mkdir(parents=True, exist_ok=True)
        self.config = root / "cs-config.yaml"
        self.config.write_text(f"bind-addr: 127.0.0.1:{self.port}\nauth: none\ncert: false\n")
        self.proc: subprocess.Popen | None = None

    def common_args(self) -> list[str]:
        return [self.cs_bin, "--config", str(self.config), "--user-data-dir", str(self.root / "ud"),
                "--extensions-dir", str(self.root / "ext")]

    def install(self, vsix: Path) -> None:
        subprocess.run([*self.common_args(), "--install-extension", str(vsix), "--force"],
                       env=self.env, check=True, timeout=180, capture_output=True)

    def start(self) -> str:
        log = open(self.root / "code-server.log", "w")
        self.proc = subprocess.Popen(
            [*self.common_args(), "--auth", "none", "--bind-addr", f"127.0.0.1:{self.port}",
             "--disable-telemetry", "--disable-update-check", "--disable-workspace-trust",
             "--reconnection-grace-time", "10", str(self.root / "ws")],
            env=self.env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/healthz", timeout=2)
                return f"http://127.0.0.1:{self.port}/?folder={self.root / 'ws'}"
            except OSError:
                if self.proc.poll() is not None:
                    break
                time.sleep(0.2)
        raise RuntimeError(f"code-server did not start: {(self.root / 'code-server.log').read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc is None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.time() + wait
            while time.time() < deadline:
                try:
                    os.killpg(self.proc.pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.1)
            else:
                continue
            break
        self.proc.wait(timeout=5)


@pytest.fixture
def code_server(tmp_path):
    env = read_env()
    run = tmp_path / "vsc"
    server = CodeServer(run, env["CS_BIN"], env["NODE24"])
    ws = run / "ws"
    (ws / "nan_prog.py").write_text(PROGRAM)
    (ws / "nan_model.py").write_text(MODEL_PROGRAM)
    # the program is the file open in the editor
    (ws / ".vscode" / "launch.json").write_text(json.dumps({"version": "0.2.0", "configurations": [{
        "type": "mldebug", "request": "launch", "name": "mldebug: this file",
        "program": "${file}", "breakOn": ["nan"], "python": sys.executable,
    }]}, indent=2))
    (run / "ud" / "User" / "settings.json").write_text(json.dumps(USER_SETTINGS, indent=2))
    t0 = time.time()
    server.install(fresh_vsix(Path(env["VSIX"])))
    server.timings = {"install_extension_s": round(time.time() - t0, 1)}
    try:
        yield server
    finally:
        server.stop()
        last = E2E / "last-run"
        shutil.rmtree(last, ignore_errors=True)
        last.mkdir(parents=True)
        for name in ("code-server.log", "shot-stopped.png", "shot-graph.png", "shot-end.png", "console.log",
                     "timings.json"):
            if (run / name).exists():
                shutil.copy(run / name, last / name)


def nudge(page) -> None:
    """Headless webviews may stall until a frame is rendered: ask for one."""
    try:
        page.evaluate("() => new Promise(r => { requestAnimationFrame(() => r(1)); setTimeout(() => r(0), 500); })")
    except Exception:  # noqa: BLE001 - the page may be busy navigating
        pass


def poll(page, what: str, probe, timeout: float = 60.0):
    """Call PROBE until it returns something truthy, nudging the page; fail naming WHAT."""
    deadline, last = time.time() + timeout, None
    while time.time() < deadline:
        try:
            value = probe()
            if value:
                return value
            last = value
        except Exception as exc:  # noqa: BLE001 - frames come and go while the panel loads
            last = f"{type(exc).__name__}: {str(exc)[:160]}"
        nudge(page)
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; last seen: {last!r}")


def palette_labels(page) -> list[str]:
    """The command palette's rendered rows, by their aria-label (the command's name first)."""
    rows = page.locator(".quick-input-list .monaco-list-row")
    return [rows.nth(i).get_attribute("aria-label", timeout=2_000) or "" for i in range(rows.count())]


def start_debugging(page, tries: int = 3) -> None:
    """Command palette, "Debug: Start Debugging": the exact row, as the fuzzy first row is
    "Debug: Select and Start Debugging".

    The query is filled in, not typed, so that no keystroke can land in the editor before the
    palette has focus; and the rows are polled, because on a loaded machine the list shows
    every command (alphabetical, virtualized: not this one) until the filter catches up."""
    seen: list[str] = []
    for _ in range(tries):
        page.locator(".monaco-editor .view-lines").first.click()
        page.keyboard.press("F1")
        box = page.locator(".quick-input-widget input")
        box.wait_for(timeout=15_000)
        box.fill(">Debug: Start Debugging")
        deadline = time.time() + 15
        while time.time() < deadline:
            try:
                seen = palette_labels(page)
                for i, label in enumerate(seen):
                    if label.split(",")[0].strip() == "Debug: Start Debugging":
                        page.locator(".quick-input-list .monaco-list-row").nth(i).click(timeout=5_000)
                        return
            except Exception as exc:  # noqa: BLE001 - rows are re-rendered while the filter runs
                seen = [f"{type(exc).__name__}: {str(exc)[:120]}"]
            time.sleep(0.3)
        page.keyboard.press("Escape")      # close it and open it again
    raise AssertionError(f"'Debug: Start Debugging' is not in the command palette; rows seen: {seen[:8]}")


def test_nan_stop_shows_in_the_tensors_panel_and_continue_finishes(code_server):
    sync_api = pytest.importorskip("playwright.sync_api")
    marks: dict[str, float] = {}
    t0 = time.time()

    def mark(name: str) -> None:
        marks[name] = round(time.time() - t0, 1)

    url = code_server.start()
    mark("code_server_up")
    here = marker_line(PROGRAM)
    run = code_server.root
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        try:
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector(".monaco-workbench", timeout=60_000)
            page.wait_for_selector(".explorer-folders-view .monaco-list-row", timeout=60_000)
            page.wait_for_selector("#workbench\\.parts\\.statusbar", timeout=60_000)
            page.locator(".explorer-folders-view .monaco-list-row", has_text="nan_prog.py").first.click()
            page.wait_for_selector(".monaco-editor .view-lines", timeout=30_000)
            mark("workbench_ready")

            time.sleep(2)          # let the extension host settle, as the recipe does
            start_debugging(page)
            page.wait_for_selector(".debug-toolbar", timeout=60_000)
            # Paused: the toolbar offers Continue (while running it offers Pause).
            page.wait_for_selector(".debug-toolbar .codicon-debug-continue", timeout=90_000)
            mark("stopped")
            page.keyboard.press("Control+Shift+D")      # the Run and Debug view: call stack

            # The top frame of the call stack is the user's line ("<module> nan_prog.py 5:7").
            frame_row = poll(page, "the call stack's top frame", lambda: page.locator(
                ".debug-call-stack .monaco-list-row", has_text="nan_prog.py").first.inner_text(timeout=2_000))
            assert f"{here}:" in frame_row, frame_row

            panel = page.frame_locator("iframe.webview.ready").frame_locator("#active-frame")
            title = poll(page, "the stop banner", lambda: (
                t if (t := panel.locator("#banner-title").inner_text(timeout=2_000)).startswith("Stopped") else None))
            detail = panel.locator("#banner-detail").inner_text(timeout=5_000)
            mark("banner_shown")
            assert title == "Stopped: NaN", title
            assert "aten.sub" in detail and f"nan_prog.py:{here}" in detail, detail

            line_x = poll(page, "x in the tensor list", lambda: panel.locator(
                "#tensor-list li[data-name='x'] .tensor-line").inner_text(timeout=2_000))
            assert line_x.startswith("tensor[2]") and "-Inf" in line_x, line_x
            mark("tensors_listed")

            # A click shows the heatmap of w (evaluated in the paused frame).
            panel.locator("#tensor-list li[data-name='w'] button").click()
            poll(page, "the heatmap of w", lambda: panel.locator("#detail-name").inner_text(timeout=2_000) == "w")
            assert panel.locator("#heatmap").evaluate("c => [c.width, c.height]") == [4, 3]
            mark("heatmap_shown")

            # "Inspect in mldebug" on x in the Variables view: its -Inf cells in their colour.
            page.locator(".debug-variables .monaco-list-row", has_text="Locals").first.click()
            row_x = page.locator(".debug-variables .monaco-list-row", has_text="x =").first
            row_x.wait_for(timeout=15_000)
            row_x.click(button="right")
            item = page.locator(".monaco-menu .action-item", has_text="Inspect in mldebug").first
            item.hover(timeout=15_000)        # focuses the item; Enter runs it (a click may not)
            page.keyboard.press("Enter")
            poll(page, "the heatmap of x", lambda: panel.locator("#detail-name").inner_text(timeout=2_000) == "x")
            assert panel.locator("#heatmap").evaluate(
                "c => Array.from(c.getContext('2d').getImageData(0, 0, 1, 1).data.slice(0, 3))") == [0, 230, 255]
            mark("inspect_variable_shown")
            page.screenshot(path=str(run / "shot-stopped.png"))

            # Continue (F5 in the workbench) and the program finishes.
            page.locator(".monaco-editor .view-lines").first.click()
            page.keyboard.press("F5")
            page.wait_for_selector(".debug-toolbar", state="hidden", timeout=60_000)
            mark("session_ended")
            output = poll(page, "the program's output in the debug console",
                          lambda: "finished" in (t := page.locator(".repl").first.inner_text(timeout=2_000)) and t)
            assert "finished [nan, nan]" in output, output
            ended = poll(page, "the panel saying the session ended", lambda: (
                t if (t := panel.locator("#banner-title").inner_text(timeout=2_000)) == "Session ended" else None))
            assert ended == "Session ended"
            page.screenshot(path=str(run / "shot-end.png"))
        except BaseException:
            try:
                page.screenshot(path=str(run / "shot-end.png"))
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            mark("done")
            (run / "console.log").write_text("\n".join(console))
            (run / "timings.json").write_text(json.dumps({**code_server.timings, **marks}, indent=1))
            print("e2e timings:", {**code_server.timings, **marks})
            browser.close()


def graph_click(panel, x: float, y: float) -> None:
    """Click data point (X, Y) of the panel's graph figure, placed by BokehJS's own scales."""
    host = panel.locator(".mld-panel-graph").first
    sx, sy = host.evaluate("""(el, [x, y]) => {
        const v = Bokeh.index.roots.filter(r => r.model.type === 'Figure').pop();
        return [v.frame.x_scale.compute(x), v.frame.y_scale.compute(y)]; }""", [x, y])
    host.click(position={"x": sx, "y": sy})


def test_nan_in_a_module_the_panel_draws_the_graph_marks_it_and_a_click_shows_its_output(code_server):
    sync_api = pytest.importorskip("playwright.sync_api")
    marks: dict[str, float] = {}
    t0 = time.time()

    def mark(name: str) -> None:
        marks[name] = round(time.time() - t0, 1)

    url = code_server.start()
    run = code_server.root
    here = marker_line(MODEL_PROGRAM)
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        console: list[str] = []
        page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
        try:
            page.goto(url, wait_until="domcontentloaded", timeout=60_000)
            page.wait_for_selector(".explorer-folders-view .monaco-list-row", timeout=60_000)
            page.wait_for_selector("#workbench\\.parts\\.statusbar", timeout=60_000)
            page.locator(".explorer-folders-view .monaco-list-row", has_text="nan_model.py").first.click()
            page.wait_for_selector(".monaco-editor .view-lines", timeout=30_000)
            time.sleep(2)
            start_debugging(page)
            page.wait_for_selector(".debug-toolbar .codicon-debug-continue", timeout=90_000)
            mark("stopped")

            panel = page.frame_locator("iframe.webview.ready").frame_locator("#active-frame")
            detail = poll(page, "the stop banner naming the module", lambda: (
                t if "module head" in (t := panel.locator("#banner-detail").inner_text(timeout=2_000)) else None))
            assert f"nan_model.py:{here}" in detail, detail

            # the graph: drawn by BokehJS (loaded from the program's bokeh), the head row marked
            poll(page, "the graph drawn", lambda: panel.locator("#graph[data-drawn='4']").count() == 1, timeout=90)
            mark("graph_drawn")
            assert panel.locator("#graph-marked").inner_text(timeout=5_000) == "marked: head#0"
            labels = panel.locator("#graph").evaluate("""() => Array.from(Bokeh.documents.at(-1)
                .get_model_by_name('mld-graph-nodes').data.label)""")
            assert labels[0].startswith("(root) (Net)"), labels
            assert labels[3] == "head (Head) [2, 3] f32 NaN/Inf!", labels
            colours = panel.locator("#graph").evaluate("""() => Array.from(Bokeh.documents.at(-1)
                .get_model_by_name('mld-graph-nodes').data.color)""")
            assert colours[3] == "#ff6b6b" and colours[1] != "#ff6b6b", colours

            # a click on the marked row shows that module's output, evaluated in the paused frame
            graph_click(panel, 1.2 + 1.5, 3)
            poll(page, "head's output", lambda: panel.locator("#detail-name").inner_text(timeout=2_000) == "head output")
            assert panel.locator("#heatmap").evaluate("c => [c.width, c.height]") == [3, 2]
            assert panel.locator("#heatmap").evaluate(
                "c => Array.from(c.getContext('2d').getImageData(0, 0, 1, 1).data.slice(0, 3))") == [255, 0, 255]
            mark("node_output_shown")

            # a click on the root's toggle closes it: Python draws the graph again, one row
            time.sleep(0.6)      # apart from the first click by more than BokehJS's double tap
            graph_click(panel, 0.45, 0)
            poll(page, "the graph with the root closed", lambda: panel.locator("#graph").evaluate(
                """() => { const d = Bokeh.documents.at(-1);
                    return d && d.get_model_by_name('mld-graph-nodes').data.id.length === 1; }"""))
            mark("root_closed")
            page.screenshot(path=str(run / "shot-graph.png"))
            errors = [line for line in console if "Content Security Policy" in line or "Bokeh" in line]
            assert errors == [], errors

            page.locator(".monaco-editor .view-lines").first.click()
            page.keyboard.press("F5")
            page.wait_for_selector(".debug-toolbar", state="hidden", timeout=60_000)
            mark("session_ended")
        except BaseException:
            try:
                page.screenshot(path=str(run / "shot-end.png"))
            except Exception:  # noqa: BLE001
                pass
            raise
        finally:
            mark("done")
            (run / "console.log").write_text("\n".join(console))
            (run / "timings.json").write_text(json.dumps({**code_server.timings, **marks}, indent=1))
            print("e2e timings:", {**code_server.timings, **marks})
            browser.close()
