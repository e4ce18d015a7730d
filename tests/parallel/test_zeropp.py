"""ZeRO++ (comm/zeropp.py) on 4 ranks as 2 nodes x 2: hpZ exact (parity with single-process
training) with its cross-node bytes equal to the formula (forward's gathers and the reduce-scatter
cross, backward's gathers stay in the node); qgZ's hierarchical quantized reduce-scatter within its
stated bound of the exact mean; qwZ + qgZ training within tolerance of the exact run; checkpoints
between ZeRO++ and plain stage 3; bad layouts refused by name before any collective."""
from __future__ import annotations

import tempfile

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zeroshard
from helpers.models import (TinyGPT, adamw, assert_matches_reference, reference_run, sgd, tiny_gpt,
                            train_on_slices)
from helpers.spawn import spawn
from zeroshard.comm.collectives import Kind
from zeroshard.comm.quantized import reduce_scatter_quantized

STEPS, GLOBAL_BATCH = 4, 12
HPZ = {"zero_hpz_partition_size": 2}
QUANTIZED = {"zero_quantized_weights": True, "zero_quantized_gradients": True}


def _engine(make_opt, seed: int = 0, bits: int = 4, **zero):
    # overlap_comm off: no unit kept gathered from forward into backward, so every backward gathers
    config = {"zero_optimization": {"stage": 3, "overlap_comm": False, **zero},
              "zeroshard": {"ranks_per_node": 2, **({"quantized_gradient_bits": bits} if bits != 4 else {})}}
    return zeroshard.initialize(tiny_gpt(seed), make_opt, config)


def train(engine, rank: int, world_size: int, forward_bytes: list | None = None) -> list[float]:
    """Training steps; `forward_bytes` receives each step's all-gather bytes of its forward alone."""
    if forward_bytes is None:
        return train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
    comm, start = engine.comm, []  # (comm.window: a new one each step)

    def before() -> None:
        start.append(comm.window[Kind.ALL_GATHER].bytes)

    def after() -> None:
        forward_bytes.append(comm.window[Kind.ALL_GATHER].bytes - start.pop())
    return train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH, before, after)


def _hpz(rank: int, world_size: int) -> None:
    for make_opt in (sgd, adamw):
        ref_model, ref_losses = reference_run(tiny_gpt, make_opt, STEPS, GLOBAL_BATCH)
        plain, forward = _engine(make_opt), []
        train(plain, rank, world_size, forward)
        engine = _engine(make_opt, seed=rank, **HPZ)  # every copy must begin from rank 0's values
        losses = train(engine, rank, world_size)
        assert_matches_reference(engine, losses, ref_model, ref_losses, f"hpZ {make_opt.__name__}")
        ours, theirs = engine.comm_stats()["last_step"], plain.comm_stats()["last_step"]
        # The same bytes as plain stage 3; of the gathers, forward's cross nodes, backward's do not,
        # nor forward's of a block's frozen buffer after the first step (its values have not changed:
        # its secondary shard from the last forward still holds them).
        again = sum(f.layout.padded_numel * f.full.element_size() for u in engine.units if not u.is_root
                    for f in u.flats if not f.trainable and not f.persistent)
        assert ours["all_gather"]["bytes"] == theirs["all_gather"]["bytes"]
        assert ours["all_gather"]["inter_node_bytes"] == forward[-1] - again > 0, (ours, forward, again)
        assert ours["all_gather"]["intra_node_bytes"] == theirs["all_gather"]["bytes"] - forward[-1] + again
        assert ours["reduce_scatter"] == theirs["reduce_scatter"]
        assert ours["reduce_scatter"]["inter_node_bytes"] == ours["reduce_scatter"]["bytes"] > 0


def test_hpz_is_exact_and_keeps_backward_gathers_in_the_node():
    spawn(_hpz, 4)


def _qgz_bound(rank: int, world_size: int) -> None:
    """Every rank's buffer with each rank's share at its own scale (1e-3, 1, 50, all zeros) and one
    huge value: each share of the mean within the bound of its two quantizations, int8 tighter than
    int4, and an all-zero share exactly zero."""
    engine = _engine(sgd, **QUANTIZED)
    gen, shard = torch.Generator().manual_seed(100 + rank), 1024  # 4 blocks of 256 a share
    scales = torch.tensor([1e-3, 1.0, 50.0, 0.0]).repeat_interleave(shard)
    full = torch.randn(world_size * shard, generator=gen) * scales
    if rank == 0:
        full[7] = 1e4  # one huge value among rank 0's share's small ones
    everyone = torch.empty(world_size * full.numel())
    torch.distributed.all_gather_into_tensor(everyone, full)
    rows = everyone.view(world_size, world_size, shard)[:, rank]  # every rank's part of this share
    exact = rows.sum(0) / world_size
    # Per block: each source off by half a step of its block's absmax, then each node's partial sum
    # (at most the sum of its sources' absmax) off by half a step of its own: 2 x sum / (2 qmax), / N.
    peaks = rows.abs().view(world_size, -1, 256).amax(dim=2).sum(0).repeat_interleave(256)
    errors = {}
    for bits, qmax in ((4, 7), (8, 127)):
        engine.comm.zeropp.grad_bits = bits
        out = torch.zeros(shard)
        reduce_scatter_quantized(engine.comm, out, full.clone(), accumulate=False)
        bound = 2 * peaks / (2 * qmax) / world_size * 1.001 + 1e-30
        assert ((out - exact).abs() <= bound).all(), (bits, ((out - exact).abs() / bound).max())
        errors[bits] = (out - exact).abs().max().item()
    if rank == 3:
        assert torch.equal(out, torch.zeros(shard))
    elif rank != 0:  # (rank 0's share: the huge value's block decodes its small ones to 0 either way)
        assert 0 < errors[8] < errors[4] / 4, errors


def test_quantized_reduce_scatter_within_its_bound():
    spawn(_qgz_bound, 4)


def _quantized_training(rank: int, world_size: int, root: str) -> None:
    exact = _engine(adamw)
    exact_losses = train(exact, rank, world_size)
    for zero in ({**HPZ, **QUANTIZED}, QUANTIZED):
        engine = _engine(adamw, **zero)
        losses = train(engine, rank, world_size)
        assert all(abs(a - b) <= 0.02 * abs(b) for a, b in zip(losses, exact_losses)), (zero, losses)
        full, reference = engine.full_state_dict(), exact.full_state_dict()
        worst = max((full[k] - v).abs().max().item() for k, v in reference.items())
        # Quantized: not equal; Adam moves a weight at most about lr a step, whatever its gradient's
        # error (a sign flipped on a near-zero gradient), so 2 x lr x steps bounds a sane run.
        assert 0 < worst < 2 * 1e-2 * STEPS, (zero, worst)
        step = engine.comm_stats()["last_step"]
        plain = exact.comm_stats()["last_step"]
        assert step["reduce_scatter"]["inter_node_bytes"] < plain["reduce_scatter"]["bytes"] / 8
    # A ZeRO++ checkpoint is an ordinary one: into plain stage 3, and back, the same weights.
    engine.save_checkpoint(root, "zeropp")
    saved = engine.full_state_dict()
    plain = _engine(adamw, seed=1)
    plain.load_checkpoint(root, "zeropp")
    back = _engine(adamw, seed=2, **HPZ, **QUANTIZED)
    plain.save_checkpoint(root, "plain")
    back.load_checkpoint(root, "plain")
    for other in (plain, back):
        full = other.full_state_dict()
        assert all(torch.equal(full[k], v) for k, v in saved.items())
    train(back, rank, world_size)  # and trains on from there


def test_quantized_training_stays_close_and_checkpoints_move():
    with tempfile.TemporaryDirectory() as root:
        spawn(_quantized_training, 4, root)


def test_bad_zeropp_configs_are_refused_by_name():
    for zero, said in [({"stage": 2, **HPZ}, r"zero_hpz_partition_size is ZeRO\+\+, .*stage to 3 \(got 2\)"),
                       ({"stage": 1, "zero_quantized_weights": True}, "stage to 3"),
                       ({"stage": 3, "mics_shard_size": 2, **HPZ}, r"\(MiCS or ZeRO\+\+\), not both")]:
        with pytest.raises(zeroshard.ConfigError, match=said):
            zeroshard.Config.load({"zero_optimization": zero})
    with pytest.raises(zeroshard.ConfigError, match="zero_quantized_gradients with fp16 is not supported"):
        zeroshard.Config.load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
                               "fp16": {"enabled": True}})
    with pytest.raises(zeroshard.ConfigError, match="quantized_gradient_bits sets qgZ"):
        zeroshard.Config.load({"zero_optimization": {"stage": 3},
                               "zeroshard": {"quantized_gradient_bits": 8}})
    with pytest.raises(zeroshard.ConfigError, match="quantized_gradient_bits"):
        zeroshard.Config.load({"zero_optimization": {"stage": 3, "zero_quantized_gradients": True},
                               "zeroshard": {"quantized_gradient_bits": 2}})


def _refused_in_initialize(rank: int, world_size: int) -> None:
    """Every rank refuses alike, before the first collective."""
    with pytest.raises(zeroshard.ConfigError, match="zero_hpz_partition_size 4 does not divide the 2 ranks"):
        _engine(sgd, zero_hpz_partition_size=4)
    with pytest.raises(zeroshard.ConfigError, match="not built for a mesh= or process_group="):
        zeroshard.initialize(TinyGPT(), sgd, {"zero_optimization": {"stage": 3, **QUANTIZED}},
                             mesh=init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    _engine(sgd, bits=8, **HPZ, **QUANTIZED)  # and a good one still starts after them


def test_bad_zeropp_layouts_are_refused_in_initialize():
    spawn(_refused_in_initialize, 4)
