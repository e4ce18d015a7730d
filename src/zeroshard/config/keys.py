"""The rules for each DeepSpeed config key: its type, range and meaning, or a refusal by name.

Every accepted key sets a field of `Config`; an unknown key (usually a typo) lists the accepted
ones; a DeepSpeed key we have not built yet says so, so a config is never half-applied.
"""
from __future__ import annotations

from typing import Any, Callable

from .activation_keys import activations
from .noop_keys import accept_no_op
from .nvme_keys import NVME_KEYS, aio, nvme_key, set_device
from .optimizer_keys import optimizer
from .scheduler_keys import scheduler
from .sections import DTYPES, ConfigError, ScalerConfig, Settings, ZeroConfig, unknown_key
from .values import as_bool, as_dict, as_int, as_number, refuse_auto, refuse_true

# DeepSpeed keys that exist there but are not implemented here (yet): refused by name.
NOT_IMPLEMENTED_TOP = {
    "compression_training", "data_efficiency", "pipeline", "sparse_attention",
    "gradient_predivide_factor", "sparse_gradients", "dump_state", "data_types",
    "memory_breakdown", "seq_parallel_communication_data_type", "torch_autocast",
}
# DeepSpeed sections switched by "enabled" (off by default there): accepted while off, so a ported
# config needs no edit; on, refused by name.
_OFF_SECTIONS = ("amp", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comms_logger",
                 "autotuning", "elasticity")
_NOT_IMPLEMENTED_ZERO = {
    "cpu_offload", "round_robin_gradients", "elastic_checkpoint", "load_from_fp32_weights",
    "mics_hierarchical_params_gather",
    "ignore_unused_parameters",
    "legacy_stage1", "memory_efficient_linear", "use_multi_rank_bucket_allreduce",
    "pipeline_loading_checkpoint", "override_module_apply", "module_granularity_threshold",
    "log_trace_cache_warnings", "stage3_module_granularity_threshold",
}


# DeepSpeed zero_optimization keys whose effect zeroshard always has: gradients are always
# contiguous; saving always gathers full weights.
_COMPATIBLE: dict[str, Callable[[str, Any], Any]] = {
    "contiguous_gradients": as_bool,
    **dict.fromkeys(("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                     "gather_16bit_weights_on_model_save"), as_bool)}


def _zero(cfg: Settings, value: Any) -> None:
    z = cfg.zero
    for key, v in as_dict("zero_optimization", value).items():
        name = f"zero_optimization.{key}"
        if key == "stage":
            z.stage = as_int(name, v, 0)
            if z.stage > 3:
                raise ConfigError(f"config key '{name}' must be 0, 1, 2 or 3, got {v!r}")
        elif key in ("reduce_bucket_size", "allgather_bucket_size"):
            setattr(z, key, as_int(name, v, 1))
        elif key in ("stage3_prefetch_bucket_size", "stage3_max_reuse_distance"):  # null: the backend's
            setattr(z, key, None if v is None else as_int(name, v, 0))
        elif key in ("stage3_param_persistence_threshold", "stage3_max_live_parameters"):
            setattr(z, key, as_int(name, v, 0))
        elif key == "sub_group_size":
            z.sub_group_size = as_int(name, v, 1)
        elif key == "mics_shard_size":  # DeepSpeed's -1 (or 0): off
            z.mics_shard_size = as_int(name, v, -1)
            if z.mics_shard_size == 0:
                z.mics_shard_size = -1
        elif key == "zero_hpz_partition_size":  # ZeRO++ hpZ (1: off)
            z.zero_hpz_partition_size = as_int(name, v, 1)
        elif key in ("zero_quantized_weights", "zero_quantized_gradients"):  # ZeRO++ qwZ, qgZ
            setattr(z, key, as_bool(name, v))
        elif key in _COMPATIBLE:  # checked, with nothing to change here (docs/configuration.md)
            _COMPATIBLE[key](name, v)
        elif key == "offload_optimizer":
            _offload(cfg, v, "offload_optimizer")
        elif key == "offload_param":
            _offload(cfg, v, "offload_param")
        elif key == "overlap_comm":
            z.overlap_comm = as_bool(name, v)
        elif key in ("reduce_scatter", "allgather_partitions"):
            if not as_bool(name, v):
                raise ConfigError(f"config key '{name}': false is not supported (it replaces the "
                                  f"reduce-scatter/all-gather pair with more traffic); set it to true")
        elif key in _NOT_IMPLEMENTED_ZERO:
            if not accept_no_op("zero_optimization", key, v):
                raise ConfigError(f"config key '{name}' is a DeepSpeed key that zeroshard does not "
                                  f"implement yet; remove it")
        else:
            accepted = [f for f in ZeroConfig.__dataclass_fields__ if not f.startswith("offload_")]
            accepted += ["offload_optimizer", "offload_param", *_COMPATIBLE]
            raise unknown_key(name, accepted)


def _enable_precision(cfg: Settings, name: str, enabled: Any) -> None:
    if as_bool(f"{name}.enabled", enabled):
        if cfg.precision not in ("fp32", name):
            raise ConfigError("config enables both fp16 and bf16; enable one of them")
        cfg.precision = name


# key -> its rule. 2**127 is near the largest fp32 value: a larger initial scale would overflow every
# gradient (and 2**1024 is no Python float). A minimum scale of 0 would let the scale halve down to
# 0.0 over a long run of overflows, then divide by it.
_FP16_KEYS: dict[str, Callable[[str, Any], float]] = {
    "loss_scale": lambda key, v: as_number(key, v, 0.0, note="(0: dynamic)"),
    "initial_scale_power": lambda key, v: as_int(key, v, 0, 127),
    "loss_scale_window": lambda key, v: as_int(key, v, 1),
    "hysteresis": lambda key, v: as_int(key, v, 1),
    "min_loss_scale": lambda key, v: as_number(key, v, 0.0, above=True),
}


def _fp16(cfg: Settings, value: Any) -> None:
    section = as_dict("fp16", value)
    scaler = ScalerConfig()
    for key, v in section.items():
        if key == "enabled" or accept_no_op("fp16", key, v):
            continue
        if key not in _FP16_KEYS:
            _refuse(f"fp16.{key}", _NOT_IMPLEMENTED_FP16, ["enabled", *_FP16_KEYS])
        setattr(scaler, key, _FP16_KEYS[key](f"fp16.{key}", v))
    if scaler.loss_scale == 0 and scaler.min_loss_scale > 2.0 ** scaler.initial_scale_power:
        raise ConfigError(f"config key 'fp16.min_loss_scale' ({scaler.min_loss_scale:g}) is above the "
                          f"initial dynamic loss scale 2**{scaler.initial_scale_power}: the first overflow "
                          f"would stop training; lower min_loss_scale or raise initial_scale_power")
    _enable_precision(cfg, "fp16", section.get("enabled", False))
    if cfg.precision == "fp16":
        cfg.scaler = scaler


def _bf16(cfg: Settings, value: Any) -> None:
    section = as_dict("bf16", value)
    for key, v in section.items():
        if key != "enabled" and not accept_no_op("bf16", key, v):
            _refuse(f"bf16.{key}", set(), ["enabled"])
    _enable_precision(cfg, "bf16", section.get("enabled", False))


def _communication_dtype(cfg: Settings, value: Any) -> None:
    refuse_auto("communication_data_type", value)
    if not isinstance(value, str) or value not in DTYPES:
        raise ConfigError(f"config key 'communication_data_type' must be one of {', '.join(DTYPES)}, "
                          f"got {value!r}")
    cfg.communication_data_type = value


def _refuse(name: str, deepspeed_keys: set[str], accepted: list[str]) -> None:
    key = name.rpartition(".")[2]
    if key in deepspeed_keys:
        raise ConfigError(f"config key '{name}' is a DeepSpeed key that zeroshard does not implement yet; "
                          f"remove it")
    raise unknown_key(name, accepted)


_NOT_IMPLEMENTED_FP16 = {"consecutive_hysteresis", "auto_cast", "fp16_master_weights_and_grads"}


def _set_int(attr: str, minimum: int) -> Callable[[Settings, Any], None]:
    def apply(cfg: Settings, value: Any) -> None:
        setattr(cfg, attr, as_int(attr, value, minimum))
    return apply


def _clipping(cfg: Settings, value: Any) -> None:
    cfg.gradient_clipping = as_number("gradient_clipping", value, 0.0, note="(0: off)")


_NVME_KEYS = {"fast_init", "ratio", "pipeline_read", "pipeline_write", "pipeline"}  # DeepSpeed's, not built


def _offload(cfg: Settings, value: Any, section: str) -> None:
    """offload_optimizer / offload_param: {"device": "cpu" | "nvme" | "none", "pin_memory": bool, and
    the disk offload's keys (nvme_keys.py)}."""
    pin = "offload_pin_memory" if section == "offload_optimizer" else "offload_param_pin_memory"
    keys = as_dict(f"zero_optimization.{section}", value)
    if keys and "device" not in keys:  # DeepSpeed reads it as "none": settings for an offload that never runs
        raise ConfigError(f"config key 'zero_optimization.{section}' sets {', '.join(sorted(keys))} but no "
                          f"'device', so nothing would be offloaded; add \"device\": \"cpu\" (or \"nvme\"), "
                          f"or \"none\" to keep it on the device")
    for key, v in keys.items():
        name = f"zero_optimization.{section}.{key}"
        if key == "device":
            refuse_auto(name, v)
            if v not in ("cpu", "nvme", "none"):
                raise ConfigError(f"config key '{name}' must be \"cpu\", \"nvme\" or \"none\", got {v!r}")
            setattr(cfg.zero, section, v != "none")  # nvme: the host offload, its states resting in files
            set_device(cfg, section, v == "nvme")
        elif key == "pin_memory":
            setattr(cfg.zero, pin, as_bool(name, v))
        elif key in NVME_KEYS[section]:
            nvme_key(cfg, section, key, v)
        elif not accept_no_op(f"zero_optimization.{section}", key, v):
            _refuse(name, _NVME_KEYS, ["device", "pin_memory", *NVME_KEYS[section]])


def _off_section(name: str) -> Callable[[Settings, Any], None]:
    def check(cfg: Settings, value: Any) -> None:
        if as_bool(f"{name}.enabled", as_dict(name, value).get("enabled", False)):
            raise ConfigError(f"config key '{name}.enabled': true is a DeepSpeed feature that zeroshard does "
                              f"not implement yet; set it to false or remove the section")
    return check


def _accepted(name: str) -> Callable[[Settings, Any], None]:
    """zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer: zeroshard takes any elementwise
    torch optimizer, and offload steps torch's own (fused) one on the host, whatever they say."""
    def check(cfg: Settings, value: Any) -> None:
        as_bool(name, value)
    return check


def _checkpoint(cfg: Settings, value: Any) -> None:
    """DeepSpeed's `checkpoint` section: what holds here anyway is accepted. Tags are compared
    across ranks whatever tag_validation says (a save on some ranks only is a DivergenceError)."""
    for key, v in as_dict("checkpoint", value).items():
        name = f"checkpoint.{key}"
        if key == "tag_validation":
            if not isinstance(v, str) or v.lower() not in ("ignore", "warn", "fail"):
                raise ConfigError(f"config key '{name}' must be \"Ignore\", \"Warn\" or \"Fail\", got {v!r}")
        elif key in ("load_universal", "use_node_local_storage"):
            refuse_true(name, v, "zeroshard's checkpoints load at any world size and stage as they are"
                        if key == "load_universal" else "every rank writes into the one directory")
        else:
            _refuse(name, {"parallel_write"}, ["tag_validation", "load_universal", "use_node_local_storage"])


def _wall_clock(cfg: Settings, value: Any) -> None:
    refuse_true("wall_clock_breakdown", value, "no timers are kept")


_ZEROSHARD_KEYS = ["check_collectives", "collective_timeout", "defer_param_gather", "delayed_param_update",
                   "offload_casts", "on_nonfinite", "pipelined_update", "quantized_gradient_bits",
                   "ranks_per_node", "release_host_memory", "unit_modules"]


def _zeroshard(cfg: Settings, value: Any) -> None:
    for key, v in as_dict("zeroshard", value).items():
        name = f"zeroshard.{key}"
        if key in ("defer_param_gather", "delayed_param_update"):
            setattr(cfg, key, as_bool(name, v))
        elif key == "quantized_gradient_bits":  # ZeRO++ qgZ's codes: int4 (as ZeRO++) or int8
            cfg.quantized_gradient_bits = _choice(name, v, (4, 8))
        elif key == "ranks_per_node":  # the node topology (comm/topology.py); else torchrun's
            cfg.ranks_per_node = as_int(name, v, 1)
        elif key == "pipelined_update":  # "auto": where it changes nothing a user sees (see Config)
            cfg.pipelined_update = None if v == "auto" else as_bool(name, v)
        elif key == "release_host_memory":  # "auto": on a CPU device (core/heap.py)
            cfg.release_host_memory = None if v == "auto" else as_bool(name, v)
        elif key == "unit_modules":
            cfg.unit_modules = _unit_modules(v)
        elif key == "check_collectives":  # true: every step; an integer K: every K steps
            refuse_auto(name, v)
            ok = isinstance(v, int) and not isinstance(v, bool) and v >= 0
            if not (isinstance(v, bool) or ok):
                raise ConfigError(f"config key '{name}' must be true, false or a number of steps >= 0, "
                                  f"got {v!r}")
            cfg.check_collectives = int(v)
        elif key == "collective_timeout":  # at most ~31 years: a timedelta holds it
            cfg.collective_timeout = as_number(name, v, 0.0, above=True, maximum=1e9, note="seconds")
        elif key == "on_nonfinite":
            cfg.on_nonfinite = _choice(name, v, ("raise", "skip"))
        elif key == "offload_casts":  # where an offloaded gradient and update change dtype
            cfg.offload_casts = _choice(name, v, ("host", "device"))
        else:
            raise unknown_key(name, _ZEROSHARD_KEYS)


def _choice(name: str, v: Any, choices: tuple[str, ...]) -> str:
    refuse_auto(name, v)
    if v not in choices:
        raise ConfigError(f"config key '{name}' must be {' or '.join(repr(c) for c in choices)}, got {v!r}")
    return v


def _unit_modules(v: Any) -> list[str] | None:
    if v == "auto":
        return None
    if isinstance(v, list) and v and all(isinstance(s, str) for s in v):
        return list(v)
    raise ConfigError(f"config key 'zeroshard.unit_modules' must be \"auto\" or a non-empty list "
                      f"of module class names, got {v!r}")


TOP_LEVEL: dict[str, Callable[[Settings, Any], None]] = {
    "zero_optimization": _zero,
    "aio": aio,
    "optimizer": optimizer,
    "scheduler": scheduler,
    "train_batch_size": _set_int("train_batch_size", 1),
    "train_micro_batch_size_per_gpu": _set_int("train_micro_batch_size_per_gpu", 1),
    "gradient_accumulation_steps": _set_int("gradient_accumulation_steps", 1),
    "gradient_clipping": _clipping,
    "steps_per_print": _set_int("steps_per_print", 0),
    "wall_clock_breakdown": _wall_clock,
    "prescale_gradients": lambda cfg, v: refuse_true("prescale_gradients", v, "gradients are averaged "
                                                     "in the reduction"),
    "zero_allow_untested_optimizer": _accepted("zero_allow_untested_optimizer"),
    "zero_force_ds_cpu_optimizer": _accepted("zero_force_ds_cpu_optimizer"),
    "checkpoint": _checkpoint,
    **{name: _off_section(name) for name in _OFF_SECTIONS},
    "fp16": _fp16,
    "bf16": _bf16,
    "communication_data_type": _communication_dtype,
    "zeroshard": _zeroshard,
    "activation_checkpointing": activations,
}
