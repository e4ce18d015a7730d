"""MiCS / HSDP (zero_optimization.mics_shard_size, or a ("replicate", "shard") mesh): ZeRO inside
each shard group, the reduced gradient shards averaged over the replicas. Parity with single-process
training at stages 1-3 with 2 x 2 and 3 x 2 ranks; the bytes that cross nodes counted, equal to the
formula; checkpoints that move between MiCS and plain layouts; bad layouts refused before any
collective."""
from __future__ import annotations

import os
import tempfile

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import zeroshard
from helpers.models import (TinyGPT, adamw, assert_matches_reference, reference_run, sgd, tiny_gpt,
                            train_on_slices)
from helpers.spawn import spawn
from zeroshard.comm.topology import Topology, check_mics, read_topology

STEPS, GLOBAL_BATCH = 4, 12


def _config(stage: int, shard: int, **zero) -> dict:
    return {"zero_optimization": {"stage": stage, "mics_shard_size": shard, **zero},
            "zeroshard": {"ranks_per_node": 2}}


def _parity(rank: int, world_size: int) -> None:
    """fp32, SGD (a gradient off by a constant factor shows) and AdamW; the ranks start from
    different seeds: every copy must begin from rank 0's values."""
    for make_opt in (sgd, adamw):
        ref_model, ref_losses = reference_run(tiny_gpt, make_opt, STEPS, GLOBAL_BATCH)
        for stage in (1, 2, 3):
            engine = zeroshard.initialize(tiny_gpt(seed=rank), make_opt, _config(stage, 2))
            assert engine.comm.world_size == 2 and engine.comm.replicas == world_size // 2
            # every rank reads its own data: the batch arithmetic counts them all (DeepSpeed's rule)
            assert engine.dp_world_size == world_size
            assert sorted(zeroshard.gather_objects(engine.comm.data_parallel)) == \
                [(r, world_size) for r in range(world_size)]
            losses = train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
            what = f"MiCS 2 x {world_size // 2} stage {stage} {make_opt.__name__}"
            assert_matches_reference(engine, losses, ref_model, ref_losses, what)
            # Inter-node: only the replicas' all-reduce of each gradient shard (the shard groups
            # lie within nodes of 2), twice its bytes (the paper's all-reduce), one per buffer.
            step = engine.comm_stats()["last_step"]
            shard_bytes = sum(4 * f.layout.shard_numel for f in engine.flats if f.trainable)  # fp32
            assert step["all_reduce"]["inter_node_bytes"] == 2 * shard_bytes, (what, step)
            assert sum(v["inter_node_bytes"] for k, v in step.items() if k != "all_reduce") == 0, (what, step)
    # DeepSpeed's batch arithmetic counts every rank that reads its own data: micro x 1 x all of them
    config = {**_config(3, 2), "train_micro_batch_size_per_gpu": 2, "train_batch_size": 2 * world_size}
    engine = zeroshard.initialize(tiny_gpt(), sgd, config)
    assert engine.gradient_accumulation_steps() == 1 and engine.train_batch_size() == 2 * world_size


@pytest.mark.parametrize("world_size", [4, 6])
def test_mics_matches_single_process_and_counts_its_inter_node_bytes(world_size):
    spawn(_parity, world_size)


def _stage3_crosses_nodes(rank: int, world_size: int) -> None:
    """Plain stage 3 over 2 nodes: every byte of its collectives crosses nodes (their group spans
    both); the same model under MiCS 2 keeps all but the replica all-reduce inside."""
    counts = {}
    for shard in (-1, 2):
        engine = zeroshard.initialize(tiny_gpt(), sgd, _config(3, shard))
        train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
        step = engine.comm_stats()["last_step"]
        counts[shard] = (sum(v["inter_node_bytes"] for v in step.values()),
                         sum(v["bytes"] for v in step.values()))
    inter, total = counts[-1]
    assert inter == total > 0
    mics_inter, mics_total = counts[2]
    assert 0 < mics_inter < mics_total and mics_inter < inter / 2


def test_plain_stage3_moves_everything_across_nodes():
    spawn(_stage3_crosses_nodes, 4)


def _exactly(engine, saved: dict[str, torch.Tensor], what: str) -> None:
    full = engine.full_state_dict()
    assert list(full) == list(saved), what
    assert all(torch.equal(full[k], v) for k, v in saved.items()), what


def _checkpoints(rank: int, world_size: int, root: str) -> None:
    """Saved under MiCS, loaded at plain stages and another shard size (and back), the same weights."""
    engine = zeroshard.initialize(tiny_gpt(), adamw, _config(3, 2))
    train_on_slices(engine, rank, world_size, STEPS, GLOBAL_BATCH)
    engine.save_checkpoint(root, "mics")
    saved = engine.full_state_dict()
    for stage, shard in ((3, -1), (1, -1), (2, 4), (0, -1)):
        other = zeroshard.initialize(tiny_gpt(seed=1), adamw, _config(stage, shard))
        other.load_checkpoint(root, "mics")
        _exactly(other, saved, f"MiCS -> stage {stage} shard {shard}")
        if (stage, shard) == (1, -1):
            other.save_checkpoint(root, "plain")
    back = zeroshard.initialize(tiny_gpt(seed=2), adamw, _config(2, 2))
    back.load_checkpoint(root, "plain")
    _exactly(back, saved, "plain -> MiCS")
    # A mesh given directly: the same layout as mics_shard_size.
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    given = zeroshard.initialize(tiny_gpt(seed=3), adamw, {"zero_optimization": {"stage": 3}}, mesh=mesh)
    given.load_checkpoint(root, "mics")
    assert given.comm.replicas == 2 and given.comm.world_size == 2
    _exactly(given, saved, "MiCS -> a given (replicate, shard) mesh")


def test_checkpoints_move_between_mics_and_plain_layouts():
    with tempfile.TemporaryDirectory() as root:
        spawn(_checkpoints, 4, root)


def test_bad_layouts_are_refused_by_name():
    with pytest.raises(zeroshard.ConfigError, match="mics_shard_size 3 does not divide the 4 ranks"):
        check_mics(3, Topology(2), 4)
    with pytest.raises(zeroshard.ConfigError, match="does not fit nodes of 4 ranks"):
        check_mics(6, Topology(4), 12)
    check_mics(4, Topology(2), 8)  # whole nodes
    check_mics(2, Topology(4), 8)  # within a node
    with pytest.raises(zeroshard.ConfigError, match="ranks_per_node 2 but torchrun started 4"):
        read_topology(2, 0, 8, env={"LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "0"})
    with pytest.raises(zeroshard.ConfigError, match="3 ranks per node do not divide the 4 ranks"):
        read_topology(3, 0, 4, env={})
    with pytest.raises(zeroshard.ConfigError, match="runs on node 0 .GROUP_RANK."):
        read_topology(None, 2, 4, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0"})
    assert read_topology(None, 3, 4, env={"LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}) == Topology(2)
    assert read_topology(2, 3, 4, env={"LOCAL_WORLD_SIZE": "4"}) == Topology(2)  # one launcher, as asked
    with pytest.raises(zeroshard.ConfigError, match="stage 0 shards nothing"):
        zeroshard.Config.load({"zero_optimization": {"stage": 0, "mics_shard_size": 2}})
    with pytest.raises(zeroshard.ConfigError, match="mics_hierarchical_params_gather"):
        zeroshard.Config.load({"zero_optimization": {"stage": 3, "mics_hierarchical_params_gather": True}})


def _refused_in_initialize(rank: int, world_size: int) -> None:
    """Every rank refuses alike, before the first collective (none is left waiting)."""
    with pytest.raises(zeroshard.ConfigError, match="mics_shard_size 3 does not divide the 4 ranks"):
        zeroshard.initialize(TinyGPT(), sgd, _config(3, 3))
    with pytest.raises(zeroshard.ConfigError, match="but initialize.. was also given mesh="):
        zeroshard.initialize(TinyGPT(), sgd, _config(3, 2), mesh=init_device_mesh("cpu", (4,)))
    os.environ["LOCAL_WORLD_SIZE"] = "1"  # torchrun said 1 rank per node, the config 2
    try:
        with pytest.raises(zeroshard.ConfigError, match="ranks_per_node 2 but torchrun started 1"):
            zeroshard.initialize(TinyGPT(), sgd, _config(3, 2))
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]


def test_bad_layouts_are_refused_in_initialize():
    spawn(_refused_in_initialize, 4)
