"""zero_config meets TrainingArguments: one value for each setting both can hold, or a clear error.

DeepSpeed's Hugging Face integration lets a config write "auto" where Trainer's arguments should
decide; ZeroTrainer does the same. For each key below, "auto" (or leaving the key out) takes the
TrainingArguments value, and any other value must equal it: a contradiction is refused, naming
both. "auto" on a key with no TrainingArguments counterpart (DeepSpeed's bucket sizes, say) takes
zeroshard's default. What comes out is a plain config for zeroshard.initialize, with no "auto" left
(initialize refuses one by name) and accumulation 1: Trainer drives accumulation itself, calling
engine.backward per micro-batch and engine.step() once per window. Needs no transformers import.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from typing import Any, Callable

from ...config import Config, ConfigError
from ...config.sections import unknown_key

# zero_config key -> (what TrainingArguments calls it, its value there)
_SHARED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size",
                                       lambda a: a.per_device_train_batch_size),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", lambda a: a.gradient_accumulation_steps),
    "train_batch_size": ("per_device_train_batch_size x gradient_accumulation_steps x world size",
                         lambda a: a.per_device_train_batch_size * a.gradient_accumulation_steps
                         * a.world_size),
    "gradient_clipping": ("max_grad_norm", lambda a: max(a.max_grad_norm or 0.0, 0.0)),
    "bf16.enabled": ("bf16", lambda a: bool(a.bf16)),
    "fp16.enabled": ("fp16", lambda a: bool(a.fp16)),
}
# "auto" in the optimizer section's params (the section itself wins over TrainingArguments.optim)
_OPTIMIZER_AUTO: dict[str, Callable[[Any], Any]] = {
    "lr": lambda a: a.learning_rate, "betas": lambda a: [a.adam_beta1, a.adam_beta2],
    "eps": lambda a: a.adam_epsilon, "weight_decay": lambda a: a.weight_decay,
}
_OPTIMIZER_NAMES = {"lr": "learning_rate", "betas": "[adam_beta1, adam_beta2]", "eps": "adam_epsilon",
                    "weight_decay": "weight_decay"}
# TrainingArguments.optim values that are torch optimizers zeroshard can run over flat shards
TORCH_OPTIMS = ("adamw_torch", "adamw_torch_fused", "sgd", "adagrad", "rmsprop")
# TrainingArguments that would hand the model to another engine, or that ZeroTrainer cannot honour yet
_REFUSED = {
    "deepspeed": "ZeroTrainer is the ZeRO engine here: put the DeepSpeed config in zero_config= instead",
    "fsdp": "ZeroTrainer shards the model itself: use zero_optimization.stage 3 in zero_config instead",
    "torch_compile": "not supported by ZeroTrainer yet",
    "auto_find_batch_size": "a model is wrapped by zeroshard once, so a smaller batch cannot be retried",
}


def check_arguments(args: Any) -> None:
    """Refuse, by name, TrainingArguments that ZeroTrainer cannot honour (before Trainer acts on them)."""
    for name, why in _REFUSED.items():
        if getattr(args, name, None):
            raise ValueError(f"TrainingArguments.{name}={getattr(args, name)!r} cannot be used with "
                             f"ZeroTrainer: {why}")


def resolve_config(source: "dict | str | os.PathLike | Config | None", args: Any,
                   custom_optimizer: bool = False) -> dict[str, Any]:
    """The config ZeroTrainer gives initialize(): `source` with TrainingArguments filled in."""
    raw = _load(source)
    _refuse_unknown_auto(raw, "")
    checked = copy.deepcopy(raw)
    checked.pop("scheduler", None)  # (checked by fill_scheduler)
    _drop_auto(checked, "")
    if isinstance(checked.get("zero_optimization"), dict):  # (a missing stage is named below, not
        checked["zero_optimization"].setdefault("stage", 3)  # as what another key needs of it)
    Config.load(checked)  # keys and types first: "bf16": true or a "2" is named as such, not compared
    for key, (name, read) in _SHARED.items():
        value = _get(raw, key)
        if value is not None and not _is_auto(value) and value != read(args):
            raise _contradiction(key, value, name, read(args))
    if _get(raw, "zeroshard.delayed_param_update"):
        raise ConfigError("zero_config 'zeroshard.delayed_param_update' cannot be used with ZeroTrainer: "
                          "Trainer steps the lr schedule right after the optimizer step, while the delayed "
                          "update would still be reading the learning rate; remove it")
    cfg = copy.deepcopy(raw)
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu"):  # checked above; Trainer batches
        cfg.pop(key, None)
    cfg["gradient_accumulation_steps"] = 1
    cfg["gradient_clipping"] = _SHARED["gradient_clipping"][1](args)
    for precision in ("bf16", "fp16"):
        if precision in cfg or getattr(args, precision):
            section = cfg.get(precision) if isinstance(cfg.get(precision), dict) else {}
            cfg[precision] = {**section, "enabled": bool(getattr(args, precision))}
    optim = getattr(args.optim, "value", args.optim)
    if isinstance(cfg.get("optimizer"), dict):
        if cfg["optimizer"].get("params") is None:  # (absent, or null)
            cfg["optimizer"]["params"] = {}
        params = cfg["optimizer"]["params"]
        for key in _optimizer_keys(cfg["optimizer"]) if isinstance(params, dict) else []:
            params.setdefault(key, "auto")  # left out: TrainingArguments' value, as "auto" takes
        for key, value in list(params.items()) if isinstance(params, dict) else []:
            if key not in _OPTIMIZER_AUTO:
                continue
            if _is_auto(value):
                params[key] = _OPTIMIZER_AUTO[key](args)
            elif _listed(value) != _listed(_OPTIMIZER_AUTO[key](args)):  # as DeepSpeed's integration
                raise _contradiction(f"optimizer.params.{key}", value, _OPTIMIZER_NAMES[key],
                                     _OPTIMIZER_AUTO[key](args))
        if optim != _default_of(args, "optim"):  # (the default is no choice of the user's to ignore)
            warnings.warn(f"zero_config's \"optimizer\" section ({cfg['optimizer'].get('type')}) is used, "
                          f"and TrainingArguments.optim={optim!r} is ignored (its params are "
                          f"TrainingArguments' learning_rate, adam_* and weight_decay, \"auto\" or equal)",
                          UserWarning, stacklevel=3)
    elif not custom_optimizer and optim not in TORCH_OPTIMS:
        raise ConfigError(f"TrainingArguments.optim={optim!r} is not an optimizer zeroshard can run over "
                          f"flat shards; use one of {', '.join(TORCH_OPTIMS)}, an \"optimizer\" section in "
                          f"zero_config, or optimizer_cls_and_kwargs=(an elementwise optimizer, kwargs)")
    schedule = cfg.pop("scheduler", None)  # Trainer steps it, once it knows the steps (fill_scheduler)
    kind = getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type)
    if schedule is not None and kind != _default_of(args, "lr_scheduler_type"):
        warnings.warn(f"zero_config's \"scheduler\" section ({schedule.get('type')}) is used, and "
                      f"TrainingArguments.lr_scheduler_type={kind!r} is ignored (remove the section to "
                      f"use it)", UserWarning, stacklevel=3)
    _drop_auto(cfg, "")
    if schedule is not None:  # refused now, not at the first training step (the steps come later)
        fill_scheduler(schedule, args, steps=None)
    if _get(cfg, "zero_optimization.stage") is None:  # the default, 0, would shard nothing, silently
        raise ConfigError("zero_config has no 'zero_optimization.stage': ZeroTrainer does not pick one "
                          "(the default, 0, would shard nothing); write it, e.g. "
                          "{\"zero_optimization\": {\"stage\": 3}} (0 for plain data parallelism)")
    Config.load(cfg)  # likewise a bad key
    if schedule is not None:
        cfg["scheduler"] = schedule
    return cfg


# "auto" in the scheduler section's params, as DeepSpeed's Hugging Face integration fills them:
# (what TrainingArguments calls it, its value given the number of training steps)
_SCHEDULER_AUTO: dict[str, tuple[str, Callable[[Any, int], Any]]] = {
    "warmup_min_lr": ("(no counterpart: 0)", lambda a, n: 0.0),
    "warmup_max_lr": ("learning_rate", lambda a, n: a.learning_rate),
    "warmup_num_steps": ("get_warmup_steps() (at least 1)", lambda a, n: max(1, a.get_warmup_steps(n))),
    "total_num_steps": ("the training steps", lambda a, n: n),
}


def fill_scheduler(section: Any, args: Any, steps: int | None) -> Any:
    """The "scheduler" section as a SchedulerConfig for `steps` training steps: "auto" takes the
    TrainingArguments value; any other value must equal it (warmup_min_lr excepted). With steps
    None (not known yet), what depends on them is only checked for type."""
    section = copy.deepcopy(section)
    params = section.get("params") if isinstance(section, dict) else None
    for key, value in list(params.items()) if isinstance(params, dict) else []:
        if key in _SCHEDULER_AUTO:
            name, read = _SCHEDULER_AUTO[key]
            known = steps is not None or key == "warmup_max_lr"
            if _is_auto(value):
                params[key] = read(args, steps) if known else 1
            elif known and key != "warmup_min_lr" and value != read(args, steps):
                raise _contradiction(f"scheduler.params.{key}", value, name, read(args, steps))
    return Config.load({"scheduler": section}).scheduler


def _default_of(args: Any, name: str) -> Any:
    """TrainingArguments' own default for `name` (optim: adamw_torch_fused in recent transformers)."""
    field = getattr(type(args), "__dataclass_fields__", {}).get(name)
    default = getattr(field, "default", None)
    return getattr(default, "value", default)


def _listed(value: Any) -> Any:
    """A value as JSON writes it (betas: a tuple and a list are the same pair)."""
    return list(value) if isinstance(value, tuple) else value


def _contradiction(key: str, value: Any, name: str, expected: Any) -> ConfigError:
    """A zero_config value that contradicts TrainingArguments, both named."""
    return ConfigError(f"zero_config '{key}' is {value!r} but TrainingArguments {name} is {expected!r}: "
                       f"make them equal, or write \"auto\" in zero_config to take the TrainingArguments "
                       f"value")


def _load(source: "dict | str | os.PathLike | Config | None") -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, Config):
        return dict(source.raw)
    if isinstance(source, dict):
        return source
    if isinstance(source, (str, os.PathLike)):
        if not os.path.isfile(source):
            raise ConfigError(f"zero_config file '{os.fspath(source)}' does not exist")
        with open(source) as f:
            try:
                return json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"zero_config file '{os.fspath(source)}' is not valid JSON: {e}") from None
    raise ConfigError(f"zero_config must be a dict, a path to a JSON file or a zeroshard.Config, "
                      f"got {type(source).__name__}")


def _get(raw: dict[str, Any], key: str) -> Any:
    section, _, leaf = key.rpartition(".")
    holder = raw.get(section) if section else raw
    return holder.get(leaf) if isinstance(holder, dict) else None


def _optimizer_keys(section: dict) -> list[str]:
    """The keys of _OPTIMIZER_AUTO the section's optimizer takes (SGD: lr and weight_decay)."""
    import inspect

    from ...config.sections import OPTIMIZERS

    cls = OPTIMIZERS.get(str(section.get("type", "")).lower())
    taken = inspect.signature(cls).parameters if cls is not None else {}
    return [key for key in _OPTIMIZER_AUTO if key in taken]


class _Probe:
    """A value no key takes: loading it shows whether a key is known (a type error) or not."""


def _refuse_unknown_auto(cfg: Any, prefix: str) -> None:
    """An "auto" under a key nothing reads (a typo) is refused by name, as any other value is:
    dropped with the placeholders, a misspelt "wieght_decay" would silently leave weight decay off."""
    for key, value in cfg.items() if isinstance(cfg, dict) else []:
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            _refuse_unknown_auto(value, f"{name}.")
        elif not _is_auto(value) or name in _SHARED or name == "zeroshard.unit_modules":
            continue
        elif prefix in ("optimizer.params.", "scheduler.params."):
            filled = _OPTIMIZER_AUTO if prefix.startswith("optimizer") else _SCHEDULER_AUTO
            if key not in filled:
                raise unknown_key(name, filled, " (\"auto\" is filled only for these)")
        else:
            *path, last = name.split(".")
            probe: dict = {}
            parent = probe
            for part in path:
                parent = parent.setdefault(part, {})
            parent[last] = _Probe()
            try:
                Config.load(probe)
            except ConfigError as e:
                if str(e).startswith("unknown config key"):
                    raise
            except Exception:  # noqa: BLE001 - a known key refusing the probe's type
                pass


def _is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == "auto"


_NO_DEFAULT_FOR_AUTO = {"zero_optimization.stage"}  # a choice the user must make: no silent stage 0


def _drop_auto(cfg: dict[str, Any], prefix: str) -> None:
    """Every "auto" left has no TrainingArguments counterpart: zeroshard's default applies (the
    stage excepted: "auto" there is refused by name, as a default stage 0 would shard nothing)."""
    for key, value in list(cfg.items()):
        if _is_auto(value) and f"{prefix}{key}" in _NO_DEFAULT_FOR_AUTO:
            raise ConfigError(f"config key '{prefix}{key}' is \"auto\", which TrainingArguments cannot "
                              f"decide: write the ZeRO stage (0-3)")
        if _is_auto(value) and f"{prefix}{key}" != "zeroshard.unit_modules":  # zeroshard's own "auto"
            del cfg[key]
        elif isinstance(value, dict):
            _drop_auto(value, f"{prefix}{key}.")
