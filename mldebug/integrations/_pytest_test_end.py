"""The read at a test's end, over the test's own names (`pytest --mldebug` on a GPU).

On a device the watch judges what it holds at its next read (a training step's, a model
call's end). A NaN a test makes outside model calls, with no read after it, is found
only when the test function has returned: read from pytest's hook, a stop there would
open the prompt in mldebug's frame, where `p x` knows nothing. So the test function's
frame is caught as it starts, and the read runs from code compiled with the test's file
name at the test's last line, over its locals (a frame keeps them after it returns):
the prompt opens there, as the CLI's last read opens over the program's globals
(cli._flush_watches)."""
from __future__ import annotations

import inspect
import sys

import pytest

from ..core import frames as _frames

_MAX_EVENTS = 10_000     # profile events before giving up (a test whose code never runs)


class ReadAtTestEnd:
    """A pytest plugin: the watch's pending read at the end of each test function, over
    the test's names. Registered by `pytest --mldebug` and under `python -m mldebug -m
    pytest` (pytest_plugin.py)."""

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item):
        test = FrameOfTest(getattr(item, "obj", None))
        test.start()
        try:
            result = yield
        except Exception as exc:
            # a NaN/Inf still held (read late, on a device) before the exception it led
            # to: its stop fails (or pauses) the test first (watch/before_exception.py)
            test.stop()
            from ..watch import active_watch, read_before_exception
            watch = active_watch()
            if watch is not None and watch.pending:
                read_before_exception(exc, watch)
            raise
        finally:
            test.stop()
        # one still pending when the test's function returns is read now, so that its
        # stop fails (or pauses) this test, not a later one or none
        from ..watch import active_watch
        watch = active_watch()
        if watch is not None and watch.pending:
            read_at_the_end(watch, test.frame)
        return result


class FrameOfTest:
    """Catches the frame of FUNCTION (a test's function) at its first call: a profile
    function, on this thread only, that takes itself off at that call (or after
    _MAX_EVENTS events). Does nothing while another profiler is set (cProfile)."""

    def __init__(self, function):
        try:
            function = inspect.unwrap(getattr(function, "__func__", function))
        except ValueError:                   # (a __wrapped__ cycle)
            pass
        self.code = getattr(function, "__code__", None)
        self.frame = None
        self._events = 0

    def start(self) -> None:
        if self.code is not None and sys.getprofile() is None:
            sys.setprofile(self._profile)

    def stop(self) -> None:
        if sys.getprofile() == self._profile:
            sys.setprofile(None)

    def _profile(self, frame, event, arg):
        self._events += 1
        if event == "call" and frame.f_code is self.code:
            self.frame = frame
            sys.setprofile(None)
        elif self._events > _MAX_EVENTS:
            sys.setprofile(None)


def read_at_the_end(watch, frame) -> None:
    """WATCH's pending read, from a frame at FRAME's last line, over its globals and
    locals (FRAME: a test function's, returned); a plain read when there is none."""
    if frame is None or not _frames.is_user_file(frame.f_code.co_filename):
        watch.flush()
        return
    code = _frames.flush_call_at(frame.f_code.co_filename, frame.f_lineno or 1,
                                 _frames.END_OF_TEST)
    exec(code, frame.f_globals, {**frame.f_locals, "__mldebug_flush__": watch.flush})
