"""Developers' switch: CPU tensors take the device (GPU) paths of the watch and the
recorder, so that a machine without a GPU runs them and counts their ops and reads.

`MLDEBUG_SIMULATE_DEVICE=1` in the environment turns it on when the engines are imported,
in this process and in the child processes it starts (the CLI's tests under
`pytest --device-path`); each engine's `simulate_device(on)` turns it on and off in a
running process (tests and benchmarks)."""
from __future__ import annotations

import os

ENV = "MLDEBUG_SIMULATE_DEVICE"


def simulated_by_env() -> bool:
    """Whether the environment asks for the device paths on the CPU."""
    return os.environ.get(ENV) == "1"
