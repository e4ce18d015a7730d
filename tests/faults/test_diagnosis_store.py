"""The diagnosis exchange through the c10d store survives its host's exit.

The store lives in global rank 0's process. A rank that diagnosed first and exited at once used to
pull the store from under a peer still reading the histories: that peer raised `Connection reset by
peer` (a DistNetworkError) instead of the DivergenceError (seen in CI, stage 3 with a step on rank 0
alone). Here rank 0 hosts the store in a child process that exits right after its diagnosis, and this
process, rank 1, reads slowly.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from datetime import timedelta

import torch.distributed as dist

from helpers.spawn import free_port
from zeroshard.comm.watch import DivergenceError, Watch


def _watch(rank: int, store: dist.Store, calls: list[str]) -> Watch:
    watch = Watch(rank, world_size=2, timeout=5.0, every=1, on_cuda=False)
    watch.store = store
    watch.prefix = "drill/"  # (its default counts the engines made in this process: pytest's made others)
    for label in calls:
        watch.record("all_gather", label, 0, 16, "float32")
    return watch


def _host(port: int) -> None:
    """Rank 0: hosts the store, diagnoses, and exits as soon as diagnose() returns."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=True, timeout=timedelta(seconds=30))
    _watch(0, store, ["unit 0", "unit 1"]).diagnose("rank 0 stalled")
    os._exit(0)


class _SlowReader:
    """Rank 1's store, slow to look for the peer's history (as a loaded machine is)."""

    def __init__(self, store: dist.Store) -> None:
        self.store = store

    def check(self, keys: list[str]) -> bool:
        if any("history/" in k for k in keys):
            time.sleep(0.5)
        return self.store.check(keys)

    def __getattr__(self, name: str):
        return getattr(self.store, name)


def test_a_peer_still_reading_gets_the_diagnosis_when_rank_0_exits() -> None:
    port = free_port()
    host = mp.get_context("spawn").Process(target=_host, args=(port,))
    host.start()
    try:
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=timedelta(seconds=30))
        error = _watch(1, _SlowReader(store), ["unit 0", "unit 2"]).diagnose("rank 1 stalled")
    finally:
        host.join(timeout=60)
    assert isinstance(error, DivergenceError)
    assert "rank 0:" in str(error) and "rank 1:" in str(error) and "unit 1" in str(error), error
    assert "store went away" not in str(error), error
