"""Optimizer state across a resume, compared exactly: a two-group Adam (the groups with different lr,
betas and weight decay) resumed from a checkpoint holds bit-identical exp_avg, exp_avg_sq and step
per group, by parameter name: at the same world size and stage (and then trains on exactly as the
run that never stopped), and at another world size and stage."""
from __future__ import annotations

import os

import pytest
import torch

import zeroshard
from helpers.models import TinyGPT, batches, loss_fn
from helpers.spawn import spawn
from helpers.state import optimizer_state_by_name

GLOBAL_BATCH, FIRST, SECOND = 12, 3, 2


def _groups(model: TinyGPT) -> list[dict]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    return [{"params": [p for _, p in named if p.dim() >= 2]},
            {"params": [p for _, p in named if p.dim() < 2], "lr": 3e-3, "betas": (0.8, 0.95),
             "weight_decay": 0.0}]


def _engine(stage: int, seed: int):
    torch.manual_seed(seed)
    model = TinyGPT()
    return zeroshard.initialize(model, lambda g: torch.optim.Adam(g, lr=1e-2, weight_decay=0.01),
                                {"zero_optimization": {"stage": stage}}, param_groups=_groups(model))


def _train(engine, steps: range) -> None:
    rank, world_size = zeroshard.rank_and_world_size()
    local = GLOBAL_BATCH // world_size
    data = batches(steps.stop, GLOBAL_BATCH)
    for step in steps:
        x, y = data[step]
        mine = slice(rank * local, (rank + 1) * local)
        engine.backward(loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine]))
        engine.step()


def _assert_same_state(got, expected, what: str) -> None:
    (state, steps), (want, want_steps) = got, expected
    assert steps == want_steps and all(len(s) == 1 for s in steps), (what, steps, want_steps)
    assert sorted(state) == sorted(want), what
    assert {key for _, key in want} == {"exp_avg", "exp_avg_sq"}, what
    for k, v in want.items():
        assert torch.equal(state[k], v), (what, k)


def _save_and_resume(rank: int, world_size: int, directory: str) -> None:
    straight = _engine(3, seed=0)
    _train(straight, range(FIRST + SECOND))
    first = _engine(3, seed=0)
    _train(first, range(FIRST))
    saved = optimizer_state_by_name(first)
    first.save_checkpoint(directory)
    if rank == 0:
        torch.save(saved, os.path.join(directory, "saved_state.pt"))
    resumed = _engine(3, seed=7)
    resumed.load_checkpoint(directory)
    _assert_same_state(optimizer_state_by_name(resumed), saved, "loaded, same layout")
    _train(resumed, range(FIRST, FIRST + SECOND))
    _assert_same_state(optimizer_state_by_name(resumed), optimizer_state_by_name(straight), "trained on")
    expected = straight.full_state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in resumed.full_state_dict().items())


def _resume_elsewhere(rank: int, world_size: int, directory: str) -> None:
    saved = torch.load(os.path.join(directory, "saved_state.pt"))
    for stage in (0, 2):
        resumed = _engine(stage, seed=7)
        resumed.load_checkpoint(directory)
        _assert_same_state(optimizer_state_by_name(resumed), saved, f"loaded at N={world_size} stage {stage}")
    # As many groups, but one parameter moved to the other: its state and hyperparameters would be
    # the saved group's. Refused by name, as torch's load_state_dict refuses groups of other sizes.
    torch.manual_seed(7)
    model = TinyGPT()
    groups = _groups(model)
    groups[1]["params"].append(groups[0]["params"].pop(0))
    regrouped = zeroshard.initialize(model, lambda g: torch.optim.Adam(g, lr=1e-2),
                                     {"zero_optimization": {"stage": 2}}, param_groups=groups)
    with pytest.raises(zeroshard.CheckpointError, match=r"param_groups\[0\] holds other parameters than at "
                                                        r"save time \(\['pos'\] moved"):
        regrouped.load_checkpoint(directory)


def test_two_group_adam_state_resumes_bit_identical(tmp_path):
    spawn(_save_and_resume, 3, str(tmp_path))
    spawn(_resume_elsewhere, 2, str(tmp_path))
