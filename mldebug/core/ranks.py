"""Which rank of a multi-process job this process is: from torch.distributed when the
program initialised it, else from the launcher's environment (torchrun, `accelerate
launch`, `python -m torch.distributed.run` set RANK, LOCAL_RANK and WORLD_SIZE).

A single process (no launcher, or a world of one) has no rank: `this_rank()` is None,
and every stop record says `rank: null`.
"""
from __future__ import annotations

import os
import socket
import sys
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class RankInfo:
    rank: int
    local_rank: Optional[int]
    world_size: int
    host: str

    @property
    def tag(self) -> str:
        """'[rank 1] ': what every line this rank prints about a stop starts with."""
        return rank_tag(self.rank)


def rank_tag(rank: Optional[int]) -> str:
    """'[rank 1] ' for a rank of a job (a stop line, `history`, a recorded run's label);
    '' for a single process (rank None)."""
    return f"[rank {rank}] " if rank is not None else ""


def _env_int(name: str) -> Optional[int]:
    try:
        return int(os.environ[name])
    except (KeyError, ValueError):
        return None


def this_rank() -> Optional[RankInfo]:
    rank, world = _env_int("RANK"), _env_int("WORLD_SIZE")
    # (looked up, never imported: a single-process program does not load it for us)
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
    except Exception:  # noqa: BLE001 - a half-torn-down group: the environment says it
        pass
    if rank is None or world is None or world <= 1:
        return None
    return RankInfo(rank=rank, local_rank=_env_int("LOCAL_RANK"), world_size=world,
                    host=socket.gethostname())


def expand_rank(path: str) -> str:
    """'stops-{rank}.jsonl' -> 'stops-1.jsonl' (the launcher's RANK; 0 for one process)."""
    if "{rank}" not in path:
        return path
    info = this_rank()
    return path.replace("{rank}", str(info.rank if info is not None else 0))
