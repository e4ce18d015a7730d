"""Memory: what this rank holds, as exact sums over the engine's own buffers (distinct storages).

The paper's formulas these are held to live in paper/formulas.py; tests compare the two, and an
independent census of every live tensor.
"""
from __future__ import annotations

from collections import Counter
from typing import Iterable

import torch
from torch import nn

from .flat_param import FlatParam, ParamState


def _inflight_bytes(flat: FlatParam) -> int:
    """Inputs kept alive only by reductions in flight (not the persistent stage 0-1 gradient), and
    the buffers they receive into (a gloo reduce-scatter's, comm._SumOnArrival)."""
    persistent = None if flat.policy.shard_grads or flat.grads.full is None else \
        flat.grads.full.untyped_storage().data_ptr()
    return sum((_nbytes(keep) if keep.untyped_storage().data_ptr() != persistent else 0)
               + getattr(work, "staging_bytes", 0) for work, _, keep in flat.grads.inflight)


def temporary_bytes(flat: FlatParam) -> int:
    """The temporaries alive now: a gathered buffer (stage 3), a full-size gradient (stages 2-3),
    inputs of reductions in flight, hpZ's secondary shard. (Sampled after every gather: kept to a
    few attribute reads.)"""
    gathered = flat.policy.shard_params and not flat.persistent and flat.state is not ParamState.SHARDED
    return (_nbytes(flat.full) if gathered else 0) \
        + (_nbytes(flat.grads.full) if flat.policy.shard_grads else 0) \
        + (_inflight_bytes(flat) if flat.grads.inflight else 0) \
        + (_nbytes(flat.secondary) if flat.secondary is not None else 0)  # hpZ: forward to step


def buffer_bytes(flat: FlatParam) -> dict[str, int]:
    """One flat buffer's bytes by category: lasting params / grads / master copy, and the
    temporaries alive now (temporary_bytes)."""
    sharded_g = flat.policy.shard_grads
    if not flat.policy.shard_params:
        params = _nbytes(flat.full)
    elif flat.persistent:  # stage 3 below the persistence threshold: shard and full both kept
        params = _nbytes(flat.shard) + _nbytes(flat.full)
    else:
        params = _nbytes(flat.shard)
    separate = flat.trainable and flat.precision.separate_master
    return {
        "params": params,
        "grads": _nbytes(flat.grads.shard) if sharded_g else _nbytes(flat.grads.full),
        # what a backward allocates and the step holds (stages 2-3 free it after the step)
        "grads_in_step": flat.layout.shard_numel * flat.grad_dtype.itemsize if sharded_g and flat.trainable
        else _nbytes(flat.grads.full),
        "master": _nbytes(flat.master) if separate else 0,
        "temporary": temporary_bytes(flat),
        "transfer": flat.host.nbytes if flat.host is not None else 0,  # offload's host buffers
        "params_on_host": _nbytes(flat.shard) if flat.shard_on_host else 0,
        "disk": (_nbytes(flat.master) if separate and on_disk(flat.master) else 0)
        + (_nbytes(flat.shard) if flat.shard_on_host and on_disk(flat.shard) else 0),
    }


def on_disk(t: torch.Tensor | None) -> bool:
    """Does `t` rest in a file (disk offload maps its files; nothing else here does)?"""
    return t is not None and t.device.type == "cpu" and t.untyped_storage().filename is not None


def _disk_buffers(flats: list[FlatParam]) -> int:
    """Disk offload's host memory: the buffers its optimizer step streams through (nvme/stream.py)
    and the parameter shards cached (nvme/cache.py)."""
    disk = next((f.copier.disk for f in flats if f.copier is not None and f.copier.disk is not None), None)
    if disk is None:
        return 0
    return (disk.stream.nbytes if disk.stream is not None else 0) + disk.cache.nbytes


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (views of one storage count once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return tensor_bytes(v for state in optimizer.state.values() for v in state.values()
                        if isinstance(v, torch.Tensor))


def engine_stats(flats: list[FlatParam], optimizer: torch.optim.Optimizer, module: nn.Module, offload: bool,
                 peak_temporary: int, largest_bucket: int) -> dict[str, int]:
    """Engine.memory_stats(): the sum over the flat buffers' own accounts, by category, and by
    place: device + host + disk = model_states + buffers + temporary + transfer."""
    held: Counter = Counter()
    for flat in flats:
        held.update(buffer_bytes(flat))
    # The paper's K counts the fp32 master copy with the optimizer state (K = 12 for Adam).
    optim = optimizer_state_bytes(optimizer) + held["master"]
    stats = {"params": held["params"], "grads": held["grads"], "optimizer": optim,
             "buffers": tensor_bytes(module.buffers()), "temporary": held["temporary"]}
    stats["model_states"] = stats["params"] + stats["grads"] + stats["optimizer"]
    stats["grads_in_step"] = held["grads_in_step"]
    stats["model_states_in_step"] = stats["params"] + stats["grads_in_step"] + stats["optimizer"]
    stats["offloaded"] = optim if offload else 0  # the optimizer's, held in host memory
    # By place: offloaded states, and the buffers they travel through, are in host memory, or in
    # files with disk offload (whose step streams through host buffers of its own); the rest is
    # on the process group's device (which, on a CPU group, is host memory too).
    states = (v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))
    stats["disk"] = held["disk"] + tensor_bytes(v for v in states if on_disk(v))
    stats["transfer"] = held["transfer"] + _disk_buffers(flats)
    stats["host"] = stats["offloaded"] + held["params_on_host"] + stats["transfer"] - stats["disk"]
    stats["device"] = stats["model_states"] + stats["buffers"] + stats["temporary"] \
        - stats["offloaded"] - held["params_on_host"]
    stats["peak_temporary"] = max(peak_temporary, stats["temporary"])
    stats["largest_bucket"] = largest_bucket
    return stats
