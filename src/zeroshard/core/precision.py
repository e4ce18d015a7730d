"""Mixed precision: which dtype each model state is kept in, and fp16 dynamic loss scaling.

The paper's K = 12 made concrete. Parameters and gradients live in the compute dtype (2Ψ + 2Ψ in
bf16/fp16); the optimizer updates an fp32 master copy (4Ψ) with fp32 state (8Ψ for Adam); after
each step the compute-dtype parameters are refreshed from the master. With fp32 training and no
offload, the master *is* the parameter storage: nothing is copied.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..config import ScalerConfig

if TYPE_CHECKING:
    from ..config import Config

logger = logging.getLogger("zeroshard")


@dataclass(frozen=True)
class Precision:
    """dtypes of the model states, and which live on the host: `offload` the master weights and
    optimizer state, `offload_params` the parameter shards at rest (stage 3)."""

    param_dtype: torch.dtype = torch.float32        # compute dtype: parameters, gradients, gathers
    reduce_dtype: torch.dtype = torch.float32       # dtype gradients are communicated in
    accumulate_dtype: torch.dtype = torch.float32   # stages 2-3: dtype of the persistent gradient shard
    offload: bool = False
    pin_memory: bool = False
    offload_params: bool = False
    pin_params: bool = False

    @property
    def separate_master(self) -> bool:
        """Does the optimizer update its own fp32 copy rather than the parameters themselves?"""
        # (With offloaded shards in fp32, the master still stays beside the optimizer state.)
        return self.param_dtype != torch.float32 or self.offload or self.offload_params

    @staticmethod
    def from_config(config: "Config") -> "Precision":
        compute = config.dtype(None)
        # With accumulation, stages 2-3 add each micro-batch's reduced gradient into the shard: in
        # fp32, so that many small bf16/fp16 additions do not lose precision.
        accumulate = torch.float32 if config.gradient_accumulation_steps > 1 else compute
        return Precision(param_dtype=compute, reduce_dtype=config.dtype(config.communication_data_type),
                         accumulate_dtype=accumulate, offload=config.zero.offload_optimizer,
                         pin_memory=config.zero.offload_pin_memory,
                         offload_params=config.zero.offload_param,
                         pin_params=config.zero.offload_param_pin_memory)


def convert_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Floating buffers that are the module's state (in its state_dict: running statistics) follow
    the compute dtype, as module.to(dtype) would do. Non-persistent ones are constants a module
    computed for itself, in the precision it chose: rotary frequencies, which rounded to bf16 put
    the cosine of a position near 4,000 off by up to 0.7. They stay as they are, as they do
    under autocast and in transformers' own bf16 loading (whose rotary code computes in fp32 and
    casts its output)."""
    for m in module.modules():
        for name, b in m._buffers.items():
            if b is not None and b.is_floating_point() and b.dtype != dtype and \
                    name not in m._non_persistent_buffers_set:
                m._buffers[name] = b.to(dtype)


class LossScaler:
    """Dynamic loss scaling with DeepSpeed's semantics: the first `hysteresis - 1` overflows skip the
    step without shrinking, later ones halve the scale; `loss_scale_window` clean steps in a row double
    it and restore the hysteresis. Overflow decisions are global: the engine all-reduces the squared
    gradient norm (non-finite on overflow), so every rank skips the same steps and never diverges.
    """

    def __init__(self, cfg: ScalerConfig | None, report: bool = True) -> None:
        self.enabled = cfg is not None
        self.report = report  # warn of a skipped step (rank 0 only: every rank skips the same steps)
        self.cfg = cfg or ScalerConfig(loss_scale=1.0)
        self.dynamic = self.enabled and self.cfg.loss_scale == 0
        self.scale = 2.0 ** self.cfg.initial_scale_power if self.dynamic else float(self.cfg.loss_scale)
        self._tolerance = self.cfg.hysteresis
        self._clean_steps = 0
        self.skipped_steps = 0

    def update(self, overflow: bool, step: int) -> None:
        """Record one optimizer step's outcome; raise if overflow persists at the minimum scale."""
        if not overflow:
            self._clean_steps += 1
            if self.dynamic and self._clean_steps % self.cfg.loss_scale_window == 0:
                self.scale *= 2.0
                self._tolerance = self.cfg.hysteresis
            return
        self.skipped_steps += 1
        self._clean_steps = 0
        if not self.dynamic:
            if self.report:
                logger.warning("step %d skipped: gradient overflow at static loss scale %g", step, self.scale)
            return
        if self._tolerance > 1:  # hysteresis: tolerate this overflow without shrinking
            self._tolerance -= 1
        elif self.scale <= self.cfg.min_loss_scale:
            raise FloatingPointError(
                f"fp16 gradients overflow at the minimum loss scale ({self.cfg.min_loss_scale:g}) at step "
                f"{step}: training cannot continue. Look for inf/nan in the data or the loss, lower the "
                f"learning rate, or train in bf16 (\"bf16\": {{\"enabled\": true}}).")
        else:
            self.scale = max(self.scale / 2.0, self.cfg.min_loss_scale)
        if self.report:
            logger.warning("step %d skipped: gradient overflow; loss scale now %g", step, self.scale)

    def state_dict(self) -> dict:
        return {"scale": self.scale, "tolerance": self._tolerance, "clean_steps": self._clean_steps,
                "skipped_steps": self.skipped_steps, "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        """The saved scale and its schedule go to a dynamic scaler from a dynamic one only (older
        checkpoints say nothing: taken). A disabled scaler keeps 1 and a static one its configured
        scale: an fp16 checkpoint resumed in bf16 must not divide every gradient by the old scale."""
        self.skipped_steps = int(state["skipped_steps"])
        if self.dynamic and state.get("dynamic", True):
            self.scale, self._tolerance = float(state["scale"]), int(state["tolerance"])
            self._clean_steps = int(state["clean_steps"])
