"""Per-rank memory equals the paper's formula (up to padding), by the engine's counters and by an
independent census of every live tensor."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from helpers.accounting import adam_formula, live_tensor_bytes
from zeroshard.core import heap
from helpers.spawn import spawn
from helpers.margins import close
from helpers.models import TinyGPT, loss_fn, rank_batch


def _measure(rank: int, world_size: int) -> None:
    x, y = rank_batch(rank, world_size)
    for precision in ("fp32", "bf16"):
        census = {stage: _measure_stage(stage, world_size, x, y, precision) for stage in range(4)}
        # The census shrinks with the stage: 16Ψ > 4Ψ+12Ψ/N (fp32: 8Ψ+8Ψ/N) > ... > 16Ψ/N (N >= 2).
        assert census[0] > census[1] > census[2] > census[3], (precision, census)


def _measure_stage(stage: int, world_size: int, x: torch.Tensor, y: torch.Tensor, precision: str) -> int:
    """Train two backwards at `stage`, check every figure, return the census (all locals then die)."""
    torch.manual_seed(0)
    config = {"zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"}}
    engine = zeroshard.initialize(TinyGPT(d=64, layers=4), lambda p: torch.optim.AdamW(p, lr=1e-3), config)
    for _ in range(2):  # the second backward sees Adam's state, created by the first step
        engine.backward(loss_fn(engine(x).float(), y))
        if _ == 0:
            engine.step()
    stats = engine.memory_stats()
    flats = engine.flats
    pb = 4 if precision == "fp32" else 2  # bytes of a parameter or gradient element
    psi_all, psi_train = engine.num_parameters(), engine.num_parameters(trainable_only=True)
    formula = adam_formula(psi_all, psi_train, world_size, stage, pb)
    # Stage 3 in 16 bits keeps no 16-bit shard beside a trainable buffer's fp32 master (each gather
    # casts the master, as FSDP2 does): 14Ψ/N, the paper's 16Ψ/N less its 2Ψ/N of 16-bit params.
    cast = stage == 3 and pb == 2
    formula -= pb * psi_train / world_size if cast else 0
    what = f"{precision} stage {stage}"
    # Padding: fewer than N elements per flat buffer, 16 bytes each at most; Adam's step counters.
    slack = 16 * (world_size - 1) * len(flats) + 8 * len(flats)
    assert stats["temporary"] == 0, stats  # everything gathered or full-size is freed after backward
    close(stats["model_states"], formula, atol=slack, what=f"{what} model states against the paper")
    # Exact expectations from the layout (what the formula's "up to padding" means).
    shard = lambda f: f.layout.shard_numel if stage else f.layout.padded_numel  # noqa: E731
    assert stats["params"] == pb * sum(f.layout.shard_numel if stage == 3 else f.layout.padded_numel
                                       for f in flats if not (cast and f.trainable))
    assert not cast or not any(f.persistent for f in flats)  # (a kept-gathered buffer keeps its shard)
    assert stats["grads"] == pb * sum(f.layout.shard_numel if stage >= 2 else f.layout.padded_numel
                                      for f in flats if f.trainable)
    k = 8 if pb == 4 else 12  # Adam's two moments, and the fp32 master where it is a copy
    owned = sum(shard(f) for f in flats if f.trainable)
    assert k * owned <= stats["optimizer"] <= k * owned + 8 * len(flats), (what, stats["optimizer"], owned)
    # Independently: every live storage in this process, against the library and the formula.
    measured = live_tensor_bytes()
    library = stats["model_states"] + stats["buffers"] + stats["temporary"]
    assert measured >= library, (what, measured, library)  # the census sees everything the library counts
    close(measured - library, 0, atol=16 * 1024, what=f"{what} census beyond memory_stats()")
    close(measured, formula, atol=slack + stats["buffers"] + 16 * 1024,
          what=f"{what} census against the paper")
    _check_after_step(engine, stats, stage, what)
    return measured


def _check_after_step(engine, before: dict, stage: int, what: str) -> None:
    """After the step, stages 2-3 hold no gradient until the next backward (so the forward, where
    activations peak, has none), and nothing else keeps it alive; stages 0-1 keep theirs."""
    engine.step()
    stats = engine.memory_stats()
    assert stats["grads"] == (0 if stage >= 2 else before["grads"]), (what, stats)
    assert stats["grads_in_step"] == before["grads"] > 0, (what, stats)
    assert stats["model_states_in_step"] == before["model_states"], (what, stats)
    library = stats["model_states"] + stats["buffers"] + stats["temporary"]
    close(live_tensor_bytes() - library, 0, atol=16 * 1024, what=f"{what} census after the step")


@pytest.mark.parametrize("world_size", [2, 3])
def test_memory_matches_paper_formula(world_size):
    spawn(_measure, world_size)


def _constant_buffers(rank: int, world_size: int) -> None:
    """CB: gathered units, full-size gradients and staging buckets do not grow with the model.
    (Stage 3 at gloo's defaults, their window narrowed below these models: 2^20 elements would
    hold them whole.)"""
    zeroshard.core.gather_together.TOGETHER_NUMEL = 20_000  # the window of gloo's defaults (prefetch, reuse)
    x, y = rank_batch(rank, world_size)
    for stage in (2, 3):
        seen = {}
        for layers in (8, 32):  # 4x deeper (from past the depth where the prefetch pipeline fills)
            torch.manual_seed(0)
            engine = zeroshard.initialize(TinyGPT(d=32, layers=layers),
                                          lambda p: torch.optim.Adam(p, lr=1e-3),
                                          {"zero_optimization": {"stage": stage, "reduce_bucket_size": 4096,
                                                                 "allgather_bucket_size": 4096}})
            for _ in range(2):
                engine.backward(loss_fn(engine(x), y))
                engine.step()
            seen[layers] = engine.memory_stats()
        small, large = seen[8], seen[32]
        assert large["model_states"] > 2.5 * small["model_states"]
        assert large["peak_temporary"] == small["peak_temporary"] > 0, (stage, small, large)
        assert large["largest_bucket"] == small["largest_bucket"] <= 4 * 4096


def test_temporary_buffers_do_not_grow_with_the_model():
    spawn(_constant_buffers, 2)


def _prefetch_limits(rank: int, world_size: int) -> None:
    """stage3_prefetch_bucket_size, stage3_max_live_parameters and stage3_max_reuse_distance bound
    how many units are gathered at once during forward, and which stay gathered into backward, with
    DeepSpeed's meanings; they never change the results."""
    x, y = rank_batch(rank, world_size)
    block = 4 * 32 * 32 * 2 + 4 * 32 + 32 + 2 * 32  # elements of one Block(d=32), padded to N below
    unit = -(-block // world_size) * world_size
    root = None
    results = {}
    paper = {"stage3_prefetch_bucket_size": 1, "stage3_max_reuse_distance": 0}  # one unit at a time
    for name, extra in {"next unit": {}, "none": {"stage3_prefetch_bucket_size": 0},
                        "3 units": {"stage3_prefetch_bucket_size": 3 * unit},
                        "under a unit": {"stage3_prefetch_bucket_size": unit // 2},  # overshoots by one
                        "3 units, live cap": {"stage3_prefetch_bucket_size": 3 * unit,
                                              "stage3_max_live_parameters": "root + 2 units"},
                        # reuse counts the later units' forward and backward: 3 later units -> 6 units
                        "reuse": {"stage3_max_reuse_distance": 6 * unit},
                        "reuse, live cap": {"stage3_max_reuse_distance": 6 * unit,
                                            "stage3_max_live_parameters": "root + 3 units"},
                        "CUDA's free tail": {},
                        "CUDA's free tail, reuse": {"stage3_max_reuse_distance": 6 * unit},
                        "gloo's window": {},
                        "gloo's, no prefetch": {"stage3_prefetch_bucket_size": 0}}.items():
        torch.manual_seed(0)
        model = TinyGPT(d=32, layers=8)
        extra = extra if name.startswith("gloo's") else {**paper, **extra}  # gloo's: its defaults
        cap = extra.get("stage3_max_live_parameters")
        if isinstance(cap, str):
            extra = {**extra, "stage3_max_live_parameters": root + int(cap.split()[2]) * unit}
        engine = zeroshard.initialize(model, lambda p: torch.optim.Adam(p, lr=1e-3),
                                      {"zero_optimization": {"stage": 3, **extra},
                                       "zeroshard": {"unit_modules": ["Block"]}})
        root = engine.units[0].numel
        assert engine.unit_order.keep_tail == ("none" not in name and "no prefetch" not in name)  # (gloo)
        engine.unit_order.keep_tail &= not name.startswith("CUDA's free tail")
        most, kept, most_back = [], [], []
        for b in model.blocks:  # blocks gathered (or in flight) while each block runs forward, backward
            b.register_forward_pre_hook(lambda *_: most.append(sum(u.unsharded for u in engine.units[1:])))
            b.register_full_backward_pre_hook(
                lambda *_: most_back.append(sum(u.unsharded for u in engine.units[1:])))
        losses = []
        for _ in range(2):
            loss = loss_fn(engine(x), y)
            loss.register_hook(lambda g: kept.append(sum(u.unsharded for u in engine.units[1:])))
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        gathers = engine.comm_stats()["last_step"]["all_gather"]["calls"]
        results[name] = (max(most), losses, kept[-1], gathers, max(most_back))
    assert results["none"][0] == 1 and results["next unit"][0] == 2
    assert results["3 units"][0] == 4 and results["3 units, live cap"][0] == 2
    assert results["under a unit"][0] == 2
    # Blocks still gathered when backward starts, and the all-gathers of the second step: each kept
    # block is one fewer (the first step has no recorded order yet, and keeps none).
    kept, gathers = {name: r[2] for name, r in results.items()}, {name: r[3] for name, r in results.items()}
    # With prefetch, the last two blocks stay: backward needs the last first and prefetches the other.
    # On CUDA they are freed too (as FSDP2 does), and gathered again in backward, the last one first.
    assert kept == {"next unit": 2, "none": 0, "3 units": 2, "under a unit": 2, "3 units, live cap": 2,
                    "reuse": 4, "reuse, live cap": 3, "CUDA's free tail": 0, "CUDA's free tail, reuse": 4,
                    "gloo's window": 9, "gloo's, no prefetch": 0}, kept
    assert gathers["CUDA's free tail"] == gathers["next unit"] + 2, gathers
    # With prefetch, gathers issued together go out as one collective: the root's with the first
    # block's, and the blocks a bucket prefetches at once ("3 units").
    single = ("next unit", "under a unit")
    assert all(gathers[n] == gathers["next unit"] - (kept[n] - kept["next unit"]) for n in single), gathers
    # With a reuse distance, `twice` (a unit called twice in a row: nothing runs in between) also
    # stays gathered from its first call to its second: one gather fewer.
    assert all(gathers[n] == gathers["next unit"] - (kept[n] - kept["next unit"]) - 1
               for n in ("reuse", "reuse, live cap")), gathers
    assert gathers["3 units"] < gathers["next unit"] < gathers["none"] - kept["next unit"], gathers
    # Under the cap, backward prefetches two blocks at once where the one it passed is freed first.
    assert gathers["3 units"] <= gathers["3 units, live cap"] < gathers["next unit"], gathers
    back = {name: r[4] for name, r in results.items()}
    assert back["3 units, live cap"] <= 2 and back["none"] == 1 and back["next unit"] == 2, back
    assert back["CUDA's free tail"] == 2, back
    assert results["reuse"][0] == 4  # blocks 4-6 kept, and block 7 running
    # gloo's defaults: a window of 2^20 elements holds this whole model (under 0.1M), so the root's
    # gather brings every unit (one collective a dtype and group) and each stays gathered from its
    # forward into its backward: no backward gathers
    assert results["gloo's window"][0] == back["gloo's window"] == len(engine.units) - 1 == 9
    assert gathers["gloo's window"] <= 2 < gathers["3 units"], gathers
    # A reuse distance keeps the last unit too (0 from its backward), with or without the tail rule;
    # and without prefetch gloo's defaults keep nothing, as the paper's profile (the least memory)
    assert gathers["CUDA's free tail, reuse"] == gathers["reuse"], gathers
    assert results["gloo's, no prefetch"][:1] + results["gloo's, no prefetch"][2:] == \
        results["none"][:1] + results["none"][2:], results
    assert len({tuple(losses) for _, losses, _, _, _ in results.values()}) == 1  # bit-identical losses


def test_prefetch_bucket_and_max_live_parameters():
    spawn(_prefetch_limits, 3)


def _receive_buffer_counted(rank: int, world_size: int) -> None:
    """On gloo a reduce-scatter receives every rank's slice (comm/gloo.py's SumOnArrival): while it is in
    flight, that buffer is a temporary like the input it keeps alive."""
    from types import SimpleNamespace

    from zeroshard.comm.buckets import complete, reduce_scatter_mean
    from zeroshard.core.memory import temporary_bytes
    full, out = torch.full((8,), float(rank + 1)), torch.empty(4)
    pending = reduce_scatter_mean(zeroshard.Comm(), out, full, [(0, 4)], torch.float32, accumulate=False,
                                  async_op=True)
    flat = SimpleNamespace(policy=SimpleNamespace(shard_params=False, shard_grads=True), persistent=True,
                           grads=SimpleNamespace(full=None, inflight=pending), secondary=None)
    assert temporary_bytes(flat) == 32 + 32  # the input (8 fp32) and the receive buffer (8 fp32)
    complete(pending)
    assert torch.equal(out, torch.full((4,), 1.5)) and temporary_bytes(flat) == 0  # the mean of 1 and 2


def test_a_reduce_scatter_in_flight_counts_its_receive_buffer():
    spawn(_receive_buffer_counted, 2)


def _staging_freed(rank: int, world_size: int) -> None:
    """Buffers gathered together (comm/buckets.py's gather_together) free the shared bucket once copied out,
    whoever still holds it: a backend's work object may, a moment after wait() returns."""
    from zeroshard.comm.buckets import complete, gather_together
    fulls = [torch.empty(3 * world_size), torch.empty(2 * world_size)]
    shards = [torch.full((3,), rank + 0.5), torch.full((2,), -rank)]
    pending = gather_together(zeroshard.Comm(), fulls, shards, async_op=True)
    bucket = pending[0][2]
    complete(pending)
    assert fulls[0].tolist() == [r + 0.5 for r in range(world_size) for _ in range(3)]
    assert fulls[1].tolist() == [-r for r in range(world_size) for _ in range(2)]
    assert bucket.untyped_storage().nbytes() == 0


def test_a_shared_gather_bucket_is_freed_when_copied_out():
    spawn(_staging_freed, 2)


def test_a_reduction_stages_a_copy_only_where_the_layout_or_dtype_needs_one():
    """comm/buckets.py's invariant: a gradient of one chunk in its own reduction dtype goes over the
    wire as it is, also where its shard is added to the fp32 one held under accumulation (stages
    2-3) or converted into it: a staged copy there would be one more full-size buffer per unit.
    Several chunks, or another dtype, are staged. Two ranks with the same gradient are played by
    a stand-in Comm: each receives twice its part of the halved gradient."""
    from types import SimpleNamespace

    from zeroshard.comm.buckets import reduce_scatter_mean
    sent, staged = [], []

    def reduce_scatter(out, wire, async_op=False, **_):
        sent.append(wire)
        out.copy_(wire.view(2, -1)[0] * 2)

    comm = SimpleNamespace(world_size=2, zeropp=None, staged=staged.append, reduce_scatter=reduce_scatter)
    for grad_dtype in (torch.bfloat16, torch.float32):
        full = torch.arange(8, dtype=grad_dtype)
        held = torch.ones(4)
        reduce_scatter_mean(comm, held, full.clone(), [(0, 4)], grad_dtype, accumulate=True)
        assert held.tolist() == [1, 2, 3, 4] and sent[-1].dtype == grad_dtype and not staged
        first = torch.empty(4)  # the first micro-batch: converted into the fp32 shard
        reduce_scatter_mean(comm, first, full.clone(), [(0, 4)], grad_dtype, accumulate=False)
        assert first.tolist() == [0, 1, 2, 3] and not staged
    full = torch.arange(8, dtype=torch.bfloat16)
    kept = full.clone()
    reduce_scatter_mean(comm, torch.zeros(4), kept, [(0, 4)], torch.bfloat16, accumulate=True)
    assert sent[-1] is kept  # the caller's buffer itself, consumed
    held = torch.zeros(4)
    reduce_scatter_mean(comm, held, full.clone(), [(0, 2), (2, 4)], torch.bfloat16, accumulate=True)
    assert held.tolist() == [0, 1, 2, 3] and len(staged) == 2  # two chunks: each staged
    reduce_scatter_mean(comm, torch.zeros(4), full.clone(), [(0, 4)], torch.float32, accumulate=True)
    assert len(staged) == 3 and sent[-1].dtype == torch.float32  # reduced in another dtype: staged


@pytest.mark.skipif(not heap.can_release() or heap.status_bytes("VmRSS") is None, reason="glibc and /proc")
def test_freed_heap_pages_go_back_to_the_os():
    """Holes between live heap blocks stay resident until released: release_free_host_memory gives
    back most of what was freed (64 MiB in 64 KiB holes, each between two live blocks)."""
    blocks = [torch.ones(16 * 1024) for _ in range(2048)]  # 64 KiB each: from malloc's heap, touched
    del blocks[::2]
    freed = 1024 * 64 * 1024
    before = heap.status_bytes("VmRSS")
    heap.release_free_host_memory()
    after = heap.status_bytes("VmRSS")
    assert before - after > freed / 2, (before, after)
    assert len(blocks) == 1024  # (alive until here)


def test_a_release_follows_each_step_that_raised_the_peak(monkeypatch):
    """HeapReleaser releases after a step whose end finds a higher peak resident size than the last
    step's end (and after the first), not after one that left the peak where it was."""
    peaks, released = iter([100, 100, 150, 150, 150, 160]), []
    monkeypatch.setattr(heap, "status_bytes", lambda field: next(peaks))
    monkeypatch.setattr(heap, "release_free_host_memory", lambda: released.append(1))
    releaser = heap.HeapReleaser()
    assert [releaser.after_step() for _ in range(6)] == [True, False, True, False, False, True]
    assert len(released) == 3


def test_the_engine_looks_at_the_heap_once_per_optimizer_step(one_process_group, monkeypatch):
    """On a CPU device, by default: after each optimizer step (not each micro-batch); never when
    zeroshard.release_host_memory is false."""
    calls = []
    monkeypatch.setattr(heap.HeapReleaser, "after_step", lambda self: calls.append(1))
    for keys, expected in (({}, 2), ({"release_host_memory": "auto"}, 2),
                           ({"release_host_memory": False}, 0)):
        calls.clear()
        engine = zeroshard.initialize(torch.nn.Linear(4, 4), lambda p: torch.optim.SGD(p, lr=0.1),
                                      {"gradient_accumulation_steps": 2, "zeroshard": keys})
        for _ in range(4):
            engine.backward(engine(torch.ones(2, 4)).sum())
            engine.step()
        assert len(calls) == expected, (keys, len(calls))
