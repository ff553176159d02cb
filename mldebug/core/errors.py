"""The few named exception types mldebug raises."""


class MLDebugError(Exception):
    """Base class of mldebug's own errors."""


class NonFiniteError(MLDebugError, FloatingPointError):
    """A watched op produced NaN or Inf (raised only when the watch is asked to raise)."""

    def __init__(self, message, violation=None):
        super().__init__(message)
        self.violation = violation


class UsageError(MLDebugError, ValueError):
    """A bad argument from the user: the message names the value."""


class StopError(MLDebugError):
    """A stop ended a run that nobody can answer a prompt for: a framework callback with
    `batch=True` (the default without a terminal), or `mldebug.watch()` in a script run
    without one. The message is the stop's report line; `stop` is the `Stop`."""

    def __init__(self, message, stop=None):
        super().__init__(message)
        self.stop = stop
