"""What users coming from DeepSpeed's engine or from a plain nn.Module reach for on an Engine.

The Engine is not an nn.Module: its parameters live in flat buffers (sharded at stage 3), so the
module's own `state_dict()` or `parameters()` would hand out placeholders or one rank's shard. The
names such code calls are answered either by the engine's equivalent (`get_lr`, `zero_grad`) or by an
AttributeError that names what to use instead, never by a silently wrong value.
"""
from __future__ import annotations

from typing import Any

_INSTEAD = {
    "state_dict": "the full fp32 weights are engine.full_state_dict(); the sharded training state is "
                  "engine.save_checkpoint(dir)",
    "load_state_dict": "load full weights into the model before zeroshard.initialize(), or resume with "
                       "engine.load_checkpoint(dir)",
    "parameters": "engine.module.parameters() are the model's own (at stage 3, empty outside forward: "
                  "`with engine.gathered_parameters() as model:` fills them)",
    "named_parameters": "engine.module.named_parameters() (at stage 3, empty outside forward: "
                        "`with engine.gathered_parameters() as model:` fills them)",
    "to": "initialize() placed the model on the process group's device; choose the device there",
    "cuda": "initialize() placed the model on the process group's device; choose the device there",
}


class EngineCompat:
    """Mixed into engine.Engine: DeepSpeed's small conveniences, and pointers for the rest."""

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as DeepSpeed's engine.get_lr()."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm measured in the last step (before clipping); None before one."""
        return self.last_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: step() clears gradients. Kept for loops ported from torch, which call it
        before the forward; after a backward it would drop gradients that stages 2-3 have already
        reduced on every rank, so there it is refused."""
        if self.reducer.saw_backward:
            raise RuntimeError("engine.zero_grad() after backward() and before step(): ZeRO has already "
                               "reduced these gradients across ranks. step() clears them; to skip a batch, "
                               "do not call backward() for it")

    def __getattr__(self, name: str) -> Any:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):  # it raised AttributeError itself: surface that, not "no attribute"
            return prop.fget(self)
        hint = _INSTEAD.get(name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'"
                             + (f": {hint}" if hint else ""))
