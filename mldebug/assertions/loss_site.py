"""Where a backward-stage assertion points when a framework calls `loss.backward()`
itself (Lightning's automatic optimization): at the user's line that built the loss
(`training_step`), not at the innermost user frame then alive (`trainer.fit(...)`, where
the prompt still pauses). Read from the watch's provenance on the loss's autograd graph
(`grad_fn.metadata`): with the watch off the stop keeps the live frame's line.
"""
from __future__ import annotations

import os
import sys

import torch
from torch import Tensor

from ..core import frames as _frames
from ..watch.checks import METADATA_KEY

MAX_NODES = 256       # autograd nodes looked at, from the loss back
# frames between `loss.backward()` and here: torch's and mldebug's own
_OWN_DIRS = (os.path.dirname(torch.__file__) + os.sep,
             os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep)


def loss_site(roots):
    """(file, line, function) of the user's line that built the loss, when a framework
    calls `loss.backward()` itself (Lightning's automatic optimization: the innermost
    user frame is then `trainer.fit(...)`); None when the program calls it. Read from
    the watch's provenance on the loss's autograd graph (none with the watch off)."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_OWN_DIRS):
        frame = frame.f_back
    if frame is None or _frames.is_user_file(frame.f_code.co_filename):
        return None
    seen, queue = set(), [t.grad_fn for t in roots if isinstance(t, Tensor)]
    while queue and len(seen) < MAX_NODES:
        node = queue.pop(0)
        if node is None or node in seen:
            continue
        seen.add(node)
        prov = node.metadata.get(METADATA_KEY)
        if prov and prov[1] and _frames.is_user_file(prov[1]):
            return os.path.abspath(prov[1]), prov[2], prov[3]
        queue.extend(child for child, _ in node.next_functions)
    return None
