"""Config: DeepSpeed-compatible keys, validated up front with errors that name the key and the fix.

A DeepSpeed user's JSON works as-is when it uses keys we implement. Every other key is refused by
name: an unknown key (usually a typo) lists the accepted ones; a DeepSpeed key we have not built yet
says so, so a config is never half-applied.

May import: nothing of zeroshard (config sits beneath every floor but common).
"""
from __future__ import annotations

import json
import os
from typing import Any

from .keys import NOT_IMPLEMENTED_TOP, TOP_LEVEL
from .noop_keys import accept_no_op
from .nvme_keys import check as check_nvme
from .values import refuse_placeholders
from .sections import (DTYPES, ConfigError, OptimizerConfig, ScalerConfig, Settings, ZeroConfig,
                       unknown_key)

__all__ = ["Config", "ConfigError", "OptimizerConfig", "ScalerConfig", "Settings", "ZeroConfig", "DTYPES"]


class Config(Settings):
    """A validated zeroshard configuration. Build it with `Config.load(dict | path | Config)`."""

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

    @staticmethod
    def read(source: "dict | str | os.PathLike") -> dict[str, Any]:
        """A config's keys (a JSON file's, or a copy of a dict's), not yet validated: a launcher merges
        its command-line values in (the stage, say) before `load` validates the whole, so the config is
        judged as it will run."""
        return dict(source) if isinstance(source, dict) else _read_json(os.fspath(source))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "Config":
        if "model_type" in raw or "architectures" in raw:  # (a mix-up, named as one: not 'unknown key')
            raise ConfigError(f"this is a Hugging Face model config (model_type "
                              f"{raw.get('model_type', '?')!r}), not a training config: give it as "
                              f"--hf-config to `zeroshard train` or `zeroshard plan`, and as --config a "
                              f"DeepSpeed-style JSON (zero_optimization, bf16, optimizer, ...)")
        refuse_placeholders(raw)
        cfg = cls(raw=dict(raw))
        for key, value in raw.items():
            if key in TOP_LEVEL:
                TOP_LEVEL[key](cfg, value)
            elif key in NOT_IMPLEMENTED_TOP:
                if not accept_no_op("", key, value):
                    raise ConfigError(f"config key '{key}' is a DeepSpeed key that zeroshard does not "
                                      f"implement yet; remove it")
            else:
                raise unknown_key(key, sorted(TOP_LEVEL), listed="accepted top-level keys")
        if cfg.defer_param_gather and cfg.stage not in (1, 2):
            raise ConfigError(f"zeroshard.defer_param_gather applies to stages 1 and 2 (the post-step "
                              f"all-gather), not to stage {cfg.stage}; remove it")
        if cfg.zero.offload_optimizer and cfg.stage == 0:
            raise ConfigError("zero_optimization.offload_optimizer needs zero_optimization.stage >= 1 "
                              "(it offloads the optimizer's shard); raise the stage or remove it")
        if cfg.zero.offload_param and cfg.stage != 3:
            raise ConfigError(f"zero_optimization.offload_param needs zero_optimization.stage 3 (only "
                              f"stage 3 shards parameters), got stage {cfg.stage}; set the stage to 3 "
                              f"or remove offload_param")
        if cfg.zero.offload_optimizer and cfg.optimizer and cfg.optimizer.params.get("capturable"):
            raise ConfigError("config key 'optimizer.params.capturable' needs the optimizer step on a GPU, "
                              "but zero_optimization.offload_optimizer runs it on the host; set capturable "
                              "to false or remove offload_optimizer")
        if cfg.delayed_param_update and not cfg.zero.offload_optimizer:
            raise ConfigError("zeroshard.delayed_param_update overlaps the host optimizer step with the "
                              "next forward and backward: it needs zero_optimization.offload_optimizer "
                              "{\"device\": \"cpu\"}; add it or remove delayed_param_update")
        if cfg.pipelined_update:
            _check_pipelined(cfg)
        if cfg.zero.mics_shard_size > 0 and cfg.stage == 0:
            raise ConfigError(f"zero_optimization.mics_shard_size {cfg.zero.mics_shard_size} shards model "
                              f"states within groups of that many ranks, but stage 0 shards nothing; set "
                              f"zero_optimization.stage to 1, 2 or 3, or remove mics_shard_size")
        if cfg.offload_casts != "host" and not cfg.zero.offload_optimizer:
            raise ConfigError(f"zeroshard.offload_casts {cfg.offload_casts!r} says where an offloaded step "
                              f"converts dtypes, but zero_optimization.offload_optimizer is off; add it or "
                              f"remove offload_casts")
        _check_zeropp(cfg)
        check_nvme(cfg)
        return cfg


def _check_zeropp(cfg: Config) -> None:
    """ZeRO++'s keys: stage 3 only (they change stage 3's gathers and reduce-scatter), not with MiCS,
    and qgZ not with fp16 loss scaling."""
    z = cfg.zero
    used = [k for k, on in (("zero_hpz_partition_size", z.zero_hpz_partition_size > 1),
                            ("zero_quantized_weights", z.zero_quantized_weights),
                            ("zero_quantized_gradients", z.zero_quantized_gradients)) if on]
    if used and cfg.stage != 3:
        raise ConfigError(f"zero_optimization.{used[0]} is ZeRO++, which changes stage 3's parameter "
                          f"gathers and gradient reduction; set zero_optimization.stage to 3 (got "
                          f"{cfg.stage}) or remove {used[0]}")
    if used and z.mics_shard_size > 0:
        raise ConfigError(f"zero_optimization.{used[0]} (ZeRO++) with mics_shard_size: choose one way to "
                          f"keep traffic inside nodes (MiCS or ZeRO++), not both")
    if z.zero_quantized_gradients and cfg.precision == "fp16":
        raise ConfigError("zero_optimization.zero_quantized_gradients with fp16 is not supported: int4 "
                          "blocks of fp16 gradients scaled up by the loss scaler lose the small values the "
                          "scaler exists to keep; use bf16, or remove zero_quantized_gradients")
    if cfg.quantized_gradient_bits != 4 and not z.zero_quantized_gradients:
        raise ConfigError("zeroshard.quantized_gradient_bits sets qgZ's codes, but "
                          "zero_optimization.zero_quantized_gradients is off; add it or remove the bits")


def _check_pipelined(cfg: Config) -> None:
    """zeroshard.pipelined_update true: what it needs."""
    needs = "it overlaps the host's optimizer step with the next forward"
    if not cfg.zero.offload_optimizer:
        raise ConfigError(f"zeroshard.pipelined_update: {needs}, so it needs zero_optimization."
                          f"offload_optimizer {{\"device\": \"cpu\"}}; add it or remove pipelined_update")
    if cfg.delayed_param_update:
        raise ConfigError("zeroshard.pipelined_update and zeroshard.delayed_param_update both overlap the "
                          "host update with the next step (pipelined: exactly; delayed: one update late); "
                          "choose one")
    if cfg.nvme.optimizer or cfg.nvme.params:
        raise ConfigError("zeroshard.pipelined_update needs the model states in host memory, but an "
                          "offload device is \"nvme\" (its step streams them through files); remove "
                          "pipelined_update or offload to \"cpu\"")


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
