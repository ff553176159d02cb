"""`mldebug.trace(model, x)` and a recording in a notebook: the browser view's graph
figure and Timeline plots through Bokeh's notebook output, BokehJS inline (no CDN).
Their outputs, put on a page as a notebook front end runs them, draw in headless
Chromium with the network cut off."""
from __future__ import annotations

import json
import re
import time

import pytest

from conftest import headless_chromium
from test_notebook_kernel import run_notebook

MODEL = """\
import torch, mldebug

class Explode(torch.nn.Module):
    def forward(self, x):
        return torch.log(-x.abs() - 1)      # NaN everywhere

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), Explode())
graph = mldebug.trace(model, torch.randn(2, 4))
graph
"""

RECORD = """\
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = torch.optim.SGD(net.parameters(), lr=0.1)
x, y = torch.randn(32, 4), torch.randn(32, 1)
with mldebug.record(net, run_dir="runs", run="tiny") as rec:
    for _ in range(6):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        mldebug.log_scalar("loss", loss)
rec
"""


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    nb = run_notebook(["%load_ext mldebug", MODEL, "graph", RECORD,
                       "mldebug.record.open_run('runs/tiny.sqlite')"],
                      tmp_path_factory.mktemp("g"), allow_errors=False)
    return [cell.outputs for cell in nb.cells[1:]]


def doc_json(exec_js: str) -> dict:
    return json.loads(re.search(r"const docs_json = (\{.*?\});\n", exec_js).group(1))


def labels_of(exec_js: str) -> list:
    text = json.dumps(doc_json(exec_js))
    return json.loads(re.search(r'\["label", (\[.*?\])\]', text).group(1))


def test_the_graph_is_bokehs_notebook_output_with_inline_resources(outputs):
    first, second = outputs[:2]
    load, div, run = first
    assert "application/vnd.bokehjs_load.v0+json" in load.data
    assert len(load.data["application/javascript"]) > 1_000_000   # BokehJS itself, inline
    assert "cdn.bokeh.org" not in json.dumps([o for o in first])
    assert re.search(r"js_urls = \[\];", load.data["application/javascript"])
    assert "data-root-id" in div.data["text/html"]
    assert "application/vnd.bokehjs_exec.v0+json" in run.data
    labels = labels_of(run.data["application/javascript"])
    assert labels[0].startswith("(root) (Sequential)")
    assert "0 (Linear) [2, 8] f32" in labels and "1 (ReLU) [2, 8] f32" in labels
    assert any(re.fullmatch(r"2 \(Explode\).* NaN/Inf!", x) for x in labels), labels
    # BokehJS is loaded once a kernel: a second display runs only the document
    assert [sorted(o.data) for o in second] == [["text/html"], sorted(run.data)]


def model_of(exec_js: str, name: str) -> dict:
    """The attributes of the model called NAME in a display's document."""
    found = []

    def walk(node):
        if isinstance(node, dict):
            if node.get("attributes", {}).get("name") == name:
                found.append(node["attributes"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)
    walk(doc_json(exec_js))
    return found[0]


def test_a_recording_shows_its_timeline_from_the_recorder_and_from_its_file(outputs):
    for cell in outputs[2:]:
        (div, run) = cell                    # BokehJS is in the kernel already
        js = run.data["application/javascript"]
        kpi = dict(model_of(js, "mld-tl-kpi-a")["data"]["entries"])
        assert kpi["value"]["shape"] == [6] and kpi["step"]["shape"] == [6]
        image = dict(model_of(js, "mld-tl-hist-a")["data"]["entries"])
        assert len(image["image"]) == 1       # the histograms over steps, one image
        assert "KPI: loss" in js and "tiny" in js


def page_of(outputs, tmp_path, name: str):
    """A page that runs the BokehJS load, then the display's div and its script."""
    load = outputs[0][0]
    div, run = outputs[0][1:] if name == "graph" else outputs[2]
    page_file = tmp_path / f"{name}.html"
    page_file.write_text(
        "<!doctype html><html><head><meta charset='utf-8'></head><body>"
        f"<script>{load.data['application/javascript']}</script>"
        f"{div.data['text/html']}<script>{run.data['application/javascript']}</script>"
        "</body></html>")
    return page_file.as_uri()


RED_JS = """c => { const d = c.getContext('2d').getImageData(0, 0,
    c.width, c.height).data; let n = 0; for (let i = 0; i < d.length; i += 4)
    if (d[i] === 255 && d[i+1] === 107 && d[i+2] === 107) n++; return n; }"""


def test_the_inline_graph_and_timeline_draw_offline_in_chromium(outputs, tmp_path):
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 1100, "height": 900})
        requests, errors = [], []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))

        def offline(route):
            if route.request.url.startswith("file:"):
                route.continue_()
            else:
                requests.append(route.request.url)
                route.abort()
        page.route("**/*", offline)

        def wait(check):
            deadline = time.monotonic() + 30
            while True:
                try:
                    if check():
                        return
                except Exception:  # noqa: BLE001 - not drawn yet
                    pass
                assert time.monotonic() < deadline, (errors, requests)
                page.wait_for_timeout(100)

        page.goto(page_of(outputs, tmp_path, "graph"))
        canvas = page.locator(".mld-graph canvas").first
        wait(lambda: canvas.count() and canvas.evaluate(RED_JS) > 50)   # the NaN module
        labels = page.evaluate("""() => Array.from(Bokeh.documents[0]
            .get_model_by_name('mld-graph-nodes').data.label)""")
        assert "0 (Linear) [2, 8] f32" in labels

        page.goto(page_of(outputs, tmp_path, "timeline"))
        wait(lambda: page.locator(".mld-tl-kpi-fig canvas").count()
             and page.locator(".mld-tl-hist-a canvas").count())
        steps = page.evaluate("""() => Bokeh.documents[0]
            .get_model_by_name('mld-tl-kpi-a').data.value.length""")
        assert steps == 6
    assert errors == [] and requests == []
