"""Helpers for training scripts over the ranks (the app uses these, not torch.distributed): this
rank and the world's size, a logged mean, small objects from every rank. Each is a collective
through a Comm of its own, watched by the latest world engine's Watch where there is one
(Watch.lend), so a helper some ranks call while the others wait in the engine's collectives is
named within seconds."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .collectives import Comm
from .watch import Watch


def _helper_comm(group: dist.ProcessGroup | None) -> Comm:
    """A Comm for one helper call, watched by the latest world engine's Watch (the world only)."""
    return Comm(group, watch=Watch.lent(dist.get_world_size()) if group is None else None)


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
