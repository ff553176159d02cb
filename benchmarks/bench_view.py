"""Time from `mldebug.inspect(x)` to the heatmap drawn in the browser view, in headless
Chromium (Debian's /usr/bin/chromium through Playwright).

    python benchmarks/bench_view.py [--reps 3] [--sizes 1e6,1e8]

One process: the view runs in it (`mldebug.view(0)`), one page is open. For each size a
float32 ramp is made beforehand (not timed; 1e6 = 1000x1000, 1e8 = 10000x10000); the
clock starts before `mldebug.inspect(x, name=...)` and stops when the page shows the new
name AND the heatmap canvas shows the new ramp (the ramps alternate between rows and
columns, so the previous picture never passes the check). That covers the hub, the
slice and downsampling on the worker (block means / strides to <= 400x400), the Bokeh
patch over the websocket and BokehJS drawing it. The full stats pass (the table beside
the heatmap) comes after and is not part of the figure. Median of --reps runs.
Targets: <= 0.3 s at 1e6, <= 1 s at 1e8.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402

import mldebug  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
TARGETS = {int(1e6): 0.3, int(1e8): 1.0}

# True when the page shows NAME and the heatmap's canvas a ramp along AXIS ('rows': top
# and bottom differ, left and right alike; 'cols' the other way round).
DRAWN_JS = """([name, axis]) => {
  const find = (root, sel) => { const hit = root.querySelector(sel); if (hit) return hit;
    for (const e of root.querySelectorAll('*')) if (e.shadowRoot) {
      const f = find(e.shadowRoot, sel); if (f) return f; } return null; };
  const title = find(document, '.mld-tensor-title');
  if (!title || !(title.shadowRoot || title).textContent.includes(name + ' ')) return false;
  const host = find(document, '.mld-heatmap');
  const c = host && find(host.shadowRoot || host, 'canvas');
  if (!c) return false;
  const g = c.getContext('2d');
  const px = (fx, fy) => Array.from(g.getImageData(Math.floor(c.width * fx),
                                                   Math.floor(c.height * fy), 1, 1).data);
  const same = (a, b) => a.every((v, i) => Math.abs(v - b[i]) < 8);
  const top = px(0.5, 0.2), bottom = px(0.5, 0.8), left = px(0.3, 0.5), right = px(0.75, 0.5);
  return axis === 'rows' ? (!same(top, bottom) && same(left, right))
                         : (!same(left, right) && same(top, bottom));
}"""


def ramp(n: int, axis: str) -> torch.Tensor:
    side = int(round(n ** 0.5))
    line = torch.linspace(0.0, 1.0, side)
    if axis == "rows":
        return line[:, None].expand(side, side).contiguous()
    return line[None, :].expand(side, side).contiguous()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--sizes", default="1e6,1e8")
    args = parser.parse_args()
    if not os.path.exists(CHROMIUM):
        sys.exit(f"bench_view: {CHROMIUM} missing (apt-get install chromium)")
    from playwright.sync_api import sync_playwright

    sizes = [int(float(s)) for s in args.sizes.split(",")]
    url = mldebug.view(0)
    results = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True,
                                     args=["--no-sandbox", "--disable-gpu",
                                           "--disable-dev-shm-usage"])
        page = browser.new_page(viewport={"width": 1300, "height": 1000})
        page.goto(url)
        page.wait_for_function("() => window.Bokeh && Bokeh.documents.length > 0")
        run = 0
        for n in [sizes[0]] + sizes:          # the first size once more as a warm-up
            times = []
            for _ in range(args.reps):
                axis = "rows" if run % 2 == 0 else "cols"
                x = ramp(n, axis)
                name = f"bench{run}"
                run += 1
                start = time.perf_counter()
                mldebug.inspect(x, name=name)
                page.wait_for_function(DRAWN_JS, arg=[name, axis], polling="raf",
                                       timeout=60000)
                times.append(time.perf_counter() - start)
                del x
            results[n] = times
        browser.close()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"median of {args.reps}; inspect -> heatmap drawn in headless Chromium")
    print(f"{'elements':>10} {'median s':>9} {'min s':>7} {'max s':>7} {'target s':>9}")
    for n in sizes:
        t = results[n]
        target = TARGETS.get(n)
        print(f"{n:>10.0e} {statistics.median(t):>9.3f} {min(t):>7.3f} {max(t):>7.3f} "
              f"{target if target is not None else '-':>9}")


if __name__ == "__main__":
    main()
