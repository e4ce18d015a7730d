"""ZeRO-Infinity's disk offload: optimizer state and parameter shards resting in files.

`offload_optimizer: {"device": "nvme"}` (stages 1-3) keeps each fp32 master shard and its
elementwise optimizer states in files; the step streams them sub-group by sub-group through
`buffer_count` host buffers (stream.py). `offload_param: {"device": "nvme"}` (stage 3) keeps each
parameter shard in a file, read into the unit's buffer by its all-gather and written by the step;
up to `max_in_cpu` elements of shards stay cached in host memory (cache.py).
Both build on the host offload (offload/host.py): the same copies, with the host copy replaced by a file.

Invariant: open_store() is the only place that creates the directories, after every check
(rundir.py); whatever it opened, close() removes (engine teardown, exit, a failed initialize).
"""
from __future__ import annotations

import os
import weakref
from typing import Any

import torch
from torch import nn

from ...comm.collectives import Comm
from ...config import Config
from . import rundir
from .cache import ShardCache
from .rundir import set_free_space_probe
from .store import DiskStore
from .stream import SubGroupStream, stream_groups

__all__ = ["DiskStore", "open_store", "set_free_space_probe", "stream_groups", "io_stats", "tie"]


def state_tensors_per_element(probe: torch.optim.Optimizer | None) -> int:
    """How many elementwise states the optimizer keeps per parameter (Adam: 2, SGD with momentum:
    1), found by stepping a copy of it over one element; 2 if it cannot be probed."""
    try:
        p = probe.param_groups[0]["params"][0]
        p.grad = torch.zeros_like(p)
        probe.step()
        return sum(1 for v in probe.state[p].values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape == p.shape)
    except Exception:  # noqa: BLE001 - a probe, not the run: assume Adam's two
        return 2


def needed_bytes(config: Config, module: nn.Module, world_size: int, states: int) -> dict[str, int]:
    """nvme_path -> at most the bytes this rank writes there: fp32 masters and `states` optimizer
    states per owned trainable element, compute-dtype shards per owned element (an upper bound:
    each flat buffer pads its shard by less than one element per rank)."""
    params = list(dict.fromkeys(module.parameters()))
    trainable = [p for p in params if p.requires_grad]
    owned = lambda ps: -(-sum(p.numel() for p in ps) // world_size) + len(ps)  # noqa: E731
    needs: dict[str, int] = {}
    nv = config.nvme
    if nv.optimizer:
        needs[nv.optimizer_path] = needs.get(nv.optimizer_path, 0) + 4 * (1 + states) * owned(trainable)
    if nv.params:
        compute = torch.empty(0, dtype=config.dtype(None)).element_size()
        path = _param_path(config)
        needs[path] = needs.get(path, 0) + compute * owned(params)
    return needs


def _param_path(config: Config) -> str:
    """Where parameter shards go: the optimizer's nvme_path when both name one directory, however
    spelled (`/d` and `/d/.`), so they share one run directory and one free-space check."""
    nv = config.nvme
    same = nv.optimizer and os.path.realpath(nv.optimizer_path) == os.path.realpath(nv.param_path)
    return nv.optimizer_path if same else nv.param_path


def open_store(config: Config, comm: Comm, module: nn.Module, probe: torch.optim.Optimizer | None,
               host_empty: Any) -> DiskStore | None:
    """The rank's disk store when the config offloads to nvme, else None. Collective."""
    nv = config.nvme
    if not (nv.optimizer or nv.params):
        return None
    needs = needed_bytes(config, module, comm.world_size, state_tensors_per_element(probe))
    paths = rundir.prepare(needs, comm)
    dirs = {}
    if nv.optimizer:
        dirs["optimizer"] = paths[nv.optimizer_path]
    if nv.params:
        dirs["param"] = paths[_param_path(config)]
    store = DiskStore(dirs, nv.aio.get("block_size", 1 << 30))
    store.cache = ShardCache(nv.max_in_cpu if nv.params else 0)
    if nv.optimizer:
        store.stream = SubGroupStream(store, nv.buffer_count, host_empty, nv.aio.get("thread_count", 1))
    return store


def tie(owner: object, store: DiskStore | None) -> None:
    """Remove the store's files when `owner` (the engine) is collected, or at interpreter exit."""
    if store is not None:
        weakref.finalize(owner, store.close)


def io_stats(store: DiskStore | None) -> dict[str, Any]:
    """Bytes read from and written to disk: in the last step (since the previous optimizer step
    ended, the forward and backward's parameter reads included) and in total."""
    if store is None:
        zero = {"read": 0, "written": 0}
        return {"last_step": dict(zero), "total": dict(zero), "files": 0, "file_bytes": 0, "buffers": 0,
                "cached": 0, "cache_hits": 0, "cache_misses": 0}
    return store.stats()
