"""pytest's capture let go of the terminal while mldebug's prompt runs (what --pdb does);
shared by the plugin and its session, and importing nothing but the standard library."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def capture_suspended(config):
    """pytest's capture off (stdin too) for a prompt, then on again: what --pdb does."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:
        capture.suspend_global_capture(in_=True)
    try:
        yield
    finally:
        if capture is not None:
            capture.resume_global_capture()
