"""`zeroshard compare`'s baseline: plain torch, with the engine's interface, so that the same loop
trains it: DistributedDataParallel over the ranks (one rank: the bare model), its own optimizer."""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

import zeroshard


class DDPBaseline:
    """Plain torch DistributedDataParallel (one rank: the bare model) behind the engine's interface:
    the compare baseline."""

    def __init__(self, model: nn.Module, make_opt, device: str) -> None:
        from torch.nn.parallel import DistributedDataParallel
        cuda = device == "cuda"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        model = model.to(self.device)
        one_rank = zeroshard.rank_and_world_size()[1] == 1  # plain torch: nothing to synchronize
        self.module = model if one_rank else DistributedDataParallel(
            model, device_ids=[self.device.index] if cuda else None)
        self.optimizer = make_opt([p for p in model.parameters() if p.requires_grad])

    def __call__(self, *args: Any) -> Any:
        return self.module(*args)

    def train(self, mode: bool = True) -> "DDPBaseline":
        self.module.train(mode)
        return self

    def eval(self) -> "DDPBaseline":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)  # keep gradients allocated, as DDP's buckets do

    def memory_stats(self) -> dict[str, int]:
        params = list(self.module.parameters())
        grads = [p.grad for p in params if p.grad is not None]
        states = zeroshard.tensor_bytes(params + grads) + zeroshard.optimizer_state_bytes(self.optimizer)
        return {"model_states": states}

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.module.parameters())
