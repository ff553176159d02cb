"""The VS Code Tensors panel page (vscode-extension/media/panel.html + out/webview.js) in
headless Chromium, outside VS Code: `acquireVsCodeApi` is stubbed, the page is served with
its real Content-Security-Policy, and recorded panel-API messages are posted to it (a stop,
a frame's tensors, a tensor slice with NaN and +/-Inf, the graph of a pass), as the extension
does. The graph is drawn by the installed bokeh's own BokehJS, served as the webview serves it.

Needs Debian's /usr/bin/chromium and the extension's node_modules (`npm ci` in
vscode-extension, or scripts/setup_vscode_e2e.sh); the page is rebuilt when out/ is stale.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import CHROMIUM, CHROMIUM_ARGS, headless_chromium  # noqa: F401

REPO = Path(__file__).resolve().parents[2]
EXT = REPO / "vscode-extension"
FIXTURES = EXT / "test" / "fixtures"
ORIGIN = "https://mldebug-panel.test"
NONCE = "dGVzdC1ub25jZQ=="

# Colours of webview/heatmap.ts NONFINITE_COLOURS.
NAN_RGB, POSINF_RGB, NEGINF_RGB = (255, 0, 255), (255, 40, 40), (0, 230, 255)

# acquireVsCodeApi as VS Code provides it, keeping the state in sessionStorage so that a
# reload of the page sees what it saved (as a webview that is hidden and shown again does).
VSCODE_STUB = """
window.__posted = [];
window.acquireVsCodeApi = () => ({
  postMessage: (m) => window.__posted.push(JSON.parse(JSON.stringify(m))),
  getState: () => JSON.parse(sessionStorage.getItem('vscodeState') || 'null') || undefined,
  setState: (s) => sessionStorage.setItem('vscodeState', JSON.stringify(s)),
});
"""

pytestmark = [
    pytest.mark.skipif(not Path(CHROMIUM).exists(),
                       reason=f"{CHROMIUM} missing: apt-get install chromium (scripts/setup_vscode_e2e.sh does)"),
    pytest.mark.skipif(not (EXT / "node_modules" / "esbuild").exists() and not (EXT / "out" / "webview.js").exists(),
                       reason="vscode-extension not built: run `npm ci` there (or scripts/setup_vscode_e2e.sh)"),
]


def fixture(name: str) -> dict:
    return json.loads((FIXTURES / name).read_text())


def _build_if_stale() -> None:
    out = EXT / "out" / "webview.js"
    sources = list((EXT / "src").rglob("*.ts"))
    if (EXT / "node_modules" / "esbuild").exists() and (
            not out.exists() or max(p.stat().st_mtime for p in sources) > out.stat().st_mtime):
        subprocess.run([shutil.which("node") or "node", "esbuild.mjs"], cwd=EXT, check=True, timeout=120)


def _page_html() -> str:
    """The page as panel.ts builds it once a graph came: BokehJS's script tags (the files of the
    installed bokeh, served here from BOKEH_ORIGIN as the webview serves them from its root)."""
    template = (EXT / "media" / "panel.html").read_text()
    bokeh = "\n".join(f'<script nonce="{NONCE}" src="{ORIGIN}/bokeh/{Path(f).name}"></script>'
                      for f in _bokeh_js())
    values = {"cspSource": ORIGIN, "nonce": NONCE, "scriptUri": f"{ORIGIN}/out/webview.js",
              "styleUri": f"{ORIGIN}/media/panel.css", "bokehScripts": bokeh}
    for key, value in values.items():
        template = template.replace("{{%s}}" % key, value)
    return template


def _bokeh_js() -> list[str]:
    from mldebug.dap.panel import bokeh_files
    return bokeh_files()["js"]


@pytest.fixture(scope="module")
def browser():
    _build_if_stale()
    with headless_chromium() as b:
        yield b


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1000, "height": 900})
    page = context.new_page()
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.add_init_script(VSCODE_STUB)

    def serve(route):
        path = route.request.url[len(ORIGIN):].split("?")[0]
        if path in ("/", "/panel.html"):
            return route.fulfill(status=200, content_type="text/html", body=_page_html())
        file = EXT / path.lstrip("/")
        if path.startswith("/bokeh/"):
            file = next((Path(f) for f in _bokeh_js() if Path(f).name == path[len("/bokeh/"):]), EXT)
        if path.startswith(("/out/", "/media/", "/bokeh/")) and file.is_file():
            kind = "text/css" if file.suffix == ".css" else "text/javascript"
            return route.fulfill(status=200, content_type=kind, body=file.read_text())
        return route.fulfill(status=404, body="")

    page.route(f"{ORIGIN}/**", serve)
    page.goto(f"{ORIGIN}/panel.html")
    page.wait_for_function("window.__posted.length > 0")
    page.errors = errors
    yield page
    context.close()


def post(page, message: dict) -> None:
    page.evaluate("m => window.postMessage(m, '*')", message)


def posted(page) -> list[dict]:
    return page.evaluate("window.__posted")


def pixel(page, x: int, y: int) -> tuple[int, int, int]:
    return tuple(page.evaluate(
        "([x, y]) => Array.from(document.getElementById('heatmap').getContext('2d').getImageData(x, y, 1, 1).data.slice(0, 3))",
        [x, y]))


STOP = {"command": "stop", "stop": fixture("stop.json")["stop"],
        "pause": {"reason": "exception", "file": "/ws/nan_prog.py", "line": 6}}
TENSORS = {"command": "tensors", "tensors": fixture("frame.json")["tensors"]}
SLICE = {"command": "tensor", "slice": fixture("tensor_nan.json"), "request": {"expr": "w"}}


def test_page_says_ready_and_shows_not_paused(page):
    assert posted(page) == [{"command": "ready"}]
    assert page.inner_text("#banner-title") == "Not paused"
    assert page.errors == []


def test_stop_message_fills_the_banner(page):
    post(page, STOP)
    page.wait_for_function("document.getElementById('banner-title').textContent.startsWith('Stopped')")
    assert page.inner_text("#banner-title") == "Stopped: NaN"
    detail = page.inner_text("#banner-detail")
    for part in ("op aten.sub.Tensor", "module model.head", "nan_prog.py:6", "stage forward"):
        assert part in detail
    assert "stop" in page.get_attribute("#banner", "class")


def test_plain_breakpoint_says_paused(page):
    post(page, {"command": "stop", "stop": None,
                "pause": {"reason": "breakpoint", "file": "/ws/a.py", "line": 3, "function": "step"}})
    page.wait_for_function("document.getElementById('banner-title').textContent === 'Paused'")
    assert page.inner_text("#banner-detail") == "a.py:3 in step"


def test_tensors_message_lists_them_with_summaries_and_histograms(page):
    post(page, STOP)
    post(page, TENSORS)
    page.wait_for_selector("#tensor-list li")
    names = page.eval_on_selector_all("#tensor-list .tensor-name", "els => els.map(e => e.textContent)")
    assert names == ["w", "x", "y"]
    assert page.inner_text("#tensor-list li[data-name='w'] .tensor-line").startswith("tensor[4, 6] f32")
    assert page.inner_text("#tensor-list li[data-name='y'] .badge.nan") == "NaN\u00d72"
    hist = TENSORS["tensors"][0]["summary"]["hist"]
    assert page.locator("#tensor-list li[data-name='w'] svg.hist rect").count() == sum(1 for c in hist if c > 0)
    assert page.is_hidden("#tensor-empty")


def test_click_requests_the_tensor_and_the_heatmap_shows_nan_in_its_colour(page):
    post(page, STOP)
    post(page, TENSORS)
    page.click("#tensor-list li[data-name='w'] button")
    assert posted(page)[-1] == {"command": "requestTensor", "request": {"expr": "w"}}
    post(page, SLICE)
    page.wait_for_selector("#detail:not([hidden])")
    assert page.inner_text("#detail-name") == "w"
    assert page.eval_on_selector("#heatmap", "c => [c.width, c.height]") == [6, 4]
    colours = {pixel(page, x, y) for x in range(6) for y in range(4)}
    assert len(colours) > 10, "heatmap is blank or flat"
    assert pixel(page, 2, 1) == NAN_RGB            # nonfinite [1, 2, "nan"]
    assert pixel(page, 3, 2) == POSINF_RGB         # [2, 3, "inf"]
    assert pixel(page, 0, 3) == NEGINF_RGB         # [3, 0, "-inf"]
    assert pixel(page, 0, 0) not in (NAN_RGB, POSINF_RGB, NEGINF_RGB)
    legend = page.inner_text("#legend")
    assert "NaN" in legend and "+Inf" in legend and "-Inf" in legend
    assert page.locator("#detail-hist svg rect").count() == sum(1 for c in SLICE["slice"]["hist"]["counts"] if c > 0)
    assert page.inner_text("#detail-summary") == TENSORS["tensors"][0]["line"]
    assert page.errors == []


def test_hover_shows_index_and_value(page):
    post(page, SLICE)
    page.wait_for_selector("#detail:not([hidden])")
    box = page.locator("#heatmap").bounding_box()
    page.mouse.move(box["x"] + box["width"] * 2.5 / 6, box["y"] + box["height"] * 1.5 / 4)
    assert page.inner_text("#hover") == "w[1, 2] = NaN"
    page.mouse.move(box["x"] + box["width"] * 0.5 / 6, box["y"] + box["height"] * 0.5 / 4)
    assert page.inner_text("#hover") == "w[0, 0] = -1"


def test_dim_selectors_sliders_and_gradient_toggle_request_new_slices(page):
    three_d = dict(fixture("tensor_nan.json"), name="v", shape=[5, 4, 6], dims=[1, 2], index=[2, None, None])
    post(page, {"command": "tensor", "slice": three_d, "request": {"expr": "v", "dims": [1, 2], "index": [2, 0, 0]}})
    page.wait_for_selector("#dim-rows")
    assert page.eval_on_selector("#dim-rows", "s => s.value") == "1"
    slider = page.locator("#dim-controls input[type=range]")
    assert slider.count() == 1 and slider.get_attribute("data-dim") == "0"
    slider.fill("4")
    assert posted(page)[-1] == {"command": "requestTensor",
                                "request": {"expr": "v", "dims": [1, 2], "index": [4, 0, 0]}}
    page.select_option("#dim-cols", "0")
    assert posted(page)[-1]["request"]["dims"] == [1, 0]
    page.check("#grad-toggle")
    assert posted(page)[-1]["request"]["grad"] is True


def test_image_view_when_the_slice_has_an_image(page):
    # a 2x1 PNG (red, green)
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAIAAAABCAIAAAB7QOjdAAAAEElEQVR4nGP4z8DAwMDAAAAPAQH/mGk5AAAAAElFTkSuQmCC")
    post(page, {"command": "tensor", "request": {"expr": "w"},
                "slice": dict(fixture("tensor_nan.json"), image={"width": 2, "height": 1, "png_base64": png})})
    page.wait_for_selector("#image-view:not([hidden])")
    page.wait_for_function("document.getElementById('image').complete")
    assert page.eval_on_selector("#image", "i => i.naturalWidth") == 2
    assert page.errors == []


def test_state_survives_a_reload(page):
    post(page, STOP)
    post(page, TENSORS)
    post(page, SLICE)
    page.wait_for_selector("#detail:not([hidden])")
    page.reload()
    page.wait_for_function("window.__posted.length > 0")
    assert page.inner_text("#banner-title") == "Stopped: NaN"
    assert page.locator("#tensor-list li").count() == 3
    assert pixel(page, 2, 1) == NAN_RGB


def test_running_and_ended(page):
    post(page, STOP)
    post(page, TENSORS)
    post(page, {"command": "running"})
    page.wait_for_function("document.getElementById('banner-title').textContent.startsWith('Running')")
    post(page, {"command": "ended"})
    page.wait_for_function("document.getElementById('banner-title').textContent === 'Session ended'")
    assert page.locator("#tensor-list li").count() == 0


# -- the graph: the view's figure (dap/panel.py graph_json), drawn by the installed BokehJS ----
@pytest.fixture(scope="module")
def graph_answers():
    """graph_json() and node_tensor_json() of a model whose `head` made a NaN, as the
    extension receives them."""
    import torch
    from torch import nn

    from mldebug import graph as G
    from mldebug.dap import panel

    class Head(nn.Module):
        def forward(self, h):
            return torch.log(h - 10.0)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.act, self.head = nn.Linear(4, 3), nn.ReLU(), Head()

        def forward(self, x):
            return self.head(self.act(self.fc(x)))

    torch.manual_seed(0)
    with G.Capture():
        out = Net()(torch.randn(2, 4))
        G.last_graph().mark("head", "nan")
        answers = {"graph": json.loads(panel.graph_json()),
                   "closed": json.loads(panel.graph_json([], mark=False)),
                   "head": json.loads(panel.node_tensor_json("head#0"))}
    del out
    return answers


def graph_point(page, x: float, y: float) -> tuple[float, float]:
    """Page coordinates of data point (X, Y) of the drawn graph figure (BokehJS's scales)."""
    page.locator("#graph").scroll_into_view_if_needed()
    return tuple(page.evaluate("""([x, y]) => {
        const v = Bokeh.index.roots.filter(r => r.model.type === 'Figure').pop();
        const box = v.el.getBoundingClientRect();
        return [box.left + v.frame.x_scale.compute(x), box.top + v.frame.y_scale.compute(y)]; }""",
                               [x, y]))


def red_pixels(page) -> int:
    return page.locator(".mld-panel-graph canvas").first.evaluate(
        """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 0; i < d.length; i += 4)
        if (d[i] === 255 && d[i+1] === 107 && d[i+2] === 107) n++; return n; }""")


def test_graph_draws_the_marked_module_and_clicks_ask_for_its_output_and_toggles(page, graph_answers):
    post(page, STOP)
    post(page, {"command": "graph", **graph_answers["graph"]})
    page.wait_for_selector("#graph[data-drawn='4']")
    assert page.inner_text("#graph-note") == "4 module calls"
    assert page.inner_text("#graph-marked") == "marked: head#0"
    labels = page.evaluate("""() => Array.from(Bokeh.documents.at(-1)
        .get_model_by_name('mld-graph-nodes').data.label)""")
    assert labels[0] == "(root) (Net) [2, 3] f32" and labels[3] == "head (Head) [2, 3] f32 NaN/Inf!"
    page.wait_for_function("() => document.querySelector('.mld-panel-graph') !== null")
    deadline = time.monotonic() + 10
    while red_pixels(page) < 50:           # the head row in the NaN colour of the view
        assert time.monotonic() < deadline, "the marked row is not drawn in its colour"
        page.wait_for_timeout(100)

    # a click on the head row (depth 1, row 3): the TapTool selects it, the page asks for it
    page.mouse.click(*graph_point(page, 1.2 + 1.5, 3))
    page.wait_for_function("() => window.__posted.at(-1).command === 'requestTensor'")
    assert posted(page)[-1] == {"command": "requestTensor", "request": {"expr": "head", "node": "head#0"}}
    post(page, {"command": "tensor", "slice": graph_answers["head"], "request": posted(page)[-1]["request"]})
    page.wait_for_function("() => document.getElementById('detail-name').textContent === 'head output'")
    assert page.eval_on_selector("#heatmap", "c => [c.width, c.height]") == [3, 2]
    assert pixel(page, 0, 0) == NAN_RGB               # every cell of head's output is NaN
    # the gradient toggle asks for the node's gradient, still by its id
    page.check("#grad-toggle")
    assert posted(page)[-1]["request"] == {"expr": "head", "node": "head#0", "dims": [0, 1],
                                           "index": [None, None], "grad": True}

    # a click on the root's toggle asks for the graph with the root closed ... (apart from
    # the first click by more than BokehJS's double-tap interval, or it is a double tap)
    page.wait_for_timeout(600)
    page.mouse.click(*graph_point(page, 0.45, 0))
    page.wait_for_function("() => window.__posted.at(-1).command === 'requestGraph'")
    assert posted(page)[-1] == {"command": "requestGraph", "expanded": []}
    # ... and the answer, drawn again, has the one row
    post(page, {"command": "graph", **graph_answers["closed"]})
    page.wait_for_function("""() => { const d = Bokeh.documents.at(-1);
        return d && d.get_model_by_name('mld-graph-nodes').data.id.length === 1; }""")
    assert page.evaluate("Bokeh.documents.length") == 1       # the old document is dropped
    assert page.locator(".mld-panel-graph").count() == 1     # the old figure is gone
    assert page.errors == []


def test_graph_state_survives_a_reload_and_ended_clears_it(page, graph_answers):
    post(page, {"command": "graph", **graph_answers["graph"]})
    page.wait_for_selector("#graph[data-drawn='4']")
    page.reload()
    page.wait_for_function("() => window.__posted.length > 0")
    page.wait_for_selector("#graph[data-drawn='4']")
    post(page, {"command": "ended"})
    page.wait_for_function("() => !document.querySelector('#graph[data-drawn]')")
    assert page.is_hidden("#graph-section")
    assert page.errors == []


def test_no_graph_says_why_and_a_missing_bokehjs_is_named(page, graph_answers):
    post(page, {"command": "graph", "graph": None, "note": "No forward pass seen yet."})
    page.wait_for_selector("#graph-section:not([hidden])")
    assert page.inner_text("#graph-note") == "No forward pass seen yet."
    page.evaluate("delete window.Bokeh")
    post(page, {"command": "graph", **graph_answers["graph"]})
    page.wait_for_function("() => document.getElementById('graph-note').textContent.includes('BokehJS did not load')")
    assert "bokeh.min.js" in page.inner_text("#graph-note")
