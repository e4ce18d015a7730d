"""Stages 0-3 at world sizes 1-4 train exactly like one process on the whole global batch."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from zeroshard.core import flat_grad
from helpers.spawn import spawn
from helpers.models import (TinyGPT, adamw, assert_matches_reference, reference_run, sgd, tiny_gpt,
                            train_on_slices)

STEPS, GLOBAL_BATCH = 4, 12


CASES = [  # (config extras, optimizer): both unit policies, tiny buckets, overlap, persistence threshold
    ({"zeroshard": {"unit_modules": ["Block"]}}, adamw),
    ({"zero_optimization": {"overlap_comm": False}}, sgd),  # stage 3 without prefetch
    # SGD wherever gradient scale matters: AdamW would hide a gradient off by a constant factor.
    ({"zero_optimization": {"reduce_bucket_size": 50, "allgather_bucket_size": 70, "overlap_comm": True,
                            "stage3_param_persistence_threshold": 100}}, sgd),
]


def _parity(rank: int, world_size: int, cases: list[int]) -> None:
    for case in cases:
        extra, make_opt = CASES[case]
        ref_model, ref_losses = reference_run(tiny_gpt, make_opt, STEPS, GLOBAL_BATCH)
        for stage in range(4):
            config = {**extra, "zero_optimization": {**extra.get("zero_optimization", {}), "stage": stage}}
            # Other ranks start from another seed: initialize() must broadcast rank 0's values.
            engine = zeroshard.initialize(tiny_gpt(seed=rank), make_opt, config)
            losses = train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
            assert_matches_reference(engine, losses, ref_model, ref_losses,
                                     f"case {case} stage {stage} world {world_size}")


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_every_stage_matches_single_process(world_size):
    spawn(_parity, world_size, [0])


@pytest.mark.parametrize("world_size", [2, 3])
def test_sgd_auto_units_buckets_and_persistence(world_size):
    spawn(_parity, world_size, [1, 2])


def _poisoned(rank: int, world_size: int, cases: list[int]) -> None:
    flat_grad.UNFILLED = lambda size, **kw: torch.full(size, float("nan"), **kw)
    _parity(rank, world_size, cases)


@pytest.mark.parametrize("world_size", [3])
def test_unfilled_gradient_memory_is_never_read_before_it_is_written(world_size):
    """Gradient buffers are made unfilled (flat_grad.UNFILLED): here they start as NaN, so a slot no
    gradient reached, padding left as it was, or a shard read before its reduction wrote it would
    make a gradient non-finite. Padding needs an odd world size; case 2 reduces in many chunks."""
    spawn(_poisoned, world_size, [0, 2])


def _mixed_model(seed: int = 0) -> TinyGPT:
    """Units of about 8.4k (block 0, and `twice` in the root), 33k and 131k elements."""
    torch.manual_seed(seed)
    return TinyGPT(d=32, mults=(4, 16, 64))


def _persistence(rank: int, world_size: int) -> None:
    """Stage 3 at DeepSpeed-like persistence thresholds: buffers at or under the threshold stay
    gathered (and are all-gathered after each step), larger ones are gathered around each use.
    zeroshard's threshold applies to a flat buffer (a unit's parameters of one group), DeepSpeed's
    to each parameter."""
    ref_model, ref_losses = reference_run(_mixed_model, sgd, STEPS, GLOBAL_BATCH)
    for threshold in (10_000, 100_000):
        engine = zeroshard.initialize(_mixed_model(seed=rank), sgd, {"zero_optimization": {
            "stage": 3, "stage3_param_persistence_threshold": threshold}})
        trainable = [f for f in engine.flats if f.trainable]
        assert any(f.persistent for f in trainable) and not all(f.persistent for f in trainable), threshold
        losses = train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
        assert_matches_reference(engine, losses, ref_model, ref_losses, f"threshold {threshold}")


@pytest.mark.parametrize("world_size", [3])
def test_stage3_persistent_and_gathered_units(world_size):
    spawn(_persistence, world_size)
