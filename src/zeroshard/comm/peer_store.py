"""What ranks tell each other through the c10d store, outside the collectives (watch.py's Watch):
that a process has exited, and the histories a diagnosis compares.

Why the store: a collective could pair with a peer's different collective (gloo aborts a process
whose peer sends more bytes than it expects), and a timed-out group is unusable; the store cannot
mismatch. It lives in global rank 0's process, so every wait here is bounded and a store that went
away is an answer, not an error.
"""
from __future__ import annotations

import atexit
import pickle
import time
import weakref
from typing import Protocol

import torch.distributed as dist


class Watch(Protocol):
    """What these functions read of diverge.Watch (stated here, so this module does not import it)."""

    store: "dist.Store | None"
    prefix: str
    rank: int
    world_size: int
    timeout: float

SLICE_S = 1.0        # a bounded wait looks for a peer's alarm (or exit) this often
_GRACE_S = 30.0      # how long a diagnosing rank waits for its peers' histories (at most)
_live: "weakref.WeakSet[Watch]" = weakref.WeakSet()  # told at this process's exit


def default_store() -> "dist.Store | None":
    try:  # torch keeps the default group's store privately; without it only timeouts are diagnosed
        return dist.distributed_c10d._get_default_store()
    except (AttributeError, RuntimeError, ValueError):
        return None


def tell_peers_at_exit(watch: Watch) -> None:
    """When this process exits (a script's end, an exception), `watch`'s rank is marked exited, so a
    peer waiting for it in a collective or a gate is told at once rather than at the timeout."""
    if not _live:
        atexit.register(_say_exited)
    _live.add(watch)


def _say_exited() -> None:
    for watch in list(_live):
        try:
            if watch.store is not None and watch.world_size > 1:
                watch.store.set(f"{watch.prefix}exited/{watch.rank}", "1")
        except Exception:  # noqa: BLE001 (the store's host may have gone first: nothing to tell)
            pass


def exited_peers(watch: Watch, among: list[int] | None = None) -> list[int]:
    """The peers (of `among`; default: all) whose process has exited."""
    if watch.store is None:
        return []
    try:
        return [r for r in (range(watch.world_size) if among is None else among)
                if r != watch.rank and watch.store.check([f"{watch.prefix}exited/{r}"])]
    except dist.DistError:  # the store is gone: Watch._alarm_raised() says so
        return []


def exchange_histories(watch: Watch, histories: dict) -> None:
    """Publish this rank's history and collect the peers' within the grace period (an exited peer
    publishes none: not waited for). Then say `done` and wait (briefly) for every peer whose history
    was read to say it too: a rank that raised and exited first would take the store from under a
    peer still reading, if it is the store's host (the peer got `Connection reset`, not the diagnosis)."""
    store, prefix, rank, world_size = watch.store, watch.prefix, watch.rank, watch.world_size
    store.set(f"{prefix}alarm", str(rank))
    store.set(f"{prefix}history/{rank}", pickle.dumps(histories[rank]))
    deadline = time.monotonic() + min(_GRACE_S, watch.timeout) + 5 * SLICE_S
    exited: list[int] = []
    while len(histories) + len(exited) < world_size and time.monotonic() < deadline:
        for r in range(world_size):
            key = f"{prefix}history/{r}"
            if r not in histories and store.check([key]):
                histories[r] = pickle.loads(store.get(key))
        exited = exited_peers(watch, [r for r in range(world_size) if r not in histories])
        time.sleep(0.05)
    store.set(f"{prefix}done/{rank}", "1")
    try:  # (the histories are in hand: a store gone now is the host leaving after the others)
        done = [f"{prefix}done/{r}" for r in histories]
        deadline = time.monotonic() + 5 * SLICE_S
        while not store.check(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    except dist.DistError:
        pass
