"""Bytes per step: 2Ψ at stages 0-2 and at most 3Ψ at stage 3, counted by the engine and,
independently, by wrapping torch.distributed's collectives."""
from __future__ import annotations

import os
import sys

import pytest
import torch

import zeroshard
from helpers import ROOT
from helpers.spawn import spawn
from helpers.models import TinyGPT, loss_fn, rank_batch

sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
from wiretap import by_kind, wiretap  # noqa: E402  (torch.distributed's Python API, every collective)


def _traffic(rank: int, world_size: int, directory: str) -> None:
    x, y = rank_batch(rank, world_size)
    paper = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0}  # one unit at a time
    for stage, extra in [(0, {}), (1, {}), (2, {}), (3, paper), (3, {})]:
        torch.manual_seed(0)
        engine = zeroshard.initialize(TinyGPT(d=32, layers=3), lambda p: torch.optim.Adam(p, lr=1e-3),
                                      {"zero_optimization": {"stage": stage, **extra}})
        for _ in range(2):
            with wiretap() as wire:  # broadcasts, list and all-to-all collectives are seen too
                engine.backward(loss_fn(engine(x), y))
                engine.step()
        step = {k: v["bytes"] for k, v in engine.comm_stats()["last_step"].items()}
        # One reduce-scatter per trainable buffer, except at stages 2-3, where the last two in reduce
        # order (block 0's and the root's) always go out as one.
        buffers = sum(f.trainable for f in engine.flats)
        calls = engine.comm_stats()["last_step"]["reduce_scatter"]["calls"]
        assert calls == {0: 0, 1: buffers, 2: buffers - 1, 3: buffers - 1}[stage], (stage, calls, buffers)
        # On gloo, comm.py reduce-scatters with all_to_all_single (the same bytes): counted as one.
        assert {k: v for k, v in step.items() if v} == by_kind(wire, all_to_all_reduces=True), (stage, wire)
        trainable = 4 * sum(f.layout.padded_numel for f in engine.flats if f.trainable)
        everything = 4 * sum(f.layout.padded_numel for f in engine.flats)
        root = 4 * sum(f.layout.padded_numel for f in engine.units[0].flats)
        flag = 8  # stages 1-3: the non-finite flag, one float32 all-reduced (counted twice: RS + AG)
        if stage == 0:
            assert step == {"all_reduce": 2 * trainable, "all_gather": 0, "reduce_scatter": 0, "broadcast": 0}
        elif stage in (1, 2):  # never a gradient all-reduce: that would make it 3Ψ
            assert step == {"all_reduce": flag, "all_gather": trainable, "reduce_scatter": trainable,
                            "broadcast": 0}
        elif not extra:  # gloo's defaults: their window (2^20 elements) holds this model, so every
            # unit stays gathered from forward into backward: each is gathered once a step
            assert step == {"all_reduce": flag, "all_gather": everything, "reduce_scatter": trainable,
                            "broadcast": 0}
        else:  # forward and backward gathers + reduce-scatter; three units stay gathered from
            # forward to backward: the root, the last block to run forward (backward starts with it)
            # and the block before it (backward prefetches it at once)
            last = 4 * sum(f.layout.padded_numel for u in engine.units[-2:] for f in u.flats)
            assert step == {"all_reduce": flag, "all_gather": 2 * everything - root - last,
                            "reduce_scatter": trainable, "broadcast": 0}
            assert sum(step.values()) - flag <= 3 * everything
        total = engine.comm_stats()["total"]
        assert total["broadcast"]["calls"] > 0  # set-up traffic is in the total, not in the step
        with wiretap() as wire:  # an export (gathers, and broadcasts of buffers): in the total only
            engine.full_state_dict()
        after = engine.comm_stats()
        grown = {k: after["total"][k]["bytes"] - v["bytes"] for k, v in total.items()}
        assert {k: v for k, v in grown.items() if v} == by_kind(wire) and "broadcast" in by_kind(wire), stage
        assert {k: v["bytes"] for k, v in after["last_step"].items()} == step  # the step's window is kept
        tag = f"stage{stage}{'-paper' if extra else ''}"
        engine.save_checkpoint(directory, tag=tag)  # its metadata gathers count, outside the step
        saved = engine.comm_stats()
        assert saved["total"]["all_gather"]["calls"] > after["total"]["all_gather"]["calls"], stage
        assert saved["last_step"] == after["last_step"], stage


@pytest.mark.parametrize("world_size", [2, 3])
def test_traffic_per_step(world_size, tmp_path):
    spawn(_traffic, world_size, str(tmp_path))


def _one_rank(rank: int, world_size: int) -> None:
    x, y = rank_batch(rank, world_size)
    for stage in (0, 1, 2, 3):
        for bucket in (None, 2000):  # 2000: several chunks a buffer
            zero = {"stage": stage, **({"reduce_bucket_size": bucket} if bucket else {})}
            torch.manual_seed(0)
            engine = zeroshard.initialize(TinyGPT(d=32, layers=3), lambda p: torch.optim.Adam(p, lr=1e-3),
                                          {"zero_optimization": zero})
            for _ in range(2):
                with wiretap() as wire:
                    engine.backward(loss_fn(engine(x), y))
                    engine.step()
            assert not by_kind(wire), (stage, wire)  # nothing went to the backend
            step = engine.comm_stats()["last_step"]
            trainable = [f for f in engine.flats if f.trainable]
            if stage == 0:
                assert step["all_reduce"]["bytes"] == 2 * 4 * sum(f.layout.padded_numel for f in trainable)
                continue
            # Counted as the collectives ranks would issue: one a chunk, or one a group reduced together.
            calls = sum(1 if len(group) > 1 else len(group[0].layout.shard_chunks(group[0].buckets.reduce))
                        for group in engine.reducer.groups)
            counted = {k: step["reduce_scatter"][k] for k in ("calls", "bytes")}
            expected = {"calls": calls, "bytes": 4 * sum(f.layout.padded_numel for f in trainable)}
            assert counted == expected, stage
            assert step["reduce_scatter"]["inter_node_bytes"] == 0  # (one rank: one node)
            assert calls > len(engine.reducer.groups) or bucket is None, "2000 made no second chunk"


def test_one_rank_counts_the_collectives_it_does_not_send():
    """With one rank the backend is never called, but comm_stats() counts what a world of ranks
    would send: the paper's figures, and the same calls, at every world size."""
    spawn(_one_rank, 1)


def _post_step_gathers(rank: int, world_size: int) -> None:
    """Stages 1-2: the post-step all-gathers of small buffers go out as one collective (a gloo
    collective's fixed cost dwarfs their bytes); alone, buffer by buffer, once the limit is below
    them. Same bytes, same losses to the bit."""
    from zeroshard.core import gather_together
    x, y = rank_batch(rank, world_size)
    for stage in (1, 2):
        results = {}
        for limit in (gather_together.TOGETHER_NUMEL, 1):
            gather_together.TOGETHER_NUMEL = limit
            torch.manual_seed(0)
            engine = zeroshard.initialize(TinyGPT(d=32, layers=3), lambda p: torch.optim.Adam(p, lr=1e-3),
                                          {"zero_optimization": {"stage": stage}})
            losses = []
            for _ in range(3):
                loss = loss_fn(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            trainable = [f for f in engine.flats if f.trainable]
            step = engine.comm_stats()["last_step"]["all_gather"]
            results[limit] = (step["calls"], step["bytes"], losses, len(trainable))
        gather_together.TOGETHER_NUMEL = 1 << 20
        (together, bytes_together, losses, n), (alone, bytes_alone, losses_alone, _) = results.values()
        assert sum(f.layout.padded_numel for f in trainable) < 1 << 20 and n >= 4  # small: they fit one
        assert (together, alone) == (1, n), (stage, results)
        assert bytes_together == bytes_alone and losses == losses_alone, (stage, results)


def test_post_step_gathers_of_small_buffers_go_together():
    spawn(_post_step_gathers, 3)


def test_runs_keep_order_and_stay_within_the_limit():
    """runs(): consecutive buffers, one dtype and one group each, at most TOGETHER_NUMEL (and the
    allgather bucket) elements, a larger buffer alone."""
    from types import SimpleNamespace

    from zeroshard.core.gather_together import TOGETHER_NUMEL, runs
    group, other = SimpleNamespace(zeropp=None), SimpleNamespace(zeropp=None)

    def flat(numel, dtype=torch.float32, comm=group, bucket=10**9):
        return SimpleNamespace(layout=SimpleNamespace(padded_numel=numel), full=torch.empty(0, dtype=dtype),
                               comm=comm, buckets=SimpleNamespace(gather=bucket), name=numel)
    half = TOGETHER_NUMEL // 2
    flats = [flat(half), flat(half), flat(1), flat(2 * TOGETHER_NUMEL), flat(3), flat(4, torch.bfloat16),
             flat(5, torch.bfloat16, other), flat(6, bucket=10), flat(7, bucket=10)]
    assert [[f.name for f in run] for run in runs(flats)] == \
        [[half, half], [1], [2 * TOGETHER_NUMEL], [3], [4], [5], [6], [7]]


def _two_buckets_at_most(rank: int, world_size: int) -> None:
    """Many small buffers: the post-step gathers go out in runs, and the oldest run lands (its bucket
    freed) before a new one goes out, so at most two buckets exist at once over the whole step, with
    one sub-group or many, not a second copy of the model."""
    from zeroshard.comm import buckets as bucketing
    from zeroshard.core import gather_together
    x, y = rank_batch(rank, world_size)
    issue = bucketing.gather_together
    for sub_groups in ("one", "many"):
        torch.manual_seed(0)
        model = TinyGPT(d=32, layers=10)
        block = sum(p.numel() for p in model.blocks[1].parameters())
        zero = {"stage": 1}
        if sub_groups == "many":  # four blocks' shards a sub-group: two runs each
            zero["sub_group_size"] = 4 * (block // world_size + 1)
        engine = zeroshard.initialize(model, lambda p: torch.optim.Adam(p, lr=1e-3),
                                      {"zero_optimization": zero})
        gather_together.TOGETHER_NUMEL = 2 * block + 2 * world_size  # runs of two blocks
        buckets, alive = [], []

        def counted(comm, fulls, shards, async_op=False):
            pending = issue(comm, fulls, shards, async_op)
            buckets.append(pending[0][2])
            alive.append(sum(b.untyped_storage().nbytes() > 0 for b in buckets))  # this one too
            return pending
        bucketing.gather_together = counted
        try:
            engine.backward(loss_fn(engine(x), y))
            engine.step()
        finally:
            bucketing.gather_together, gather_together.TOGETHER_NUMEL = issue, 1 << 20
        assert len(buckets) >= 4 and max(alive) == 2, (sub_groups, alive)
        assert all(b.untyped_storage().nbytes() == 0 for b in buckets)  # all landed by the step's end


def test_post_step_gathers_keep_two_buckets_at_most():
    spawn(_two_buckets_at_most, 2)
