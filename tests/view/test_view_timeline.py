"""The browser view's Timeline tab (mldebug/view/timeline_panel.py) driven for real: two
short training runs recorded in-process (lr 0.1 and lr 10, which overflows to NaN), the
view started with `mldebug.view(0, runs=DIR)`, the page in headless Chromium; and the
histogram resampling (record/timeline.py) against numpy.
"""
from __future__ import annotations

import os
import time

import numpy as np
import pytest

from conftest import headless_chromium
from test_view import needs_chromium, wait_text, wait_until
from mldebug.record.timeline import hist_grid, resample_hist

STEPS, EVERY = 20, 2          # 20 loss points, 10 recorded steps per run


# -- resampling: pure numpy ----------------------------------------------------------------
def test_resample_onto_coarser_aligned_edges_sums_the_bins_exactly():
    rng = np.random.default_rng(0)
    x = rng.normal(size=5000)
    counts, src = np.histogram(x, bins=40, range=(-4, 4))
    got = resample_hist(-4, 4, counts, src[::4])          # every 4th source edge
    want, _ = np.histogram(x, bins=src[::4])
    np.testing.assert_array_equal(got, want)


def test_resample_onto_unaligned_edges_is_close_to_numpy_and_keeps_the_mass():
    rng = np.random.default_rng(1)
    x = rng.uniform(-1, 3, size=200_000)
    counts, _ = np.histogram(x, bins=30, range=(-1, 3))
    edges = np.linspace(-2, 4, 17)                          # wider, unaligned, coarser
    got = resample_hist(-1, 3, counts, edges)
    want, _ = np.histogram(x, bins=edges)
    assert got.sum() == pytest.approx(len(x))               # nothing lost inside the grid
    np.testing.assert_allclose(got, want, atol=0.01 * len(x) / 16 * 1.5)
    assert got[0] == 0 and got[-1] == 0                     # outside [-1, 3]: empty


def test_resample_spreads_a_bin_evenly_drops_what_is_outside_and_handles_a_constant():
    # one bin [0, 1) of 10 counts onto [0.5, 1.5]: half of it lands there
    np.testing.assert_allclose(resample_hist(0, 1, [10], [0.5, 1.5]), [5.0])
    np.testing.assert_allclose(resample_hist(0, 4, [1, 2, 3, 4], [-1, 0, 2, 4, 5]),
                               [0, 3, 7, 0])
    np.testing.assert_allclose(resample_hist(2.0, 2.0, [0, 7, 0], [0, 1, 2, 3]), [0, 0, 7])
    np.testing.assert_allclose(resample_hist(9, 9, [7], [0, 1, 2, 3]), [0, 0, 0])
    with pytest.raises(ValueError, match="edges must be at least 2 increasing values"):
        resample_hist(0, 1, [1], [1, 0])
    with pytest.raises(ValueError, match="lo <= hi, lo=1.0, hi=0.0"):
        resample_hist(1, 0, [1], [0, 1])


def test_hist_grid_puts_every_step_on_one_value_grid():
    series = {"steps": [0, 2, 4],
              "hist": {"lo": [0.0, 1.0, None], "hi": [1.0, 3.0, None],
                       "counts": [[4, 0], [0, 6], [0, 0]]}}
    g = hist_grid(series, bins=3)
    assert (g["lo"], g["hi"]) == (0.0, 3.0)
    share = np.array([[np.nan if v is None else v for v in r] for r in g["share"]])
    np.testing.assert_allclose(share[:, 0], [1, 0, 0])      # step 0: all in [0, 1)
    np.testing.assert_allclose(share[:, 1], [0, 0, 1])      # step 2: [2, 3] of [1, 3]
    assert np.isnan(share[:, 2]).all()                      # step 4: no histogram


def test_view_runs_takes_directories_and_names_a_bad_value():
    import mldebug
    from mldebug.view import data
    with pytest.raises(TypeError, match="runs must be a directory path or a list of them, got 3"):
        mldebug.view(0, runs=["somewhere", 3])
    assert os.path.abspath("somewhere") not in data.run_dirs()   # nothing half-added


# -- the page ---------------------------------------------------------------------------------
def train(run_dir, name, lr, steps=STEPS, every=EVERY):
    import torch
    from torch import nn

    import mldebug
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(64, 8)
    y = x.sum(1, keepdim=True)
    rec = mldebug.record(model, run_dir=str(run_dir), run=name, every=every)
    for _ in range(steps):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        mldebug.log_scalar("loss", loss)
    return rec


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs")
    train(run_dir, "lr0.1", 0.1).close()
    train(run_dir, "lr10", 10).close()
    return run_dir


@pytest.fixture(scope="module")
def browser():
    with headless_chromium() as b:
        yield b


@pytest.fixture(scope="module")
def view_url(runs):
    import mldebug
    from mldebug.view import close
    close()                       # another module's view: this one lists RUNS
    url = mldebug.view(0, runs=str(runs))
    yield url
    close()


@pytest.fixture
def page(browser, view_url):
    context = browser.new_context(viewport={"width": 1300, "height": 1100})
    p = context.new_page()
    p.goto(view_url)
    wait_text(p, "Inspect list")
    p.get_by_text("Timeline", exact=True).click()
    yield p
    context.close()


MODEL_JS = """([name, field]) => { const doc = Bokeh.documents[0];
    const m = doc && doc.get_model_by_name(name);
    if (!m) return null;
    if (field === 'options') return m.options.map(o => Array.isArray(o) ? o[1] : o);
    if (field === 'selected') return m.value;
    const col = m.data[field]; return col ? Array.from(col, v => Number.isNaN(v) ? null : v) : null; }"""

SET_JS = """([name, value]) => { Bokeh.documents[0].get_model_by_name(name).value = value; }"""

# Coloured pixels of a canvas (the image's viridis cells; axes and text are grey).
COLOURED_JS = """c => { const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    let n = 0; for (let i = 0; i < d.length; i += 4) {
      const r = d[i], g = d[i + 1], b = d[i + 2];
      if (d[i + 3] > 200 && Math.max(r, g, b) - Math.min(r, g, b) > 60) n++; }
    return n; }"""


def model(page, name, field):
    return page.evaluate(MODEL_JS, [name, field])


def wait_model(page, name, field, ok, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        value = model(page, name, field)
        if value is not None and ok(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}.{field} = {value!r}")
        page.wait_for_timeout(100)


@needs_chromium
def test_timeline_draws_the_histogram_image_stat_lines_and_the_kpi_curve(page, runs):
    options = wait_model(page, "mld-tl-run", "options", lambda v: len(v) == 2)
    assert options[0].startswith("lr0.1: 10 steps") and options[1].startswith("lr10: 10 steps")
    series = wait_model(page, "mld-tl-series", "selected", bool)
    assert series == "0.weight:param"                          # the first parameter
    kpi = wait_model(page, "mld-tl-kpi-a", "step", lambda v: len(v) > 0)
    assert kpi == list(range(STEPS))                           # one point per logged step
    values = model(page, "mld-tl-kpi-a", "value")
    assert values[-1] < values[0]                              # lr 0.1 learns
    steps = wait_model(page, "mld-tl-stats-a", "step", lambda v: len(v) > 0)
    assert steps == list(range(0, STEPS, EVERY))
    assert model(page, "mld-tl-stats-b", "step") == []         # no second run yet
    wait_text(page, r"━ lr0\.1")
    canvas = page.locator(".mld-tl-hist-a canvas").first
    deadline = time.monotonic() + 20
    while canvas.evaluate(COLOURED_JS) < 2000:                 # the image, not a blank plot
        assert time.monotonic() < deadline, canvas.evaluate(COLOURED_JS)
        page.wait_for_timeout(200)


@needs_chromium
def test_compare_with_a_second_run_draws_both(page, runs):
    wait_model(page, "mld-tl-run", "options", lambda v: len(v) == 2)
    wait_model(page, "mld-tl-kpi-a", "step", lambda v: len(v) > 0)
    page.evaluate(SET_JS, ["mld-tl-other", str((runs / "lr10.sqlite").resolve())])
    kpi_b = wait_model(page, "mld-tl-kpi-b", "step", lambda v: len(v) > 0)
    assert kpi_b == list(range(STEPS))
    assert model(page, "mld-tl-kpi-a", "step") == list(range(STEPS))   # A stays drawn
    # lr 10 overflows: its weights turn NaN, the lr 0.1 run's never do
    nonfinite_b = wait_model(page, "mld-tl-stats-b", "nonfinite", lambda v: len(v) > 0)
    assert max(nonfinite_b) == 128 and nonfinite_b[0] == 0
    assert max(model(page, "mld-tl-stats-a", "nonfinite")) == 0
    wait_text(page, r"━ lr0\.1 ━ lr10")
    canvas_b = page.locator(".mld-tl-hist-b canvas").first
    deadline = time.monotonic() + 20
    while canvas_b.evaluate(COLOURED_JS) < 500:
        assert time.monotonic() < deadline, canvas_b.evaluate(COLOURED_JS)
        page.wait_for_timeout(200)


@needs_chromium
def test_a_pause_and_the_refresh_button_re_read_the_store(page, runs, tmp_path):
    from mldebug.view import state
    wait_model(page, "mld-tl-run", "options", lambda v: len(v) == 2)
    # a run recorded after the page was read appears at the program's next pause
    train(runs, "later", 0.1, steps=4).close()
    hub = state.hub()
    hub.paused("wait", None)
    try:
        wait_model(page, "mld-tl-run", "options", lambda v: len(v) == 3)
    finally:
        hub.running()
    # a recording running in this process: its run_dir is listed without runs=; the
    # Refresh button reads what it has committed, and after close() the rest
    live_dir = tmp_path / "live"
    live = str((live_dir / "live.sqlite").resolve())
    rec = train(live_dir, "live", 0.1, steps=4)      # steps 0 and 2 recorded
    try:
        page.get_by_role("button", name="Refresh").click()
        options = wait_model(page, "mld-tl-run", "options", lambda v: len(v) == 4)
        assert "live in live: 2 steps (recording)" in options, options
        page.evaluate(SET_JS, ["mld-tl-run", live])
        # the loss of steps 2 and 3 waits in the recorder for the next recorded step
        wait_model(page, "mld-tl-kpi-a", "step", lambda v: v == [0, 1])
    finally:
        rec.close()
    page.get_by_role("button", name="Refresh").click()
    wait_model(page, "mld-tl-kpi-a", "step", lambda v: v == [0, 1, 2, 3])
    assert "live in live: 2 steps" in model(page, "mld-tl-run", "options")
    assert model(page, "mld-tl-run", "selected") == live
    os.remove(runs / "later.sqlite")


GLYPH_JS = """name => { const r = Bokeh.documents[0].get_model_by_name(name);
    return r ? r.glyph.color_mapper.type : null; }"""
VISIBLE_JS = """name => Bokeh.documents[0].get_model_by_name(name).visible"""


@needs_chromium
def test_log_scale_switches_the_histogram_colours_and_the_kpi_axis(page, runs):
    """With the log scale on, the image is coloured by the log of the share and the KPI
    is drawn on a log axis (its own figure, the linear one hidden); off again puts both
    back."""
    wait_model(page, "mld-tl-run", "options", lambda v: len(v) >= 2)   # (+ earlier tests')
    wait_model(page, "mld-tl-kpi-a", "step", lambda v: len(v) > 0)
    assert page.evaluate(GLYPH_JS, "mld-tl-image-a") == "LinearColorMapper"
    assert page.evaluate(VISIBLE_JS, "mld-tl-kpi-log") is False
    page.get_by_text("log scale (histogram colours, KPI)").click()
    # (the mapper and the figures' visibility reach the page as separate changes)
    wait_until(page, lambda: page.evaluate(GLYPH_JS, "mld-tl-image-a"),
               lambda v: v == "LogColorMapper")
    wait_until(page, lambda: page.evaluate(VISIBLE_JS, "mld-tl-kpi-log"), lambda v: v is True)
    canvas = page.locator(".mld-tl-kpi-log canvas").first
    deadline = time.monotonic() + 20
    while canvas.evaluate(COLOURED_JS) < 50:                   # the KPI line is drawn
        assert time.monotonic() < deadline, canvas.evaluate(COLOURED_JS)
        page.wait_for_timeout(200)
    hist = page.locator(".mld-tl-hist-a canvas").first
    deadline = time.monotonic() + 20
    while hist.evaluate(COLOURED_JS) <= 2000:                  # still an image (redrawn)
        assert time.monotonic() < deadline, hist.evaluate(COLOURED_JS)
        page.wait_for_timeout(100)
    page.get_by_text("log scale (histogram colours, KPI)").click()
    wait_until(page, lambda: page.evaluate(GLYPH_JS, "mld-tl-image-a"),
               lambda v: v == "LinearColorMapper")
    wait_until(page, lambda: page.evaluate(VISIBLE_JS, "mld-tl-kpi-log"), lambda v: v is False)


def test_the_timeline_says_the_rank_of_a_jobs_run(tmp_path, monkeypatch):
    """A run recorded by rank 1 of a launched job (RANK/WORLD_SIZE as torchrun sets them)
    is '[rank 1] ...' in the Timeline's run list, legend and plot titles; a single
    process's run has no tag."""
    from mldebug.view import data
    train(tmp_path, "solo", 0.1, steps=2).close()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    train(tmp_path, "exp", 0.1, steps=2).close()          # recorded as exp-rank1
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setattr(data, "run_dirs", lambda: [str(tmp_path)])
    runs = {r["name"]: r for r in data.known_runs()["runs"]}
    assert data.run_label(runs["exp-rank1"], False) == "[rank 1] exp-rank1: 1 steps"
    assert data.run_label(runs["solo"], False) == "solo: 1 steps"
    view = data.timeline_view(runs["exp-rank1"]["path"], runs["solo"]["path"])
    assert [side["name"] for side in view["sides"]] == ["[rank 1] exp-rank1", "solo"]
