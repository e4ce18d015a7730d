"""Run a function on N local ranks (gloo, one thread each) and surface the first failure."""
from __future__ import annotations

import atexit
import os
import socket
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn, world_size: int, port: int, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        fn(rank, world_size, *args)
        dist.barrier()  # gloo can abort at exit if one rank tears down while a peer still talks
    finally:
        dist.destroy_process_group()
        # End as a spawned process would: a forked one leaves by os._exit, skipping the exit
        # handlers (weakref finalizers among them: an engine's disk-offload files go there).
        atexit._run_exitfuncs()


# Ranks start from a fork server that has imported torch and zeroshard once, rather than each
# rank importing them afresh (the suite is CPU-bound on CI's 2 cores, and those imports were a
# large share of it). The server imports and never runs anything, so no thread or process group
# is forked; each rank is a fresh process with its own. (Its environment is the server's, from
# the first spawn on: a test that must change a rank's environment passes it as an argument.)
# torch._dynamo too: stage 3's hooks are wrapped in torch._dynamo.disable (units.py), and importing
# it took ~2.5 s of each rank's CPU (a quarter of the parity tests' time).
# `import zeroshard` alone is light (its public names load on first use): the engine and what it
# needs are named here.
mp.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "zeroshard",
                           "zeroshard.engine.initialize", "zeroshard.integrations.hf.patches"])


def spawn(fn, world_size: int, *args) -> None:
    """fn(rank, world_size, *args) on every rank; raises if any rank raises (others are stopped)."""
    mp.start_processes(_entry, args=(fn, world_size, free_port(), args), nprocs=world_size,
                       join=True, start_method="forkserver")
