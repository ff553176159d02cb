"""Process groups that outwait a debugging session.

While one rank's prompt is open, another rank may already be blocked inside a collective
the paused rank has not joined (DDP's gradient all-reduce, a barrier). A collective that
has started cannot be released from Python: it ends at the process group's timeout
(30 minutes for gloo, 10 for NCCL by default, or the program's own `timeout=`), and the
rank dies with a gloo/NCCL timeout while the user is still debugging. So in an
interactive session under a launcher, mldebug makes every process group the program
creates wait at least a debugging hold (`--hold-timeout`, 6 hours by default):
`torch.distributed.init_process_group`, `new_group` and `split_group` (what
`init_device_mesh` and `new_subgroups` call too) get `timeout=max(theirs, hold)`.
A longer timeout the program asked for is kept; `None` (the backend's default, 30
minutes at most) becomes the hold when the hold is longer.

The wrapper binds the call's arguments to the original's signature and changes only
`timeout`; a call it cannot read (wrong arguments, an odd timeout) goes to the original
untouched, so torch raises its own error. `close()` puts the originals back wherever it
put a wrapper (and leaves a name alone that someone else rebound since).
"""
from __future__ import annotations

import functools
import inspect
import sys
from datetime import timedelta
from typing import Callable, Optional

DEFAULT_HOLD_S = 6 * 3600
NAMES = ("init_process_group", "new_group", "split_group")
# where torch binds those names: the functions' module, the package's namespace, and
# the device mesh (which imported them by name)
MODULES = ("torch.distributed.distributed_c10d", "torch.distributed",
           "torch.distributed.device_mesh")
BACKEND_DEFAULT = timedelta(minutes=30)   # the longest of torch's default timeouts


class HoldTimeout:
    """Wraps the process group constructors while installed. ON_RAISE(name, old, new)
    hears of each call whose timeout it raised (old: the program's, None for the
    default)."""

    def __init__(self, hold: timedelta,
                 on_raise: Optional[Callable[[str, Optional[timedelta], timedelta], None]] = None):
        self.hold = hold
        self.on_raise = on_raise
        self._patched: list = []    # (module, name, original, wrapper)

    def install(self) -> "HoldTimeout":
        import torch.distributed as dist
        if not dist.is_available():
            return self
        for module_name in MODULES:
            try:
                __import__(module_name)
            except Exception:  # noqa: BLE001 - an older torch without it
                continue
        c10d = sys.modules.get(MODULES[0])
        for name in NAMES:
            original = getattr(c10d, name, None)
            if original is None or not _takes_timeout(original):
                continue
            wrapper = self._wrap(name, original)
            for module_name in MODULES:
                module = sys.modules.get(module_name)
                if module is not None and getattr(module, name, None) is original:
                    setattr(module, name, wrapper)
                    self._patched.append((module, name, original, wrapper))
        return self

    def close(self) -> None:
        for module, name, original, wrapper in reversed(self._patched):
            if getattr(module, name, None) is wrapper:
                setattr(module, name, original)
        self._patched.clear()

    def __enter__(self):
        return self.install()

    def __exit__(self, *exc):
        self.close()

    def timeout_for(self, given) -> Optional[timedelta]:
        """The timeout to pass instead of GIVEN, or None to leave the call as it is."""
        if given is None:
            return self.hold if self.hold > BACKEND_DEFAULT else None
        if isinstance(given, timedelta) and given < self.hold:
            return self.hold
        return None

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def with_hold_timeout(*args, **kwargs):
            try:
                bound = signature.bind(*args, **kwargs)
                given = bound.arguments.get("timeout")
                new = self.timeout_for(given)
                if new is not None:
                    bound.arguments["timeout"] = new
                    args, kwargs = bound.args, bound.kwargs
                    if self.on_raise is not None:
                        self.on_raise(name, given, new)
            except Exception:  # noqa: BLE001 - the call goes to torch as the program made it
                pass
            return original(*args, **kwargs)

        with_hold_timeout.mldebug_hold_timeout = self
        return with_hold_timeout


def _takes_timeout(fn) -> bool:
    try:
        return "timeout" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
