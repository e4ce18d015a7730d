"""`zeroshard.initialize`: the one way in. The config loaded and checked, the process group started
where the script has none, the mesh read, then an Engine built over it."""
from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from ..comm.devices import ensure_process_group
from ..comm.topology import check_mics, read_topology
from ..config import Config, ConfigError
from ..core.optim import OptimizerSpec
from ..parallel import mics_mesh, split as split_mesh
from .engine import Engine


# deepspeed.initialize()'s arguments that have no counterpart here, and what to do instead.
_DEEPSPEED_ONLY = {
    "args": "give the config itself: config= a dict or a JSON file's path",
    "config_params": "give it as config=",
    "training_data": "build your own DataLoader (each rank its own slice: DistributedSampler)",
    "collate_fn": "build your own DataLoader (each rank its own slice: DistributedSampler)",
    "mpu": "give a (\"dp\", \"tp\") DeviceMesh as mesh=",
    "dist_init_required": "a process group is started from torchrun's variables where there is none",
}


def initialize(model: nn.Module, optimizer: OptimizerSpec = None,
               config: "Config | dict | str | os.PathLike | None" = None,
               process_group: dist.ProcessGroup | None = None,
               param_groups: list[dict] | None = None, lr_scheduler=None, mesh=None, *,
               model_parameters=None, **deepspeed_only) -> Engine:
    """Wrap `model` for ZeRO data parallelism over `process_group` (default: the world), or over
    mesh["dp"] of a DeviceMesh named ("dp", "tp") whose "tp" dimension the model was already split
    over (zeroshard.tensor_parallel or torch's parallelize_module); a 1-D mesh is data parallelism.
    A mesh named ("replicate", "shard"), or zero_optimization.mics_shard_size, shards within
    mesh["shard"] and keeps the copies alike over mesh["replicate"] (MiCS / HSDP).

    optimizer: a callable `params -> torch.optim.Optimizer`, an Optimizer class, or None to use the
    config's DeepSpeed-style "optimizer" section. param_groups: optional torch-style groups over the
    model's parameters (e.g. no weight decay for biases); each becomes its own set of flat shards.
    lr_scheduler: optional callable optimizer -> scheduler (a scheduler class, or a lambda; not an
    instance, which was built over another optimizer), stepped by the engine after each optimizer
    step that was not skipped, and saved in checkpoints.
    Without a process group, one is started from torchrun's variables, or as a single process.
    model_parameters: DeepSpeed's name for param_groups. Returns the engine alone (not DeepSpeed's
    4-tuple: the optimizer is engine.optimizer, the scheduler engine.lr_scheduler).
    """
    for name in deepspeed_only:
        hint = _DEEPSPEED_ONLY.get(name)
        raise TypeError(f"initialize() got an unexpected keyword argument '{name}'"
                        + (f" (deepspeed.initialize's; here: {hint})" if hint else ""))
    if model_parameters is not None:
        if param_groups is not None:
            raise TypeError("initialize(): give param_groups or model_parameters (DeepSpeed's name for "
                            "it), not both")
        param_groups = model_parameters
    cfg = Config.load(config)
    shard_size = cfg.zero.mics_shard_size
    if shard_size > 0 and (mesh is not None or process_group is not None):
        raise ConfigError(f"zero_optimization.mics_shard_size {shard_size} builds its own (\"replicate\", "
                          f"\"shard\") mesh over the world, but initialize() was also given "
                          f"{'mesh=' if mesh is not None else 'process_group='}; pass one of them")
    axes = split_mesh(mesh, process_group)
    if process_group is None and mesh is None:
        ensure_process_group(timeout_s=cfg.collective_timeout)  # NCCL's waits are not bounded otherwise
    if shard_size > 0:  # checked first: building the mesh is the first collective
        world = dist.get_world_size()
        check_mics(shard_size, read_topology(cfg.ranks_per_node, dist.get_rank(), world), world)
        axes = split_mesh(mics_mesh(shard_size), None)
    return Engine(model, optimizer, cfg, axes, param_groups, lr_scheduler)
