"""The config's "optimizer" section: a torch optimizer by DeepSpeed-style name, its keyword
arguments checked at load (types torch would only refuse at construction or the first step), and
"Adam"/"AdamW" given the meaning DeepSpeed gives them."""
from __future__ import annotations

import math
import numbers
from typing import Any

import torch

from .sections import OPTIMIZERS, ConfigError, OptimizerConfig, Settings, unknown_key
from .values import as_bool, as_dict, as_number, refuse_auto


def optimizer(cfg: Settings, value: Any) -> None:
    section = as_dict("optimizer", value)
    extra = set(section) - {"type", "params"}
    if extra:
        raise unknown_key(f"optimizer.{sorted(map(str, extra))[0]}", ["type", "params"])
    kind = section.get("type")
    refuse_auto("optimizer.type", kind)
    if not isinstance(kind, str) or kind.lower() not in OPTIMIZERS:
        raise ConfigError(f"config key 'optimizer.type' must be one of {', '.join(sorted(OPTIMIZERS))} "
                          f"(case-insensitive), got {kind!r}")
    params = _optimizer_params(section.get("params", {}))
    if kind.lower() in ("adam", "adamw"):
        kind, params = _as_deepspeed_adam(kind, params)
    cfg.optimizer = OptimizerConfig(kind, params)


def _as_deepspeed_adam(kind: str, params: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """What DeepSpeed builds for "Adam" and "AdamW", in torch's classes, so a ported config trains
    the same: decoupled weight decay (AdamW) unless "Adam" comes with adam_w_mode false, and
    weight_decay 0 unless given (its FusedAdam's and CPU Adam's default; torch's AdamW says 0.01,
    which DeepSpeed keeps only with torch_adam true). bias_correction must stay on (torch's Adam
    always corrects)."""
    params = dict(params)
    w_mode = as_bool("optimizer.params.adam_w_mode", params.pop("adam_w_mode", True))
    torch_adam = as_bool("optimizer.params.torch_adam", params.pop("torch_adam", False))
    if not as_bool("optimizer.params.bias_correction", params.pop("bias_correction", True)):
        raise ConfigError("config key 'optimizer.params.bias_correction': false is not supported (torch's "
                          "Adam and AdamW always correct the bias); remove it")
    if not torch_adam:
        params.setdefault("weight_decay", 0.0)
    return ("AdamW" if kind.lower() == "adamw" or w_mode else "Adam"), params


# Keyword arguments of torch's optimizers whose type is fixed, checked here: a wrong type is named
# now instead of failing inside torch, at construction or at the first step. Names an optimizer
# does not take, and ranges, are left to its constructor (initialize names what it refuses).
_OPTIMIZER_NUMBERS = {"lr", "eps", "weight_decay", "momentum", "dampening", "lr_decay",
                      "initial_accumulator_value", "alpha", "rho", "momentum_decay"}
_OPTIMIZER_FLAGS = {"amsgrad", "maximize", "nesterov", "centered", "decoupled_weight_decay", "capturable",
                    "differentiable"}
_OPTIMIZER_CHOICES = {"foreach", "fused"}  # true, false, or null: torch decides


def _optimizer_params(value: Any) -> dict[str, Any]:
    params = dict(as_dict("optimizer.params", value))
    for key, v in params.items():
        name = f"optimizer.params.{key}"
        if not isinstance(key, str):
            raise ConfigError(f"config key 'optimizer.params' holds the optimizer's keyword arguments: its "
                              f"keys must be strings, got {key!r}")
        refuse_auto(name, v)  # any keyword argument: torch would refuse it only at construction
        if key in _OPTIMIZER_NUMBERS and not isinstance(v, torch.Tensor):  # torch takes a tensor lr
            as_number(name, v)
        elif key in _OPTIMIZER_FLAGS or (key in _OPTIMIZER_CHOICES and v is not None):
            as_bool(name, v)
        elif key == "betas" and not (isinstance(v, (list, tuple)) and len(v) == 2 and all(
                isinstance(b, numbers.Real) and not isinstance(b, bool) and math.isfinite(b) for b in v)):
            raise ConfigError(f"config key '{name}' must be a list of two numbers, got {v!r}")
    if params.get("differentiable"):
        raise ConfigError("config key 'optimizer.params.differentiable': true is not supported (zeroshard "
                          "steps its flat shards in place, outside autograd); set it to false")
    return params
