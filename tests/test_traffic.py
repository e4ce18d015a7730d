"""Bytes per step: 2Ψ at stages 0-2 and at most 3Ψ at stage 3, counted by the engine and,
independently, by wrapping torch.distributed's collectives."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
import torch.distributed as dist

import zeroshard
from dist import spawn
from models import TinyGPT, loss_fn, rank_batch

# The paper's convention: all-reduce = 2x its tensor, all-gather = its output, reduce-scatter = its input.
_WRAPPED = {"all_reduce": lambda t, *a, **k: 2 * t.numel() * t.element_size(),
            "all_gather_single": lambda out, inp, *a, **k: out.numel() * out.element_size(),
            "all_gather_into_tensor": lambda out, inp, *a, **k: out.numel() * out.element_size(),
            "reduce_scatter_single": lambda out, inp, *a, **k: inp.numel() * inp.element_size(),
            "reduce_scatter_tensor": lambda out, inp, *a, **k: inp.numel() * inp.element_size()}


def _wiretap() -> Counter:
    seen: Counter = Counter()
    for name, size in _WRAPPED.items():
        original = getattr(dist, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, _size=size, **kwargs):
            seen[_name.split("_single")[0].split("_into")[0].replace("_tensor", "")] += _size(*args, **kwargs)
            return _original(*args, **kwargs)
        setattr(dist, name, wrapped)
    return seen


def _traffic(rank: int, world_size: int) -> None:
    wire = _wiretap()
    x, y = rank_batch(rank, world_size)
    for stage in range(4):
        torch.manual_seed(0)
        engine = zeroshard.initialize(TinyGPT(d=32, layers=3), lambda p: torch.optim.Adam(p, lr=1e-3),
                                      {"zero_optimization": {"stage": stage}})
        for _ in range(2):
            wire.clear()
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        step = {k: v["bytes"] for k, v in engine.comm_stats()["last_step"].items()}
        assert {k: v for k, v in step.items() if v} == dict(+wire), (stage, step, wire)
        trainable = 4 * sum(f.layout.padded_numel for f in engine.flats if f.trainable)
        everything = 4 * sum(f.layout.padded_numel for f in engine.flats)
        root = 4 * sum(f.layout.padded_numel for f in engine.units[0].flats)
        if stage == 0:
            assert step == {"all_reduce": 2 * trainable, "all_gather": 0, "reduce_scatter": 0, "broadcast": 0}
        elif stage in (1, 2):  # never an all-reduce: that would make it 3Ψ
            assert step == {"all_reduce": 0, "all_gather": trainable, "reduce_scatter": trainable, "broadcast": 0}
        else:  # forward and backward gathers (the root stays gathered between them) + reduce-scatter
            assert step == {"all_reduce": 0, "all_gather": 2 * everything - root,
                            "reduce_scatter": trainable, "broadcast": 0}
            assert sum(step.values()) <= 3 * everything
        total = engine.comm_stats()["total"]
        assert total["broadcast"]["calls"] > 0  # set-up traffic is in the total, not in the step


@pytest.mark.parametrize("world_size", [2, 3])
def test_traffic_per_step(world_size):
    spawn(_traffic, world_size)
