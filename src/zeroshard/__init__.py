"""zeroshard: ZeRO (Zero Redundancy Optimizer) data parallelism for PyTorch, stages 0-3.

    engine = zeroshard.initialize(model, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
                                  config={"zero_optimization": {"stage": 3}})
    loss = loss_fn(engine(batch)); engine.backward(loss); engine.step()

The public names below are imported on first use: `import zeroshard` alone (and the `zeroshard`
command's --help) does not import torch.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module that defines it.
_PUBLIC = {
    "initialize": "engine.initialize", "Engine": "engine.engine", "init": "construct",
    "materialize": "construct", "is_deferred": "construct", "consolidate": "checkpoint",
    "checkpoint_info": "checkpoint", "Config": "config", "ConfigError": "config",
    "CheckpointError": "checkpoint", "DivergenceError": "comm.watch", "NonFiniteError": "core.nonfinite",
    "ModelMismatchError": "engine.checks", "paper_model_state_bytes": "paper",
    "ensure_process_group": "comm.devices", "rank_and_world_size": "comm.over_ranks",
    "mean_over_ranks": "comm.over_ranks", "gather_objects": "comm.over_ranks",
    "tensor_bytes": "core.memory", "optimizer_state_bytes": "core.memory", "tensor_parallel": "parallel",
    "DeepSpeedSchedule": "core.schedules",
}
_RENAMED = {"checkpoint_info": "info"}  # public name -> its name in the defining module
# Also importable, not in __all__: counted collectives for scripts and benchmarks.
_EXTRA = {"Comm": "comm", "OptimizerSpec": "core.optim"}
__all__ = list(_PUBLIC)

if TYPE_CHECKING:  # what a type checker and an IDE see
    from .checkpoint import CheckpointError, consolidate  # noqa: F401
    from .checkpoint import info as checkpoint_info  # noqa: F401
    from .comm import Comm  # noqa: F401
    from .comm.devices import ensure_process_group  # noqa: F401
    from .comm.over_ranks import gather_objects, mean_over_ranks, rank_and_world_size  # noqa: F401
    from .comm.watch import DivergenceError  # noqa: F401
    from .config import Config, ConfigError  # noqa: F401
    from .construct import init, is_deferred, materialize  # noqa: F401
    from .core.memory import optimizer_state_bytes, tensor_bytes  # noqa: F401
    from .core.nonfinite import NonFiniteError  # noqa: F401
    from .core.optim import OptimizerSpec  # noqa: F401
    from .core.schedules import DeepSpeedSchedule  # noqa: F401
    from .engine.checks import ModelMismatchError  # noqa: F401
    from .engine.engine import Engine  # noqa: F401
    from .engine.initialize import initialize  # noqa: F401
    from .paper import paper_model_state_bytes  # noqa: F401
    from .parallel import tensor_parallel  # noqa: F401


def __getattr__(name: str) -> Any:
    where = _PUBLIC.get(name) or _EXTRA.get(name)
    if where is None:  # a subpackage: zeroshard.core, zeroshard.hf, ...
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError:
            raise AttributeError(f"module 'zeroshard' has no attribute {name!r}") from None
    # The integrations register their model patches with the core (integrations/hf/patches.py)
    # before any engine can be built.
    importlib.import_module(f"{__name__}.integrations.hf.patches")
    value = getattr(importlib.import_module(f"{__name__}.{where}"), _RENAMED.get(name, name))
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | set(_EXTRA))
