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
from .sections import DTYPES, ConfigError, OptimizerConfig, ScalerConfig, Settings, ZeroConfig

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
        cfg = cls(raw=dict(raw))
        for key, value in raw.items():
            if key in TOP_LEVEL:
                TOP_LEVEL[key](cfg, value)
            elif key in NOT_IMPLEMENTED_TOP:
                if not accept_no_op("", key, value):
                    raise ConfigError(f"config key '{key}' is a DeepSpeed key that zeroshard does not "
                                      f"implement yet; remove it")
            else:
                raise ConfigError(f"unknown config key '{key}'; accepted top-level keys: "
                                  f"{', '.join(sorted(TOP_LEVEL))}")
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
        check_nvme(cfg)
        return cfg


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
