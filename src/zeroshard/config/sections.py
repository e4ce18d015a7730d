"""The config's sections as typed values, and the names it accepts (dtypes, optimizers).

Plain data with no behaviour of its own: the rules that fill these from a dict are in keys.py, the
loading in config/__init__.py. Nothing here imports from zeroshard.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch


class ConfigError(ValueError):
    """A config value zeroshard cannot honour; the message names the key and what is accepted."""


def unknown_key(name: str, accepted: Iterable[str], what: str = "", listed: str = "accepted") -> ConfigError:
    """The error for a key no section takes (usually a typo): the accepted keys, and the nearest
    of them as "did you mean". `name` is the key's full dotted name."""
    accepted, name = list(accepted), str(name)  # (a JSON-like dict may have any key)
    prefix, _, key = name.rpartition(".")
    near = difflib.get_close_matches(key, accepted, n=1, cutoff=0.6)
    hint = f"; did you mean '{prefix + '.' if prefix else ''}{near[0]}'?" if near else ""
    return ConfigError(f"unknown config key '{name}'{what}{hint} ({listed}: {', '.join(accepted)})")


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

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
    stage3_prefetch_bucket_size: int | None = None  # elements prefetched ahead; None: the backend's
    stage3_max_live_parameters: int = 1_000_000_000  # no prefetch past this many gathered elements
    stage3_max_reuse_distance: int | None = None  # units reused this near stay; None: the backend's
    sub_group_size: int = 100_000_000          # the step's owned elements at once (DeepSpeed's default: 1e9)
    overlap_comm: bool = True                  # on at every stage, as DDP overlaps (DeepSpeed: stage 3 only)
    reduce_scatter: bool = True
    allgather_partitions: bool = True
    offload_optimizer: bool = False            # master weights + optimizer state on the host
    offload_pin_memory: bool = False
    offload_param: bool = False                # stage 3: parameter shards at rest on the host
    offload_param_pin_memory: bool = False
    mics_shard_size: int = -1                  # MiCS: shard over groups of this many ranks (-1: the world)
    zero_hpz_partition_size: int = 1           # ZeRO++ hpZ: a secondary copy over this many ranks (1: off)
    zero_quantized_weights: bool = False       # ZeRO++ qwZ: forward all-gathers in int8 blocks
    zero_quantized_gradients: bool = False     # ZeRO++ qgZ: gradients reduced in int4 (or int8) blocks


@dataclass
class NvmeConfig:
    """`offload_*.device: "nvme"` (ZeRO-Infinity): which states rest in files, where, and the knobs of
    the streaming (DeepSpeed's names). The `aio` section is validated and kept; see nvme_keys.py."""

    optimizer: bool = False              # fp32 master shards + optimizer state in files
    params: bool = False                 # stage 3: parameter shards in files
    optimizer_path: str | None = None
    param_path: str | None = None
    buffer_count: int = 4                # host buffers the optimizer step streams sub-groups through
    param_buffer_count: int = 5          # offload_param.buffer_count (advisory)
    param_buffer_size: int = 100_000_000  # offload_param.buffer_size (advisory)
    max_in_cpu: int = 1_000_000_000      # offload_param: most elements cached in host memory
    aio: dict[str, Any] = field(default_factory=dict)


@dataclass
class OptimizerConfig:
    """`optimizer`: a torch.optim class by DeepSpeed-style name, with its keyword arguments."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)

    def build_class(self) -> Callable[..., torch.optim.Optimizer]:
        return OPTIMIZERS[self.type.lower()]


@dataclass
class ScalerConfig:
    """DeepSpeed's fp16 knobs. loss_scale 0 means dynamic, starting at 2**initial_scale_power."""

    loss_scale: float = 0.0
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    min_loss_scale: float = 1.0


@dataclass
class SchedulerConfig:
    """`scheduler`: one of DeepSpeed's warm-up schedules by name, with its params (schedules.py)."""

    type: str
    params: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActivationConfig:
    """`activation_checkpointing` (ZeRO-R): each unit (block) keeps only its input and recomputes in
    backward; the input is split over the tp ranks (P_a), kept on the host (P_a+cpu), and written
    into one buffer allocated once (MD)."""

    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: int | None = None      # checkpoints per forward, to size the MD buffer up front


@dataclass
class Settings:
    """Every setting, typed, with the defaults; keys.py fills them, Config loads and validates them."""

    zero: ZeroConfig = field(default_factory=ZeroConfig)
    nvme: NvmeConfig = field(default_factory=NvmeConfig)  # disk offload (ZeRO-Infinity)
    optimizer: OptimizerConfig | None = None
    train_batch_size: int | None = None
    train_micro_batch_size_per_gpu: int | None = None
    gradient_accumulation_steps: int = 1
    gradient_clipping: float = 0.0
    steps_per_print: int = 0                   # log a line every this many steps (0: never)
    precision: str = "fp32"                    # "fp32", "bf16" or "fp16" (from the bf16/fp16 sections)
    scaler: ScalerConfig | None = None         # fp16 loss scaling
    scheduler: SchedulerConfig | None = None   # a DeepSpeed lr schedule the engine builds and steps
    communication_data_type: str | None = None  # gradient reduction dtype; None: the compute dtype
    unit_modules: list[str] | None = None      # class names that become units; None: automatic
    defer_param_gather: bool = False           # stages 1-2: post-step all-gather behind the next forward
    delayed_param_update: bool = False         # offload: the host step overlaps the next forward/backward
    offload_casts: str = "host"                # offload: where 16-bit <-> fp32 casts happen (host, device)
    pipelined_update: bool | None = None       # offload: the update overlaps the next forward (None: auto)
    quantized_gradient_bits: int = 4           # ZeRO++ qgZ: int4 codes, or int8
    ranks_per_node: int | None = None          # the node topology; None: torchrun's (else one node)
    check_collectives: int = 0                 # compare ranks' collective histories every K steps (0: off)
    collective_timeout: float = 600.0          # seconds a collective may wait before the stall is diagnosed
    on_nonfinite: str = "raise"                # bf16/fp32: a NaN/inf gradient "raise"s or "skip"s the step
    release_host_memory: bool | None = None    # heap pages to the OS after a peak-raising step (None: CPU)
    activations: ActivationConfig | None = None  # None: no ZeRO-R activation checkpointing
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def stage(self) -> int:
        return self.zero.stage

    @property
    def overlap_comm(self) -> bool:
        return self.zero.overlap_comm

    @property
    def pipelined(self) -> bool:
        """Does the offloaded host update run pipelined with the next forward (core/pipeline.py)?
        Asked for, or "auto": where parameters are placeholders between step and forward anyway
        (stage 3; stages 1-2 with defer_param_gather), the model states are in host memory (not in
        files) and no delayed update runs."""
        if self.pipelined_update is not None:
            return self.pipelined_update
        on_disk = self.nvme.optimizer or self.nvme.params
        return self.zero.offload_optimizer and not self.delayed_param_update and not on_disk \
            and (self.stage == 3 or self.defer_param_gather)

    def dtype(self, name: str | None) -> torch.dtype:
        return DTYPES[name or self.precision]

    def check_batch_sizes(self, world_size: int) -> None:
        """DeepSpeed's rule: train_batch_size = micro batch x accumulation steps x world size. As in
        DeepSpeed, the two batch sizes without gradient_accumulation_steps set the accumulation."""
        tbs, micro = self.train_batch_size, self.train_micro_batch_size_per_gpu
        if tbs is not None and micro is not None and "gradient_accumulation_steps" not in self.raw:
            if tbs % (micro * world_size):
                raise ConfigError(f"train_batch_size={tbs} is not a whole number of micro-batches: "
                                  f"train_micro_batch_size_per_gpu={micro} x world size {world_size} "
                                  f"= {micro * world_size} samples each; fix one of them")
            self.gradient_accumulation_steps = tbs // (micro * world_size)
            return
        gas = self.gradient_accumulation_steps
        if tbs is not None and micro is not None and tbs != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size={tbs} != train_micro_batch_size_per_gpu={micro} x "
                f"gradient_accumulation_steps={gas} x world size {world_size} "
                f"(= {micro * gas * world_size}); "
                f"fix one of them, or give only one of the two batch sizes")
        if tbs is not None and micro is None and tbs % (gas * world_size):
            raise ConfigError(f"train_batch_size={tbs} is not divisible by gradient_accumulation_steps={gas} "
                              f"x world size {world_size}")
