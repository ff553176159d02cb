"""core/pg_timeout.py: the process groups a program creates under an interactive
multi-rank session wait at least the debugging hold; the wrapper keeps every call form
working (positional timeout, keywords, the device mesh's own calls) and puts the originals
back. Run in a subprocess (a world of one, gloo): the test process keeps torch untouched."""
from __future__ import annotations

import socket
import subprocess
import sys

from conftest import clean_env

CHECKS = """
    import inspect
    from datetime import timedelta
    import torch
    import torch.distributed as dist
    import torch.distributed.device_mesh as mesh_module
    from torch.distributed import distributed_c10d as c10d
    from mldebug.core.pg_timeout import HoldTimeout

    originals = {name: getattr(c10d, name) for name in ("init_process_group", "new_group",
                                                         "split_group")}
    def timeout_of(pg):
        return pg._get_backend(torch.device("cpu")).options._timeout

    said = []
    hold = HoldTimeout(timedelta(hours=1), lambda *a: said.append(a)).install()
    for module in (dist, c10d, mesh_module):       # every place torch binds the names
        for name, fn in originals.items():
            assert getattr(module, name) is not fn, (module, name)
            assert inspect.signature(getattr(module, name)) == inspect.signature(fn)

    # a positional timeout shorter than the hold: raised (the program's store works)
    dist.init_process_group("gloo", None, timedelta(seconds=5), store=dist.HashStore(),
                            rank=0, world_size=1)
    assert timeout_of(dist.group.WORLD) == timedelta(hours=1)
    assert said == [("init_process_group", timedelta(seconds=5), timedelta(hours=1))]
    # the default (None): the hold; a longer timeout of the program's: kept
    assert timeout_of(dist.new_group([0])) == timedelta(hours=1)
    assert timeout_of(dist.new_group(ranks=[0], timeout=timedelta(hours=2))) == timedelta(hours=2)
    assert timeout_of(c10d.new_group([0], timedelta(seconds=1))) == timedelta(hours=1)
    sub = dist.new_subgroups(group_size=1)[0]          # calls new_group by its global name
    assert timeout_of(sub) == timedelta(hours=1)
    # a call torch rejects is torch's own error, raised once
    for bad in (dict(timeout=5), dict(no_such_argument=1)):
        try:
            dist.new_group([0], **bad)
        except Exception as exc:   # noqa: BLE001
            print("rejected", type(exc).__name__, exc)
        else:
            raise AssertionError(f"new_group accepted {bad}")
    dist.destroy_process_group()

    # init_device_mesh initialises the default group itself (env://) and makes a group a
    # mesh dimension
    mesh = dist.init_device_mesh("cpu", (1, 1), mesh_dim_names=("dp", "tp"))
    assert timeout_of(dist.group.WORLD) == timedelta(hours=1)
    assert timeout_of(mesh.get_group("dp")) == timedelta(hours=1)
    assert timeout_of(mesh.get_group("tp")) == timedelta(hours=1)
    dist.destroy_process_group()

    hold.close()
    for module in (dist, c10d, mesh_module):
        for name, fn in originals.items():
            assert getattr(module, name) is fn, (module, name)
    # closed: the program's timeout again
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timedelta(seconds=5))
    assert timeout_of(dist.group.WORLD) == timedelta(seconds=5)
    dist.destroy_process_group()

    # a hold under torch's longest default leaves the default alone, raises shorter ones
    short = HoldTimeout(timedelta(minutes=20))
    assert short.timeout_for(None) is None
    assert short.timeout_for(timedelta(minutes=5)) == timedelta(minutes=20)
    assert short.timeout_for(timedelta(hours=1)) is None and short.timeout_for(5) is None
    print("all checks passed")
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_hold_raises_every_process_group_timeout_and_restores_torch(write_program):
    prog = write_program(CHECKS)
    result = subprocess.run(
        [sys.executable, str(prog)], capture_output=True, text=True, timeout=120,
        env=clean_env(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port())))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "all checks passed" in result.stdout
    assert result.stdout.count("rejected") == 2
