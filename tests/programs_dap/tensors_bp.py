# No mldebug import: a breakpoint() with tensors and arrays in scope, a 10k x 10k among them.
import threading

import numpy as np
import torch

from mldebug.dap import hide_from_debugger


def show():
    small = torch.tensor([[1.0, float("nan")], [3.0, 4.0]], requires_grad=True)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4)
    batch = [torch.zeros(2, 3), torch.ones(4)]
    out = {"logits": torch.randn(2, 5), "step": 3}
    breakpoint()  # here
    return small, arr, batch, out


def only_big(big):
    breakpoint()  # big
    return big


stop = threading.Event()
hidden = hide_from_debugger(threading.Thread(target=stop.wait, name="mldebug-hidden", daemon=True))
hidden.start()
# one NaN in a thousand: its summary (exact counts, finite stats) takes ~250 ms, well over
# the Variables view's 50 ms budget on any machine, so the value comes first and the full
# summary later (all ones took ~40 ms here: sometimes within the budget). Made in numpy:
# under the CLI's watch a torch op writing the NaNs would be a stop.
ones = np.ones((10000, 10000), dtype=np.float32)
ones.reshape(-1)[::1000] = np.nan
big = torch.from_numpy(ones)
show()
only_big(big)
stop.set()
print("done")
