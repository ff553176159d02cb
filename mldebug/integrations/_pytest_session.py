"""What `pytest --mldebug` runs for the test session (see pytest_plugin.py)."""
from __future__ import annotations

import pytest

from .. import debugger as _debugger
from ..core import session as _session
from ._pytest_capture import capture_suspended
from .wiring import Wiring


class MLDebugPytest:
    """Registered as a pytest plugin when --mldebug or --mldebug-report is given."""

    def __init__(self, config, report):
        self.config = config
        self.report = report
        self.wiring = Wiring(report=report)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionstart(self, session):
        mine = _session.current()
        mine.pauser = self._fail if self.report else self._prompt
        self.wiring.start(None)

    def pytest_sessionfinish(self, session, exitstatus):
        self.wiring.close()

    def _fail(self, stop, frame) -> None:
        """--mldebug-report: the stop is in the report (a session listener); the test
        fails here, inside the op, with the stop's line as its reason."""
        pytest.fail(f"{stop.tag}mldebug: {stop.message}", pytrace=False)

    def _prompt(self, stop, frame) -> None:
        with capture_suspended(self.config):
            _debugger.get_debugger(_session.current()).pause_at(stop, frame)
