"""The engine behind the two interfaces Hugging Face's Trainer drives (trainer.py): an
nn.Module for its loop and evaluation, and an Optimizer for its step and lr scheduler.

Invariant: neither adapter owns a tensor. Trainer's `.to()`, `.zero_grad()` and state_dict calls
must never reach the engine's flat buffers, whose layout and sharding only the engine knows.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ...engine.engine import Engine

_SHARDED_STATE = ("zeroshard's optimizer state is sharded across ranks: ZeroTrainer saves and loads it "
                  "with the engine's checkpoints (checkpoint-N/zeroshard), not as one state_dict")


class EngineModule(nn.Module):
    """The engine behind nn.Module's interface, for Trainer's loop. Holds no parameters of its own:
    `.to()`, `.zero_grad()` and the like must not reach the engine's flat buffers."""

    def __init__(self, engine: Engine, label_names: list[str]) -> None:
        super().__init__()
        self.engine, self._label_names = engine, set(label_names)
        self._dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(engine.config.precision)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._dtype is not None:  # the module computes in 16 bits: floating inputs follow (not labels)
            kwargs = {k: v.to(self._dtype) if torch.is_tensor(v) and v.is_floating_point()
                      and k not in self._label_names else v for k, v in kwargs.items()}
        return self.engine(*args, **kwargs)

    def _get_name(self) -> str:  # what Trainer's label smoother asks of the model (causal LM or not)
        return self.engine.module._get_name()

    def train(self, mode: bool = True) -> "EngineModule":
        self.training = mode
        self.engine.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: engine.step() clears the flat gradients."""

    def no_sync(self) -> Any:
        """accelerator.no_sync calls this for all but the last micro-batch of a window. Stages 0-1 keep
        full gradients anyway, so they reduce once per window, as DDP; stages 2-3 reduce-scatter each
        micro-batch into their shards rather than hold full-size gradients between backwards."""
        return self.engine.no_sync() if self.engine.config.stage < 2 else contextlib.nullcontext()


class EngineOptimizer(torch.optim.Optimizer):
    """What Trainer calls its optimizer: step() is engine.step(); param_groups are the engine
    optimizer's own (so the lr scheduler sets the learning rate the engine uses). Marked as prepared,
    so accelerate neither wraps it nor misses `step_was_skipped` (an fp16 overflow, or a non-finite
    step skipped by zeroshard.on_nonfinite: the lr schedule then stands still, as in Trainer).
    Like accelerate's own optimizer wrapper, it does not run Optimizer.__init__."""

    _is_accelerate_prepared = True

    def __init__(self, engine: Engine) -> None:  # not Optimizer.__init__: it would take parameters
        self.engine, self.step_was_skipped = engine, False

    @property
    def param_groups(self) -> list[dict]:
        return self.engine.optimizer.param_groups

    @property
    def defaults(self) -> dict:
        return self.engine.optimizer.defaults

    @property
    def state(self) -> Any:
        return self.engine.optimizer.state

    def step(self, closure: Any = None) -> None:
        skipped = self.engine.skipped_steps
        self.engine.step()
        self.step_was_skipped = self.engine.skipped_steps != skipped

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to do: engine.step() clears the flat gradients."""

    def state_dict(self) -> dict:
        raise RuntimeError(_SHARDED_STATE)

    def load_state_dict(self, state_dict: dict) -> None:
        raise RuntimeError(_SHARDED_STATE)
