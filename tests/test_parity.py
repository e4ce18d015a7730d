"""Stages 0-3 at world sizes 1-4 train exactly like one process on the whole global batch."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from dist import spawn
from models import TinyGPT, batches, loss_fn, reference_run

STEPS, GLOBAL_BATCH = 4, 12


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def _model(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


def train(engine, rank: int, world_size: int) -> list[float]:
    local = GLOBAL_BATCH // world_size
    losses = []
    for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
        mine = slice(rank * local, (rank + 1) * local)
        loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    # The global loss is the mean of the ranks' local means (equal local batch sizes).
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    return (stacked / world_size).tolist()


def assert_matches_reference(engine, losses, ref_model, ref_losses, what: str) -> None:
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=1e-6), what
    full = engine.full_state_dict()
    ref = ref_model.state_dict()
    assert list(full) == list(ref), what
    for name, value in ref.items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=2e-6, msg=lambda m: f"{what} {name}: {m}")


CASES = [  # (config extras, optimizer): both unit policies, tiny buckets, overlap, persistence threshold
    ({"zeroshard": {"unit_modules": ["Block"]}}, _adamw),
    ({"zero_optimization": {"overlap_comm": False}}, _sgd),  # stage 3 without prefetch
    ({"zero_optimization": {"reduce_bucket_size": 50, "allgather_bucket_size": 70, "overlap_comm": True,
                            "stage3_param_persistence_threshold": 100}}, _adamw),
]


def _parity(rank: int, world_size: int, cases: list[int]) -> None:
    for case in cases:
        extra, make_opt = CASES[case]
        ref_model, ref_losses = reference_run(_model, make_opt, STEPS, GLOBAL_BATCH)
        for stage in range(4):
            config = {**extra, "zero_optimization": {**extra.get("zero_optimization", {}), "stage": stage}}
            # Other ranks start from another seed: initialize() must broadcast rank 0's values.
            engine = zeroshard.initialize(_model(seed=rank), make_opt, config)
            losses = train(engine, rank, world_size)
            assert_matches_reference(engine, losses, ref_model, ref_losses,
                                     f"case {case} stage {stage} world {world_size}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_matches_single_process(world_size):
    spawn(_parity, world_size, [0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_sgd_auto_units_buckets_and_persistence(world_size):
    spawn(_parity, world_size, [1, 2])
