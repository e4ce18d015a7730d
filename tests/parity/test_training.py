"""Training semantics at every stage match single-process fp32 training: clipping, gradient
accumulation, every common optimizer and a user one, parameter groups, an lr scheduler, and
optimizer offload."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest
import torch

import zeroshard
from helpers.spawn import spawn
from helpers.models import TinyGPT, assert_matches_reference, batches, close, loss_fn, reference_run

STEPS, GLOBAL_BATCH = 4, 12


class Smooth(torch.optim.Optimizer):
    """A user optimizer (elementwise, with state) that torch does not ship."""

    def __init__(self, params, lr: float = 0.01, beta: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta": beta})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    buf = self.state[p].setdefault("buf", torch.zeros_like(p))
                    buf.mul_(group["beta"]).add_(p.grad)
                    p.add_(buf / (1 + buf.abs()), alpha=-group["lr"])


def _decay_groups(model: torch.nn.Module) -> list[dict]:
    trainable = [p for p in model.parameters() if p.requires_grad]
    return [{"params": [p for p in trainable if p.dim() >= 2], "weight_decay": 0.1, "lr": 2e-2},
            {"params": [p for p in trainable if p.dim() < 2], "weight_decay": 0.0}]


@dataclass
class Case:
    make_opt: Callable
    config: dict
    groups: Callable | None = None
    scheduler: Callable | None = None
    min_stage: int = 0


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


CASES = {
    # SGD: Adam would amplify the last-bit difference between a norm summed over shards and torch's
    # norm of per-tensor norms, wherever a gradient is near zero.
    "clipping": Case(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), {"gradient_clipping": 0.05}),
    # SGD where gradient scale matters (accumulation averages micro-batches): AdamW would not notice.
    "accumulation": Case(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                         {"gradient_accumulation_steps": 2, "zero_optimization": {"overlap_comm": True}}),
    "accumulation_no_overlap": Case(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
                                    {"gradient_accumulation_steps": 2,
                                     "zero_optimization": {"overlap_comm": False}}),
    "adam": Case(lambda p: torch.optim.Adam(p, lr=1e-2), {}),
    # fused AdamW decides skipping and clipping on the device (optim_step.py), with no host sync first
    "clipping_fused_adamw": Case(lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
                                 {"gradient_clipping": 0.05}),
    "sgd_momentum": Case(lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True), {}),
    "adagrad": Case(lambda p: torch.optim.Adagrad(p, lr=0.05), {}),
    "rmsprop": Case(lambda p: torch.optim.RMSprop(p, lr=1e-3, momentum=0.5), {}),
    "user_optimizer": Case(lambda p: Smooth(p, lr=0.01), {}),
    "groups_and_scheduler": Case(lambda p: torch.optim.AdamW(p, lr=1e-2), {}, _decay_groups,
                                 lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=2, gamma=0.5)),
    "offload": Case(_adamw,
                    {"zero_optimization": {"offload_optimizer": {"device": "cpu", "pin_memory": True}}},
                    min_stage=1),
}


def reference(case: Case, norms: list[float]):
    def model() -> TinyGPT:
        torch.manual_seed(0)
        return TinyGPT()
    return reference_run(model, case.make_opt, STEPS, GLOBAL_BATCH, case.groups, case.scheduler,
                         case.config.get("gradient_clipping", 0.0), norms=norms)


def train(case: Case, stage: int, rank: int, world_size: int):
    torch.manual_seed(0)
    model = TinyGPT()
    zero = {**case.config.get("zero_optimization", {}), "stage": stage}
    engine = zeroshard.initialize(model, case.make_opt, {**case.config, "zero_optimization": zero},
                                  param_groups=case.groups(model) if case.groups else None)
    scheduler = case.scheduler(engine.optimizer) if case.scheduler else None
    micro = engine.config.gradient_accumulation_steps
    local = GLOBAL_BATCH // world_size
    losses = []
    for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        x, y = x[rank * local:(rank + 1) * local], y[rank * local:(rank + 1) * local]
        step_loss = torch.zeros(())
        for m in range(micro):  # step() every micro-batch; it updates at the boundary only
            part = slice(m * local // micro, (m + 1) * local // micro)
            loss = loss_fn(engine(x[part], use_sometimes=step % 2 == 0), y[part])
            engine.backward(loss)
            assert engine.is_gradient_accumulation_boundary() == (m == micro - 1)
            engine.step()
            step_loss += loss.detach() / micro
        assert engine.global_steps == step + 1
        if scheduler:
            scheduler.step()
        torch.distributed.all_reduce(step_loss)
        losses.append(step_loss.item() / world_size)
    return engine, losses


def _semantics(rank: int, world_size: int, names: list[str]) -> None:
    for name in names:
        case = CASES[name]
        norms: list[float] = []
        ref_model, ref_losses = reference(case, norms)
        for stage in range(case.min_stage, 4):
            engine, losses = train(case, stage, rank, world_size)
            assert_matches_reference(engine, losses, ref_model, ref_losses, f"{name} stage {stage}")
            # measured at every step, clipping or not (Trainer logs it as grad_norm)
            close([engine.last_grad_norm], norms[-1:], rtol=1e-5, what=f"{name} stage {stage} norm")
            if name.startswith("clipping"):  # the clip really cut: the global norm was above the threshold
                assert engine.last_grad_norm > 5 * case.config["gradient_clipping"]
            if name == "offload":  # master weights and Adam state are held by the host copy
                stats = engine.memory_stats()
                trainable = [f for f in engine.flats if f.trainable]
                shards = sum(f.layout.shard_numel for f in trainable)
                # fp32 master (4) + Adam's two moments (8) per owned element, and a step counter each
                assert 12 * shards <= stats["optimizer"] <= 12 * shards + 8 * len(trainable), stats
                assert stats["offloaded"] == stats["optimizer"]
                assert all(t.device.type == "cpu"
                           for s in engine.optimizer.state.values() for t in s.values())


@pytest.mark.parametrize("world_size", [2, 3])
def test_training_semantics_match_single_process(world_size):
    spawn(_semantics, world_size, list(CASES))


def test_one_rank_adds_every_micro_batch():
    """With one rank no collective runs: each reduction is a local copy, or an add where a later
    micro-batch's gradient joins the sum (stages 2-3 reduce every backward)."""
    spawn(_semantics, 1, ["accumulation", "accumulation_no_overlap"])
