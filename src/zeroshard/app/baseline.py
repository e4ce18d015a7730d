"""`zeroshard compare`'s baseline: plain torch, with the engine's interface, so that the same loop
trains it: DistributedDataParallel over the ranks (one rank: the bare model), its own optimizer.

It follows the same recipe as the ZeRO runs, from the same config, the way a torch user writes it:
the config's optimizer, gradient accumulation (DDP's no_sync between boundaries, the loss divided
by the accumulation steps), global-norm clipping, the "scheduler" section stepped after each update,
and 16-bit precision as torch AMP (fp32 weights, autocast forward; fp16 with a GradScaler). AMP is
what plain torch offers for mixed precision, so its losses differ in the last digits from ZeRO's
16-bit weights with fp32 masters; the time and memory are what a user would compare against.
"""
from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

import zeroshard


class DDPBaseline:
    """Plain torch DistributedDataParallel (one rank: the bare model) behind the engine's interface:
    the compare baseline."""

    def __init__(self, model: nn.Module, make_opt, device: str, config: zeroshard.Config) -> None:
        from torch.nn.parallel import DistributedDataParallel
        cuda = device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        model = model.to(self.device)
        one_rank = zeroshard.rank_and_world_size()[1] == 1  # plain torch: nothing to synchronize
        self.module = model if one_rank else DistributedDataParallel(
            model, device_ids=[self.device.index] if cuda else None)
        self.optimizer = make_opt([p for p in model.parameters() if p.requires_grad])
        self.lr_scheduler = zeroshard.DeepSpeedSchedule(self.optimizer, config.scheduler) \
            if config.scheduler is not None else None
        self.accumulation, self.clip = config.gradient_accumulation_steps, config.gradient_clipping
        self.amp_dtype = None if config.precision == "fp32" else config.dtype(None)
        self.scaler = torch.amp.GradScaler(self.device.type) if config.precision == "fp16" else None
        self.micro_steps = 0

    def __call__(self, *args: Any) -> Any:
        # Between accumulation boundaries DDP's backward does not all-reduce (its flag is read here).
        boundary = (self.micro_steps + 1) % self.accumulation == 0
        sync = contextlib.nullcontext() if boundary or not hasattr(self.module, "no_sync") \
            else self.module.no_sync()
        amp = torch.autocast(self.device.type, self.amp_dtype) if self.amp_dtype is not None \
            else contextlib.nullcontext()
        with sync, amp:
            return self.module(*args)

    def train(self, mode: bool = True) -> "DDPBaseline":
        self.module.train(mode)
        return self

    def eval(self) -> "DDPBaseline":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.accumulation
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def step(self) -> None:
        self.micro_steps += 1
        if self.micro_steps % self.accumulation:
            return
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip > 0:
            torch.nn.utils.clip_grad_norm_(self.module.parameters(), self.clip)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep gradients allocated, as DDP's buckets do

    def memory_stats(self) -> dict[str, int]:
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = zeroshard.tensor_bytes(params + grads) + zeroshard.optimizer_state_bytes(self.optimizer)
        return {"model_states": states, "model_states_in_step": states}  # (gradients kept: the same)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())
