"""The config keys of disk offload (ZeRO-Infinity): `offload_*.device: "nvme"`, its path and buffers,
and DeepSpeed's `aio` section.

Invariant: every key is checked here, at load, with an error that names it; the checks that need
the file system (the path exists, is writable, has room) run at initialize (offload/nvme/rundir.py), before
the first file is written. `aio` is accepted for compatibility: its values are validated and kept,
and only `thread_count` and `block_size` are used (zeroshard's I/O is pread/pwrite on a thread pool,
not libaio); the others are advisory.
"""
from __future__ import annotations

from typing import Any

from .sections import ConfigError, Settings, unknown_key
from .values import as_int

# Keys of each offload section that only disk offload uses (accepted, and validated, with "cpu" too).
NVME_KEYS = {"offload_optimizer": ("nvme_path", "buffer_count"),
             "offload_param": ("nvme_path", "buffer_count", "buffer_size", "max_in_cpu")}
_AIO_INTS = ("block_size", "queue_depth", "thread_count")
_AIO_BOOLS = ("single_submit", "overlap_events", "use_gds")


def set_device(cfg: Settings, section: str, nvme: bool) -> None:
    """offload_*.device: "nvme" is the host offload's machinery with the states resting in files."""
    setattr(cfg.nvme, "optimizer" if section == "offload_optimizer" else "params", nvme)


def nvme_key(cfg: Settings, section: str, key: str, value: Any) -> None:
    name = f"zero_optimization.{section}.{key}"
    optimizer = section == "offload_optimizer"
    if key == "nvme_path":
        if not isinstance(value, str) or not value:
            raise ConfigError(f"config key '{name}' must be a directory path (a non-empty string), "
                              f"got {value!r}")
        setattr(cfg.nvme, "optimizer_path" if optimizer else "param_path", value)
    elif key == "buffer_count":
        setattr(cfg.nvme, "buffer_count" if optimizer else "param_buffer_count", as_int(name, value, 1))
    elif key == "buffer_size":
        cfg.nvme.param_buffer_size = as_int(name, value, 1)
    elif key == "max_in_cpu":
        cfg.nvme.max_in_cpu = as_int(name, value, 0)


def aio(cfg: Settings, value: Any) -> None:
    """The top-level `aio` section: {block_size, queue_depth, thread_count, single_submit,
    overlap_events, use_gds}."""
    if not isinstance(value, dict):
        raise ConfigError(f"config key 'aio' must be an object, got {type(value).__name__}")
    for key, v in value.items():
        name = f"aio.{key}"
        if key in _AIO_INTS:
            cfg.nvme.aio[key] = as_int(name, v, 1)
        elif key in _AIO_BOOLS:
            if not isinstance(v, bool):
                raise ConfigError(f"config key '{name}' must be true or false, got {v!r}")
            if key == "use_gds" and v:
                raise ConfigError("config key 'aio.use_gds': true is not implemented (GPUDirect Storage); "
                                  "set it to false")
            cfg.nvme.aio[key] = v
        else:
            raise unknown_key(name, _AIO_INTS + _AIO_BOOLS)


def check(cfg: Settings) -> None:
    """Rules across keys, once the whole config is read."""
    for section, on, path in (("offload_optimizer", cfg.nvme.optimizer, cfg.nvme.optimizer_path),
                              ("offload_param", cfg.nvme.params, cfg.nvme.param_path)):
        if on and path is None:
            raise ConfigError(f"config key 'zero_optimization.{section}.device' is \"nvme\": it needs "
                              f"zero_optimization.{section}.nvme_path, the directory for the files")
    if cfg.nvme.optimizer and cfg.delayed_param_update:
        raise ConfigError("zeroshard.delayed_param_update is not supported with offload_optimizer "
                          "{\"device\": \"nvme\"} (the update would read the state outside the step's "
                          "stream); use device \"cpu\" or remove delayed_param_update")
