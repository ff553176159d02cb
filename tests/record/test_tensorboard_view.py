"""An exported run as TensorBoard itself shows it: `tensorboard --logdir` serves the
event files and a headless browser finds mldebug's histograms and statistics on its
pages. With MLDEBUG_DOCS_PICTURE=1 the histogram page's screenshot replaces the picture
in docs/img/ (docs/recording.md shows it)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn

import mldebug

from conftest import REPO, clean_env, headless_chromium, run_cli

pytest.importorskip("tensorboard")
PICTURE = REPO / "docs" / "img" / "tensorboard-histograms.png"


def record_training(run_dir):
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(16, 32))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.3)
    g = torch.Generator().manual_seed(1)
    with mldebug.record(model, run_dir=run_dir, run="baseline", every=2):
        for _ in range(40):
            x = torch.randn(64, 16, generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), (x[:, 0] > 0).long())
            loss.backward()
            opt.step()
            mldebug.log_scalar("loss", loss)


def serve(cwd, logdir="tb"):
    """`tensorboard --logdir LOGDIR` in CWD on a free port of 127.0.0.1: (process, url)."""
    proc = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", logdir,
                             "--host", "127.0.0.1", "--port", "0", "--load_fast=false"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            cwd=cwd, env=clean_env())
    found = []

    def read():
        for line in proc.stderr:
            match = re.search(r"(http://127\.0\.0\.1:\d+/)", line)
            if match and not found:
                found.append(match.group(1))
    threading.Thread(target=read, daemon=True).start()
    for _ in range(600):
        if found or proc.poll() is not None:
            break
        threading.Event().wait(0.1)
    if not found:
        proc.kill()
        pytest.fail("tensorboard did not start")
    return proc, found[0]


def filter_tags(page, regex):
    """TensorBoard's own tag filter (a Polymer input: found by its element)."""
    page.locator("tf-tag-filterer input:visible").first.fill(regex)


def test_tensorboard_shows_the_exported_histograms_and_statistics(tmp_path):
    record_training(tmp_path / "runs")
    out = run_cli(["runs", "export", str(tmp_path / "runs"), "--tensorboard",
                   str(tmp_path / "tb")])
    assert out.returncode == 0, out.stderr
    proc, url = serve(tmp_path)
    try:
        with headless_chromium() as browser:
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(url + "#histograms", wait_until="networkidle")
            filter_tags(page, r"fc\d/output\[0\]/hist")
            page.get_by_text("mldebug/fc2/output[0]/hist").first.wait_for(timeout=30000)
            page.wait_for_timeout(1500)        # (the charts' transition)
            # (its pages are web components: locators see into them, inner_text not)
            for text in ("mldebug/fc1/output[0]/hist", "baseline"):
                assert page.get_by_text(text, exact=True).first.is_visible(), text
            picture = tmp_path / "histograms.png"
            page.screenshot(path=str(picture))
            assert picture.stat().st_size > 10_000
            page.goto(url + "#scalars", wait_until="networkidle")
            filter_tags(page, "kpi/loss|fc2/output_grad.0./abs_max")
            for text in ("mldebug/kpi/loss", "mldebug/fc2/output_grad[0]/abs_max"):
                page.get_by_text(text, exact=True).first.wait_for(timeout=30000)
    finally:
        proc.terminate()
        proc.wait(30)
    if os.environ.get("MLDEBUG_DOCS_PICTURE") == "1":
        PICTURE.parent.mkdir(exist_ok=True)
        PICTURE.write_bytes(picture.read_bytes())
