"""zeroshard: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch, stages 0-3.

    engine = zeroshard.initialize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
                                  config={"zero_optimization": {"stage": 3}})
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()
"""
from __future__ import annotations

import os

import torch.distributed as dist
from torch import nn

from .checkpoint import CheckpointError, consolidate
from .checkpoint import info as checkpoint_info
from .comm import Comm  # noqa: F401  (zeroshard.Comm: counted collectives, for scripts and benchmarks)
from .comm.devices import ensure_process_group
from .comm.over_ranks import gather_objects, mean_over_ranks, rank_and_world_size
from .comm.watch import DivergenceError
from .config import Config, ConfigError
from .construct import init, is_deferred, materialize
from .core.memory import optimizer_state_bytes, tensor_bytes
from .core.nonfinite import NonFiniteError
from .core.optim import OptimizerSpec
from .core.schedules import DeepSpeedSchedule
from .engine.checks import ModelMismatchError
from .engine.engine import Engine
from .integrations.hf import patches as _hf_patches  # noqa: F401  (registers its model patches)
from .paper import paper_model_state_bytes
from .parallel import split as _split_mesh
from .parallel import tensor_parallel

__all__ = ["initialize", "init", "materialize", "is_deferred", "consolidate", "checkpoint_info", "Config",
           "ConfigError", "CheckpointError", "DivergenceError", "NonFiniteError", "Engine",
           "ModelMismatchError", "paper_model_state_bytes", "ensure_process_group", "rank_and_world_size",
           "mean_over_ranks", "gather_objects", "tensor_bytes", "optimizer_state_bytes", "tensor_parallel",
           "DeepSpeedSchedule"]
__version__ = "0.1.0"


def initialize(model: nn.Module, optimizer: OptimizerSpec = None,
               config: "Config | dict | str | os.PathLike | None" = None,
               process_group: dist.ProcessGroup | None = None,
               param_groups: list[dict] | None = None, lr_scheduler=None, mesh=None) -> Engine:
    """Wrap `model` for ZeRO data parallelism over `process_group` (default: the world), or over
    mesh["dp"] of a DeviceMesh named ("dp", "tp") whose "tp" dimension the model was already split
    over (zeroshard.tensor_parallel or torch's parallelize_module); a 1-D mesh is data parallelism.

    optimizer: a callable `params -> torch.optim.Optimizer`, an Optimizer class, or None to use the
    config's DeepSpeed-style "optimizer" section. param_groups: optional torch-style groups over the
    model's parameters (e.g. no weight decay for biases); each becomes its own set of flat shards.
    lr_scheduler: optional scheduler, or callable optimizer -> scheduler, stepped by the engine
    after each optimizer step that was not skipped, and saved in checkpoints.
    Without a process group, one is started from torchrun's variables, or as a single process.
    """
    cfg = Config.load(config)
    axes = _split_mesh(mesh, process_group)
    if process_group is None and mesh is None:
        ensure_process_group(timeout_s=cfg.collective_timeout)  # NCCL's waits are not bounded otherwise
    return Engine(model, optimizer, cfg, axes, param_groups, lr_scheduler)
