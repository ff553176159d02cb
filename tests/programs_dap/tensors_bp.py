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
big = torch.ones(10000, 10000)
show()
only_big(big)
stop.set()
print("done")
