"""Mixed precision: bf16 tracks a single-process bf16 reference at every stage with the paper's
2Ψ + 2Ψ + 12Ψ split; fp16 overflow on one rank skips the step on all ranks."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from dist import spawn
from models import TinyGPT, batches, loss_fn, rank_batch

STEPS, GLOBAL_BATCH = 6, 12
# Documented in docs/configuration.md: bf16 losses stay within this of the single-process bf16
# reference. The ranks' bf16 gradients are summed in another order than one process sums them, so
# the two runs round differently; 0.0034 was measured here over 6 steps.
BF16_LOSS_TOLERANCE = 0.02


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


def bf16_reference() -> list[float]:
    """One process: bf16 parameters, activations and gradients; fp32 master weights and AdamW."""
    torch.manual_seed(0)
    model = TinyGPT()
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    master = [torch.nn.Parameter(p.detach().clone()) for p in named.values()]
    opt = _adamw(master)
    model.bfloat16()
    losses = []
    for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        loss = loss_fn(model(x, use_sometimes=step % 2 == 0).float(), y)
        loss.backward()
        for m, p in zip(master, named.values()):
            m.grad = torch.zeros_like(m) if p.grad is None else p.grad.float()
            p.grad = None
        opt.step()
        with torch.no_grad():
            for m, p in zip(master, named.values()):
                p.copy_(m)
        losses.append(loss.item())
    return losses


def _bf16(rank: int, world_size: int) -> None:
    reference = bf16_reference()
    local = GLOBAL_BATCH // world_size
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeroshard.initialize(TinyGPT(), _adamw, {"bf16": {"enabled": True},
                                                          "zero_optimization": {"stage": stage}})
        losses = []
        for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
            mine = slice(rank * local, (rank + 1) * local)
            loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0).float(), y[mine])
            engine.backward(loss)
            if step == STEPS - 1:
                _check_bf16_memory(engine, stage, world_size)
            engine.step()
            torch.distributed.all_reduce(loss := loss.detach())
            losses.append(loss.item() / world_size)
        assert max(abs(a - b) for a, b in zip(losses, reference)) < BF16_LOSS_TOLERANCE, (stage, losses, reference)
        assert losses[-1] < losses[0] - 1.0  # and it trains
        for value in engine.full_state_dict().values():
            assert value.dtype in (torch.float32, torch.int64)  # exports are fp32, from the master


def _check_bf16_memory(engine, stage: int, n: int) -> None:
    """2Ψ bf16 params + 2Ψ bf16 grads + 12Ψ fp32 master and Adam, split by stage as in the paper."""
    stats = engine.memory_stats()
    psi, psi_t = engine.num_parameters(), engine.num_parameters(trainable_only=True)
    expected = zeroshard.paper_model_state_bytes(psi_t, n, stage, 2, 2, 12) + \
        (2 * (psi - psi_t) / (n if stage == 3 else 1))  # frozen parameters: bf16 values only
    slack = 16 * n * len(engine.flats)  # padding (< N elements per buffer) and Adam's step counters
    assert abs(stats["model_states"] - expected) <= slack, (stage, stats, expected)
    assert stats["temporary"] == 0


@pytest.mark.parametrize("world_size", [2, 3])
def test_bf16_every_stage(world_size):
    spawn(_bf16, world_size)


def _fp16_overflow(rank: int, world_size: int) -> None:
    x, y = rank_batch(rank, world_size)
    for stage in range(4):
        torch.manual_seed(0)
        model = TinyGPT()
        poison = {"on": False}
        if rank == 1:  # an inf gradient on one rank only, in one parameter
            model.blocks[1].up.weight.register_hook(
                lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
        engine = zeroshard.initialize(model, _adamw, {"zero_optimization": {"stage": stage},
                                                      "fp16": {"enabled": True, "initial_scale_power": 8,
                                                               "hysteresis": 1, "min_loss_scale": 64}})
        engine.backward(loss_fn(engine(x).float(), y))
        engine.step()  # a clean step
        assert engine.skipped_steps == 0
        before = engine.full_state_dict()
        adam_steps = [s["step"].item() for s in engine.optimizer.state.values()]
        poison["on"] = True
        engine.backward(loss_fn(engine(x).float(), y))
        engine.step()
        assert engine.skipped_steps == 1 and engine.loss_scale == 128.0  # on every rank
        after = engine.full_state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # parameters untouched
        assert [s["step"].item() for s in engine.optimizer.state.values()] == adam_steps
        poison["on"] = False
        engine.backward(loss_fn(engine(x).float(), y))
        engine.step()  # training resumes
        assert engine.skipped_steps == 1
        assert any(not torch.equal(after[k], v) for k, v in engine.full_state_dict().items())
        # Overflow that persists down to the minimum scale is an error, not endless skipping.
        poison["on"] = True
        engine.backward(loss_fn(engine(x).float(), y))
        engine.step()  # 128 -> 64
        engine.backward(loss_fn(engine(x).float(), y))
        with pytest.raises(FloatingPointError, match="minimum loss scale"):
            engine.step()


@pytest.mark.parametrize("world_size", [3])
def test_fp16_overflow_skips_on_every_rank(world_size):
    spawn(_fp16_overflow, world_size)
