"""The engine: `Engine` wraps a module and orchestrates the step over the core's pieces
(engine.py); its state in and out, checkpoints and measurements (state.py); full weights in the
module outside forward (gathered.py); DeepSpeed's accessors (compat.py); and the checks made before
anything is built (checks.py).
May import: common, config, comm, parallel, offload, core, checkpoint, construct.
"""
from .engine import Engine, TrainingState

__all__ = ["Engine", "TrainingState"]
