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
