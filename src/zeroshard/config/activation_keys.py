"""The config's "activation_checkpointing" section (ZeRO-R): DeepSpeed's keys, checked by name."""
from __future__ import annotations

from typing import Any

from .sections import ActivationConfig, Settings, unknown_key
from .values import as_bool, as_dict, as_int


_ACTIVATION_FLAGS = ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization")
_ACTIVATION_ACCEPTED = (*_ACTIVATION_FLAGS, "number_checkpoints", "synchronize_checkpoint_boundary",
                        "profile")


def activations(cfg: Settings, value: Any) -> None:
    """The section turns on per-unit checkpointing (DeepSpeed's model calls its checkpoint function
    itself; here every unit is checkpointed). synchronize_checkpoint_boundary and profile are
    accepted: they only time and synchronize in DeepSpeed."""
    act = ActivationConfig()
    for key, v in as_dict("activation_checkpointing", value).items():
        name = f"activation_checkpointing.{key}"
        if key in _ACTIVATION_FLAGS:
            setattr(act, key, as_bool(name, v))
        elif key == "number_checkpoints":
            act.number_checkpoints = None if v is None else as_int(name, v, 1)
        elif key in ("synchronize_checkpoint_boundary", "profile"):
            as_bool(name, v)
        else:
            raise unknown_key(name, _ACTIVATION_ACCEPTED)
    cfg.activations = act
