"""The VS Code Tensors panel page (vscode-extension/media/panel.html + out/webview.js) in
headless Chromium, outside VS Code: `acquireVsCodeApi` is stubbed, the page is served with
its real Content-Security-Policy, and recorded panel-API messages are posted to it (a stop,
a frame's tensors, a tensor slice with NaN and +/-Inf), as the extension does.

Needs Debian's /usr/bin/chromium and the extension's node_modules (`npm ci` in
vscode-extension, or scripts/setup_vscode_e2e.sh); the page is rebuilt when out/ is stale.
"""
from __future__ import annotations

import json
import shutil
import subprocess
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
    template = (EXT / "media" / "panel.html").read_text()
    values = {"cspSource": ORIGIN, "nonce": NONCE, "scriptUri": f"{ORIGIN}/out/webview.js",
              "styleUri": f"{ORIGIN}/media/panel.css"}
    for key, value in values.items():
        template = template.replace("{{%s}}" % key, value)
    return template


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
        if path.startswith(("/out/", "/media/")) and file.is_file():
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
