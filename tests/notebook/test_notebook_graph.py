"""`mldebug.trace(model, x)` in a notebook: the browser view's graph figure through
Bokeh's notebook output, BokehJS inline (no CDN). Its outputs, put on a page as a
notebook front end runs them, draw in headless Chromium with the network cut off."""
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


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    nb = run_notebook(["%load_ext mldebug", MODEL, "graph"],
                      tmp_path_factory.mktemp("g"), allow_errors=False)
    return nb.cells[1].outputs, nb.cells[2].outputs


def doc_json(exec_js: str) -> dict:
    return json.loads(re.search(r"const docs_json = (\{.*?\});\n", exec_js).group(1))


def labels_of(exec_js: str) -> list:
    text = json.dumps(doc_json(exec_js))
    return json.loads(re.search(r'\["label", (\[.*?\])\]', text).group(1))


def test_the_graph_is_bokehs_notebook_output_with_inline_resources(outputs):
    first, second = outputs
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


def test_the_inline_graph_draws_offline_in_chromium(outputs, tmp_path):
    load, div, run = outputs[0]
    page_file = tmp_path / "graph.html"
    page_file.write_text(
        "<!doctype html><html><head><meta charset='utf-8'></head><body>"
        f"<script>{load.data['application/javascript']}</script>"
        f"{div.data['text/html']}<script>{run.data['application/javascript']}</script>"
        "</body></html>")
    with headless_chromium() as browser:
        page = browser.new_page(viewport={"width": 900, "height": 600})
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
        page.goto(page_file.as_uri())
        canvas = page.locator(".mld-graph canvas").first
        red_js = """c => { const d = c.getContext('2d').getImageData(0, 0,
            c.width, c.height).data; let n = 0; for (let i = 0; i < d.length; i += 4)
            if (d[i] === 255 && d[i+1] === 107 && d[i+2] === 107) n++; return n; }"""
        deadline = time.monotonic() + 30
        while True:
            try:
                if canvas.count() and canvas.evaluate(red_js) > 50:
                    break     # the Explode row, in the non-finite colour
            except Exception:  # noqa: BLE001 - the canvas is not there yet
                pass
            assert time.monotonic() < deadline, (errors, requests)
            page.wait_for_timeout(100)
        labels = page.evaluate("""() => Array.from(Bokeh.documents[0]
            .get_model_by_name('mld-graph-nodes').data.label)""")
        assert "0 (Linear) [2, 8] f32" in labels
    assert errors == [] and requests == []
