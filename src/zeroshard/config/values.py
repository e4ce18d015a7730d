"""How a config key's value is read: as its type, within its bounds, or refused with the key named.

JSON configs write big sizes as 5e8, so integers accept integral floats; bools are never numbers;
DeepSpeed's "auto" (the Hugging Face Trainer's placeholder) is refused with the way out.
"""
from __future__ import annotations

import math
import numbers
from typing import Any

from .sections import ConfigError


def placeholders(raw: Any, prefix: str = "") -> list[str]:
    """Every key at "auto" in a config's sections, zeroshard's own excepted (where "auto" is a value:
    pipelined_update, release_host_memory, unit_modules)."""
    if not isinstance(raw, dict):
        return []
    found = []
    for key, value in raw.items():
        name = f"{prefix}{key}"
        if isinstance(value, str) and value == "auto":
            found.append(name)
        elif name != "zeroshard":
            found += placeholders(value, f"{name}.")
    return found


def refuse_placeholders(raw: dict[str, Any]) -> None:
    """Every "auto" named in one error (DeepSpeed configs written for the Trainer hold a dozen)."""
    keys = placeholders(raw)
    if len(keys) > 1:
        raise ConfigError(f"config keys {', '.join(repr(k) for k in keys)} are \"auto\": placeholders that "
                          f"zeroshard.hf.ZeroTrainer fills from TrainingArguments; zeroshard.initialize and "
                          f"`zeroshard train --config` need values (or leave the keys out for their "
                          f"defaults)")
    if keys:
        refuse_auto(keys[0], "auto")


def refuse_auto(key: str, value: Any) -> None:
    """DeepSpeed's "auto" means "the Hugging Face Trainer decides": only zeroshard.hf.ZeroTrainer
    fills it in (from TrainingArguments); given to initialize it is refused by name."""
    if isinstance(value, str) and value == "auto":
        raise ConfigError(f"config key '{key}' is \"auto\": a placeholder that zeroshard.hf.ZeroTrainer "
                          f"fills from TrainingArguments; zeroshard.initialize and `zeroshard train "
                          f"--config` need a value (or leave the key out for its default)")


def as_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    # JSON configs write big sizes as 5e8: accept integral floats, refuse bools, fractions, inf and nan.
    refuse_auto(key, value)
    span = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)) or value != int(value):
        raise ConfigError(f"config key '{key}' must be an integer {span}, got {value!r}")
    if int(value) < minimum or (maximum is not None and int(value) > maximum):
        raise ConfigError(f"config key '{key}' must be an integer {span}, got {value!r}")
    return int(value)


def as_number(key: str, value: Any, minimum: float | None = None, *, above: bool = False,
               maximum: float | None = None, note: str = "") -> float:
    """A finite real number (not a bool), >= minimum (> minimum with `above`) and <= maximum; `note`
    follows the accepted range in the error."""
    refuse_auto(key, value)
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if ok and minimum is not None:
        ok = value > minimum if above else value >= minimum
    if ok and maximum is not None:
        ok = value <= maximum
    if not ok:
        bounds = [f"{'>' if above else '>='} {minimum:g}"] if minimum is not None else []
        bounds += [f"<= {maximum:g}"] if maximum is not None else []
        accepted = " ".join(["a finite number", " and ".join(bounds), note]).strip()
        raise ConfigError(f"config key '{key}' must be {accepted}, got {value!r}")
    return float(value)


def as_bool(key: str, value: Any) -> bool:
    refuse_auto(key, value)
    if not isinstance(value, bool):
        raise ConfigError(f"config key '{key}' must be true or false, got {value!r}")
    return value


def as_dict(key: str, value: Any) -> dict[str, Any]:
    refuse_auto(key, value)
    if not isinstance(value, dict):
        raise ConfigError(f"config key '{key}' must be an object, got {type(value).__name__}")
    return value


def refuse_true(key: str, value: Any, why: str) -> None:
    if as_bool(key, value):
        raise ConfigError(f"config key '{key}': true is not implemented yet ({why}); set it to false")
