"""Helpers for training scripts over the ranks (the app uses these, not torch.distributed): this
rank and the world's size, a logged mean, small objects from every rank. Each is a collective
through a Comm of its own, watched by the latest world engine's Watch where there is one, so a
helper some ranks call while the others wait in the engine's collectives is named within seconds."""
from __future__ import annotations

import os
import weakref
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .collectives import Comm
from .watch import Watch

_lent_watch: Callable[[], Optional[Watch]] = lambda: None  # the latest world engine's


def lend_watch(comm: Comm) -> None:
    """An engine over the whole world lends its watch to the helpers below: a helper some ranks
    call while the others wait in the engine's collectives (a save on rank 0 only, then a logged
    mean) is then named within seconds, as the engine's own calls are, not after the timeout."""
    global _lent_watch
    if comm.watch is not None and comm.tp_size == 1 and comm.world_size == dist.get_world_size():
        _lent_watch = weakref.ref(comm.watch)


def _helper_comm(group: dist.ProcessGroup | None) -> Comm:
    comm = Comm(group)
    watch = _lent_watch()
    if group is None and watch is not None and watch.world_size == comm.world_size:
        comm.watch = watch
    return comm


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """This process's rank and the number of ranks in `group` (default: the world). Before any
    group has started, the world's as torchrun announces it (RANK, WORLD_SIZE), else (0, 1): a
    script can shard its data before initialize() starts the group."""
    if group is None and not dist.is_initialized():
        return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return dist.get_rank(group), dist.get_world_size(group)


def _started(group: dist.ProcessGroup | None, what: str) -> bool:
    """Whether `what` must communicate: False alone in a world of one with no group yet."""
    if group is not None or dist.is_initialized():
        return True
    if rank_and_world_size()[1] == 1:
        return False
    raise RuntimeError(f"{what} before the process group started: call zeroshard.initialize() or "
                       f"zeroshard.ensure_process_group() first")


def mean_over_ranks(value: torch.Tensor | float, group: dist.ProcessGroup | None = None) -> float:
    """Collective: the mean over ranks of a scalar (a loss to log), every rank gets it."""
    if not _started(group, "mean_over_ranks()"):
        return float(torch.as_tensor(value, dtype=torch.float32))
    comm = _helper_comm(group)
    total = torch.as_tensor(value, dtype=torch.float32).detach().reshape(()).to(comm.device, copy=True)
    comm.all_reduce(total)
    return total.item() / comm.world_size


def gather_objects(obj: object, group: dist.ProcessGroup | None = None) -> list[object]:
    """Collective: a small picklable object from every rank, in rank order, on every rank."""
    if not _started(group, "gather_objects()"):
        return [obj]
    return _helper_comm(group).all_gather_objects(obj)
