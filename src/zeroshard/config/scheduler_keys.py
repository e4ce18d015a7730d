"""The config's "scheduler" section: DeepSpeed's warm-up schedules by name, every param checked at
load, so a typo or a schedule zeroshard lacks is named before training (schedules.py runs them)."""
from __future__ import annotations

from typing import Any

from .sections import ConfigError, SchedulerConfig, Settings, unknown_key
from .values import as_dict, as_int, as_number, refuse_auto

_WARMUP, _TOTAL = ("warmup_num_steps", "warmup_type"), ("total_num_steps",)
SCHEDULES = {  # type -> (accepted params, required ones)
    "WarmupLR": (("warmup_min_lr", "warmup_max_lr", *_WARMUP), ()),
    "WarmupDecayLR": (("warmup_min_lr", "warmup_max_lr", *_TOTAL, *_WARMUP), _TOTAL),
    "WarmupCosineLR": (("warmup_min_ratio", "cos_min_ratio", *_TOTAL, *_WARMUP), _TOTAL),
}


def scheduler(cfg: Settings, value: Any) -> None:
    section = as_dict("scheduler", value)
    for key in section:
        if key not in ("type", "params"):
            raise unknown_key(f"scheduler.{key}", ["type", "params"])
    kind = section.get("type")
    kind = {k.lower(): k for k in SCHEDULES}.get(kind.lower(), kind) if isinstance(kind, str) else kind
    if not isinstance(kind, str) or kind not in SCHEDULES:  # (in any case, as optimizer types are)
        raise ConfigError(f"config key 'scheduler.type' is {kind!r}; zeroshard runs DeepSpeed's "
                          f"{', '.join(SCHEDULES)} (for another schedule, pass lr_scheduler= to initialize)")
    accepted, required = SCHEDULES[kind]
    params = {}
    for key, v in as_dict("scheduler.params", section.get("params", {})).items():
        name = f"scheduler.params.{key}"
        if key not in accepted:
            raise unknown_key(name, accepted, what=f" for {kind}")
        params[key] = _param(name, key, v)
    if missing := [k for k in required if k not in params]:
        raise ConfigError(f"config key 'scheduler.params.{missing[0]}' is required by {kind}")
    cfg.scheduler = SchedulerConfig(kind, params)


def _param(name: str, key: str, value: Any) -> Any:
    refuse_auto(name, value)
    if key in ("warmup_num_steps", "total_num_steps"):
        return as_int(name, value, 1)
    if key == "warmup_type":
        if value not in ("log", "linear"):
            raise ConfigError(f"config key '{name}' must be \"log\" or \"linear\", got {value!r}")
        return value
    if key in ("warmup_min_lr", "warmup_max_lr") and isinstance(value, list):  # one per param group
        return [as_number(name, v, 0.0) for v in value]
    return as_number(name, value, 0.0, maximum=None if key.endswith("_lr") else 1.0)
