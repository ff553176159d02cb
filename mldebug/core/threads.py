"""Threads mldebug starts (the Bokeh server, the recorder's writer, the panel's
summaries) belong to mldebug, not to the program being debugged."""
from __future__ import annotations

import threading


def hide_from_debugger(thread: threading.Thread) -> threading.Thread:
    """Mark THREAD (before `start()`) so pydevd neither traces nor suspends it, nor lists
    it in `threads`: what pydevd does for its own daemon threads. Harmless without
    debugpy."""
    thread.pydev_do_not_trace = True
    thread.is_pydev_daemon_thread = True
    return thread
