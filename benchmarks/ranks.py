"""What the benchmarks' spawned ranks share: a free port for the rendezvous, and the one way a
rank-0 result leaves a group (written, then every rank passes a barrier before tearing down)."""
from __future__ import annotations

import json
import socket

import torch.distributed as dist


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_json(path: str, obj: dict, rank: int) -> None:
    """Rank 0 writes `obj`; then the group is torn down on every rank."""
    if rank == 0:
        with open(path, "w") as f:
            json.dump(obj, f)
    dist.barrier()  # gloo can abort a rank that tears down while a peer still talks to it
    dist.destroy_process_group()
