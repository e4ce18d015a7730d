"""Config: DeepSpeed-compatible keys, validated up front with errors that name the key and the fix.

A DeepSpeed user's JSON works as-is when it uses keys we implement. Every other key is refused by
name: an unknown key (usually a typo) lists the accepted ones; a DeepSpeed key we have not built yet
says so, so a config is never half-applied.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from .precision import ScalerConfig


class ConfigError(ValueError):
    """A config value zeroshard cannot honour; the message names the key and what is accepted."""


_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

OPTIMIZERS: dict[str, Callable[..., torch.optim.Optimizer]] = {
    "adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
    "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop, "adamax": torch.optim.Adamax,
    "nadam": torch.optim.NAdam, "radam": torch.optim.RAdam, "adadelta": torch.optim.Adadelta,
}


@dataclass
class ZeroConfig:
    """`zero_optimization`: which model states are sharded, and communication granularity."""

    stage: int = 0
    reduce_bucket_size: int = 500_000_000      # max elements one gradient collective moves
    allgather_bucket_size: int = 500_000_000   # max elements one parameter all-gather moves
    stage3_param_persistence_threshold: int = 0  # units this small stay gathered (stage 3)
    stage3_prefetch_bucket_size: int | None = None  # elements prefetched ahead; None: the next unit
    stage3_max_live_parameters: int = 1_000_000_000  # no prefetch past this many gathered elements
    contiguous_gradients: bool = True          # always true here: gradients live in flat buffers
    overlap_comm: bool | None = None          # None: on at stage 3 only, as in DeepSpeed
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    offload_optimizer: bool = False            # master weights + optimizer state on the host
    offload_pin_memory: bool = False


@dataclass
class OptimizerConfig:
    """`optimizer`: a torch.optim class by DeepSpeed-style name, with its keyword arguments."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)

    def build_class(self) -> Callable[..., torch.optim.Optimizer]:
        return OPTIMIZERS[self.type.lower()]


@dataclass
class Config:
    """A validated zeroshard configuration. Build it with `Config.load(dict | path | Config)`."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    optimizer: OptimizerConfig | None = None
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    steps_per_print: int = 0                   # log a line every this many steps (0: never)
    precision: str = "fp32"                    # "fp32", "bf16" or "fp16" (from the bf16/fp16 sections)
    scaler: ScalerConfig | None = None         # fp16 loss scaling
    communication_data_type: str | None = None  # gradient reduction dtype; None: the compute dtype
    unit_modules: list[str] | None = None      # class names that become units; None: automatic
    defer_param_gather: bool = False           # stages 1-2: post-step all-gather behind the next forward
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def overlap_comm(self) -> bool:
        return self.zero.overlap_comm if self.zero.overlap_comm is not None else self.zero.stage == 3

    @classmethod
    def load(cls, source: "Config | dict | str | os.PathLike | None") -> "Config":
        if source is None:
            return cls()
        if isinstance(source, Config):
            return source
        if isinstance(source, (str, os.PathLike)):
            return cls.from_dict(_read_json(os.fspath(source)))
        if isinstance(source, dict):
            return cls.from_dict(source)
        raise ConfigError(f"config must be a dict, a path to a JSON file or a zeroshard.Config, "
                          f"got {type(source).__name__}")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        from .config_keys import _NOT_IMPLEMENTED_TOP, _TOP_LEVEL  # the per-key rules
        cfg = cls(raw=dict(raw))
        for key, value in raw.items():
            if key in _TOP_LEVEL:
                _TOP_LEVEL[key](cfg, value)
            elif key in _NOT_IMPLEMENTED_TOP:
                raise ConfigError(f"config key '{key}' is a DeepSpeed key that zeroshard does not "
                                  f"implement yet; remove it")
            else:
                raise ConfigError(f"unknown config key '{key}'; accepted top-level keys: "
                                  f"{', '.join(sorted(_TOP_LEVEL))}")
        if cfg.defer_param_gather and cfg.stage not in (1, 2):
            raise ConfigError(f"zeroshard.defer_param_gather applies to stages 1 and 2 (the post-step "
                              f"all-gather), not to stage {cfg.stage}; remove it")
        if cfg.zero.offload_optimizer and cfg.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1 "
                              "(it offloads the optimizer's shard); raise the stage or remove it")
        return cfg

    def dtype(self, name: str | None) -> torch.dtype:
        return _DTYPES[name or self.precision]

    def check_batch_sizes(self, world_size: int) -> None:
        """DeepSpeed's rule: train_batch_size = micro batch x accumulation steps x world size."""
        tbs, micro, gas = self.train_batch_size, self.train_micro_batch_size_per_gpu, self.gradient_accumulation_steps
        if tbs is not None and micro is not None and tbs != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size={tbs} != train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={gas} x world size {world_size} (= {micro * gas * world_size}); "
                f"fix one of them, or give only one of the two batch sizes")
        if tbs is not None and micro is None and tbs % (gas * world_size):
            raise ConfigError(f"train_batch_size={tbs} is not divisible by gradient_accumulation_steps={gas} "
                              f"x world size {world_size}")


def _read_json(path: str) -> dict[str, Any]:
    if not os.path.isfile(path):
        raise ConfigError(f"config file '{path}' does not exist")
    try:
        with open(path) as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise ConfigError(f"config file '{path}' is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file '{path}' must hold a JSON object, got {type(data).__name__}")
    return data
