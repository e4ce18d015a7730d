"""What users coming from DeepSpeed's engine or from a plain nn.Module reach for on an Engine.

The Engine is not an nn.Module: its parameters live in flat buffers (sharded at stage 3), so the
module's own `state_dict()` or `parameters()` would hand out placeholders or one rank's shard. The
names such code calls are answered either by the engine's equivalent (`get_lr`, `zero_grad`) or by an
AttributeError that names what to use instead, never by a silently wrong value.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch

from ..checkpoint.export import write_weights

logger = logging.getLogger("zeroshard")

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
    "train_batch": "DeepSpeed's pipeline engine's call; here a step is engine.backward(loss_fn(engine(x), "
                   "y)); engine.step()",
    "eval_batch": "DeepSpeed's pipeline engine's call; here: with torch.no_grad(): engine(x)",
}


class EngineCompat:
    """Mixed into engine.Engine: DeepSpeed's small conveniences, and pointers for the rest."""

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps skipped (on every rank alike): fp16 overflows, and non-finite bf16/fp32
        gradients with zeroshard.on_nonfinite "skip"."""
        return self.scaler.skipped_steps + self.nonfinite.skipped

    @property
    def loss_scale(self) -> float:
        return self.scaler.scale

    def _refuse_unscaled_backward(self) -> None:
        """step() with no engine.backward since the last one. After a plain loss.backward() that
        works alone (the gradient hooks reduce what arrives), but the loss was neither divided by
        the accumulation steps nor multiplied by the fp16 loss scale: refused where either applies.
        Decided alike on every rank (a rank's loss may reach no gradient); the refused cycle's
        gradients are dropped, so the engine goes on from the cycle's start."""
        gas = self.config.gradient_accumulation_steps
        if gas == 1 and not self.scaler.enabled:
            return
        plain = torch.tensor(float(self.reducer.cycle.plain), device=self.comm.device)
        with self.comm.outside_step():
            self.comm.all_reduce(plain)
        if not plain.item():
            return  # no backward at all in this micro-step: nothing to scale
        self._finish_backward()  # the reductions the gradient hooks began, completed on every rank
        self._drop_cycle()
        why = f"divides it by gradient_accumulation_steps ({gas})" if gas > 1 else \
            "multiplies it by the fp16 loss scale"
        raise RuntimeError(f"step() after loss.backward(): engine.backward(loss) {why}, so these gradients "
                           f"were off by that factor. This accumulation cycle's gradients are dropped; run "
                           f"it again with engine.backward(loss) in place of loss.backward()")

    def _drop_cycle(self) -> None:
        """A refused or failed backward or step: this accumulation cycle's gradients go, so a retry
        (or the next batch, where the user skips this one) starts the cycle afresh rather than
        adding to what the refused one left."""
        for flat in self.flats:
            flat.drop_gradients()
        self.reducer.end_step()
        self.micro_steps -= self.micro_steps % self.config.gradient_accumulation_steps

    def _print_step(self) -> None:
        """steps_per_print's line: to the `zeroshard` logger where logging shows INFO, else printed
        (as DeepSpeed's own logger prints it), so the key does something without a logging setup."""
        sent = sum(v["bytes"] for v in self.comm.stats()["last_step"].values())
        states = self.memory_stats()["model_states_in_step"]
        line = (f"step {self.global_steps}: lr {self.get_lr()}, grad norm {self.last_grad_norm:.4g}, "
                f"model states {states / 2**20:.1f} MiB per rank, traffic {sent / 2**20:.1f} MiB last step")
        if logger.isEnabledFor(logging.INFO):
            logger.info(line)
        else:
            print(f"[zeroshard] {line}", flush=True)

    # ---- DeepSpeed's engine accessors --------------------------------------------------------------
    def zero_optimization_stage(self) -> int:
        return self.config.stage

    def gradient_accumulation_steps(self) -> int:
        return self.config.gradient_accumulation_steps

    def train_micro_batch_size_per_gpu(self) -> int | None:
        """As configured, or as train_batch_size implies it (None if the config gives neither)."""
        micro, total = self.config.train_micro_batch_size_per_gpu, self.config.train_batch_size
        if micro is None and total is not None:
            micro = total // (self.gradient_accumulation_steps() * self.world_size)
        return micro

    def train_batch_size(self) -> int | None:
        """Samples per optimizer step over every data-parallel rank (None if the config gives no
        batch size)."""
        micro = self.train_micro_batch_size_per_gpu()
        return None if micro is None else micro * self.gradient_accumulation_steps() * self.world_size

    def fp16_enabled(self) -> bool:
        return self.config.precision == "fp16"

    def bfloat16_enabled(self) -> bool:
        return self.config.precision == "bf16"

    def gradient_clipping(self) -> float:
        """The global-norm clipping threshold (0: off)."""
        return self.config.gradient_clipping

    def was_step_applied(self) -> bool:
        """Did the last step() update the parameters (an accumulation boundary, not a skipped step)?"""
        return self.step_applied

    @property
    def global_rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        """Data-parallel ranks: those ZeRO shards over, in every copy of the model (MiCS)."""
        return self.comm.data_parallel[1]

    @property
    def dp_world_size(self) -> int:
        return self.world_size

    @property
    def local_rank(self) -> int:
        return int(os.environ.get("LOCAL_RANK", 0))

    @property
    def training(self) -> bool:
        return self.module.training

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self(*args, **kwargs)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """Collective. DeepSpeed's export: the full weights in the training dtype, saved by rank 0
        with torch.save (tied weights one tensor), or as a safetensors file where the name ends in
        .safetensors (DeepSpeed pickles whatever the name says; from_pretrained then fails on it).
        Returns True."""
        dtype = self.config.dtype(None)
        frozen = {n for n, p in self.module.named_parameters(remove_duplicate=False)  # tied names too
                  if not p.requires_grad}
        self.comm.watch.gate("save_16bit_model()")  # called on rank 0 alone: named as this call
        state = self.full_state_dict(rank0_only=True)
        if state:
            cast: dict[int, torch.Tensor] = {}  # by the source tensor: tied names share it
            out = {k: cast.setdefault(id(v), v.to(dtype) if v.is_floating_point() else v)
                   for k, v in state.items() if not (exclude_frozen_parameters and k in frozen)}
            os.makedirs(save_dir, exist_ok=True)
            write_weights(out, os.path.join(save_dir, save_filename))
        return True

    def destroy(self) -> None:
        """DeepSpeed's name for close()."""
        self.close()

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group, as DeepSpeed's engine.get_lr()."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global gradient norm measured in the last step (before clipping); None before one."""
        return self.last_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """After step() nothing is left to clear (step() clears gradients): a torch loop's call
        before its forward does nothing. After a backward (a batch abandoned between backward and
        step, its exception caught) it drops the accumulation cycle's gradients, as torch's does.
        Those may already be reduced across ranks, so every rank must drop them: the ranks meet at a
        gate first, and one that called it alone is named rather than left training on others'."""
        if self.reducer.saw_backward:
            self.comm.watch.gate("zero_grad() after backward()")
            self._drop_cycle()

    def __iter__(self) -> Any:
        """`engine, optimizer, _, scheduler = initialize(...)`, DeepSpeed's habit: named, not a bare
        'cannot unpack'."""
        raise TypeError("the engine is not iterable (iterate engine.module): zeroshard.initialize() "
                        "returns the engine alone, not DeepSpeed's (engine, optimizer, dataloader, "
                        "lr_scheduler); the optimizer is engine.optimizer, the scheduler engine."
                        "lr_scheduler, the data loader yours")

    def __getattr__(self, name: str) -> Any:
        prop = getattr(type(self), name, None)
        if isinstance(prop, property):  # it raised AttributeError itself: surface that, not "no attribute"
            return prop.fget(self)
        hint = _INSTEAD.get(name)
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'"
                             + (f": {hint}" if hint else ""))
