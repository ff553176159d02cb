"""Ctrl-C pauses the program, as it does under pdb; a second Ctrl-C ends it.

mldebug runs the program untraced, so Python's default SIGINT handler would raise
KeyboardInterrupt wherever the main thread happens to be: inside torch's Python code,
half way through an optimizer step. Instead the first Ctrl-C arms a trace function
that pauses at the next line the *user's* code runs, in the same place a NaN stop puts
them, and only where pausing is harmless:

- never inside an optimizer step (torch.optim's frames, or an `Optimizer` subclass's
  method on the stack): the pause lands on the user's line after the step returns, so
  `c` resumes with the step either not begun or complete, and the results are bitwise
  those of an uninterrupted run;
- never inside mldebug's own work (a hook, a re-run of a module call by the watch).

The trace is installed only between the Ctrl-C and the pause, and removed before the
prompt opens: after `c` the program runs untraced again. A second Ctrl-C while the
pause is pending (within a second, or stuck in a long op), or Ctrl-C at the prompt of
that pause, ends the program with KeyboardInterrupt (exit status 130), as Ctrl-C did
before. `--batch` runs and DAP sessions do not install this: there Ctrl-C ends the run.
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import Callable, Optional

from .core import frames as _frames
from .core import replay as _replay

# A second Ctrl-C within this many seconds of the first ends the program even when the
# pause has already landed (a user pressing it twice means "stop").
DOUBLE_PRESS_SECONDS = 1.0

_TORCH_OPTIM_DIR = None     # torch/optim/ (resolved when torch is imported)


def _torch_optim_dir() -> str:
    global _TORCH_OPTIM_DIR
    if _TORCH_OPTIM_DIR is None:
        torch = sys.modules.get("torch")
        if torch is None or not getattr(torch, "__file__", None):
            return "\0"      # no torch yet: no optimizer can be running
        _TORCH_OPTIM_DIR = os.path.join(os.path.dirname(os.path.abspath(torch.__file__)),
                                        "optim") + os.sep
    return _TORCH_OPTIM_DIR


def _inside_optimizer(frame: FrameType) -> bool:
    """True when FRAME runs (directly or further down) inside an optimizer's step."""
    optim_dir = _torch_optim_dir()
    optimizer_cls = getattr(getattr(sys.modules.get("torch"), "optim", None), "Optimizer", None)
    f = frame
    while f is not None:
        filename = f.f_code.co_filename
        if filename.startswith(optim_dir):
            return True
        if optimizer_cls is not None and f.f_code.co_varnames[:1] == ("self",):
            owner = f.f_locals.get("self")
            if isinstance(owner, optimizer_cls):
                return True       # a user-written optimizer's step (or its helpers)
        f = f.f_back
    return False


def can_pause_at(frame: FrameType, bottom=None) -> bool:
    """True when a pause at FRAME's current line is harmless: it is the user's code, not
    inside an optimizer step, not inside mldebug's own work (BOTTOM: the program's
    module code object, below which the frames are the CLI's)."""
    return (_frames.is_user_file(frame.f_code.co_filename) and not _replay.active()
            and not _inside_mldebug(frame, bottom) and not _inside_optimizer(frame))


def _inside_mldebug(frame: FrameType, bottom) -> bool:
    """True when an mldebug frame lies between FRAME and the program's own module frame
    (a hook, the watch re-running a call): the program is in mldebug's hands."""
    mldebug_dir = _frames._MLDEBUG_DIR
    f = frame
    while f is not None and f.f_code is not bottom:
        if f.f_code.co_filename.startswith(mldebug_dir):
            return True
        f = f.f_back
    return False


class InterruptPause:
    """The SIGINT handler of an interactive CLI run (`install()` / `close()`).

    PAUSE(frame) opens the prompt at FRAME and returns when the user continues; it is
    the debugger's job (mldebug.debugger wires it). PROGRAM_CODE is the code object of
    the program's `__main__` (frames below it are the CLI's). ON_TRACED(frame) is called
    instead of arming when the debugger already traces the thread (breakpoints set,
    stepping): that tracer then finds the pause. AT_PROMPT() says whether a prompt is
    open; INTERRUPT_PROMPT() delivers a Ctrl-C to a prompt that reads on another thread
    (by default KeyboardInterrupt is raised in the main thread, where pdb reads)."""

    def __init__(self, pause: Callable[[FrameType], None], program_code=None,
                 on_traced: Optional[Callable[[FrameType], None]] = None,
                 at_prompt: Callable[[], bool] = lambda: False,
                 interrupt_prompt: Optional[Callable[[], None]] = None):
        self._pause = pause
        self._on_traced = on_traced
        self._at_prompt = at_prompt
        self._interrupt_prompt = interrupt_prompt
        self._program_code = program_code
        self._previous = None
        self._installed = False
        self.armed = False          # a Ctrl-C is waiting for a user line to pause at
        self.ended = False          # the program was ended by a second Ctrl-C
        self._pressed_at = -1e9

    # -- lifecycle --------------------------------------------------------------------
    def install(self) -> "InterruptPause":
        if threading.current_thread() is not threading.main_thread():
            return self    # signal handlers belong to the main thread
        if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
            return self    # the program's environment chose its own handling: keep it
        self._previous = signal.signal(signal.SIGINT, self._on_sigint)
        self._installed = True
        return self

    def close(self) -> None:
        if self.armed:
            self._disarm(sys._getframe())
        if self._installed:
            if signal.getsignal(signal.SIGINT) == self._on_sigint:
                signal.signal(signal.SIGINT, self._previous or signal.default_int_handler)
            self._installed = False

    # -- the handler ------------------------------------------------------------------
    def _on_sigint(self, signum, frame) -> None:
        if self._at_prompt():
            # at a prompt Ctrl-C is the prompt's: pdb clears the line, the prompt of a
            # Ctrl-C pause ends the program (MLCommands.cmdloop). A prompt read on
            # another thread (IPython's) is asked to raise it there instead.
            if self._interrupt_prompt is None:
                raise KeyboardInterrupt
            self._interrupt_prompt()
            return
        now = time.monotonic()
        second = self.armed or now - self._pressed_at < DOUBLE_PRESS_SECONDS
        self._pressed_at = now
        if second:
            self.end()
        if sys.gettrace() is not None:
            # already traced (breakpoints set, stepping, a coverage tool): two tracers
            # cannot share the thread; the debugger's finds the pause, or Ctrl-C ends
            if self._on_traced is None:
                self.end()
            self._on_traced(frame)
            return
        self.armed = True
        f = frame
        while f is not None:
            f.f_trace = self._local_trace
            f = f.f_back
        sys.settrace(self._global_trace)

    def end(self) -> None:
        """End the program as Ctrl-C always did: KeyboardInterrupt where it runs."""
        self.ended = True
        if self.armed:
            self._disarm(sys._getframe(1))
        raise KeyboardInterrupt

    def _disarm(self, frame: Optional[FrameType]) -> None:
        self.armed = False
        sys.settrace(None)
        f = frame
        while f is not None:
            if f.f_trace == self._local_trace:
                f.f_trace = None
            f = f.f_back

    # -- where to pause ---------------------------------------------------------------
    def _global_trace(self, frame, event, arg):
        # called on every new Python frame while armed: only the user's own frames get
        # line events (torch's Python code runs untraced but for this check)
        if event == "call" and _frames.is_user_file(frame.f_code.co_filename):
            return self._local_trace
        return None

    def _local_trace(self, frame, event, arg):
        if event != "line" or not self.armed:
            return self._local_trace if self.armed else None
        if not can_pause_at(frame, self._program_code):
            return self._local_trace
        self._disarm(frame)
        self._pause(frame)
        # the debugger may have left its own tracer on this frame (`n`, `s`): keep it
        return frame.f_trace
