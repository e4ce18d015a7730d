"""Checkpoints of a model split over tp: (dp 2, tp 2, stage 3) -> (dp 4, tp 1, stage 1) -> (dp 2, tp 2,
stage 2), and -> a single process; consolidate gives the whole tensors. Every resumed run continues
exactly as uninterrupted single-process training."""
from __future__ import annotations

import torch.distributed as dist

import zeroshard
from helpers.margins import close
from helpers.models import assert_matches_reference, reference_run
from helpers.spawn import spawn
from test_tensor_parallel import GLOBAL_BATCH, TINY_PLAN, mesh_2x2, sgd, tiny, train

CONFIG = {"gradient_clipping": 0.5}


def _config(stage: int) -> dict:
    return {**CONFIG, "zero_optimization": {"stage": stage}}


def _across_meshes(rank: int, world_size: int, root: str) -> None:
    mesh = mesh_2x2()
    dp_rank = mesh["dp"].get_local_rank()
    engine = zeroshard.initialize(zeroshard.tensor_parallel(tiny(), mesh["tp"], TINY_PLAN), sgd, _config(3),
                                  mesh=mesh)
    train(engine, dp_rank, 2, range(2))
    engine.save_checkpoint(f"{root}/a")
    ref_model, ref_losses = reference_run(tiny, sgd, 3, GLOBAL_BATCH, clip=0.5)
    engine = zeroshard.initialize(tiny(seed=7), sgd, _config(1))  # dp 4, tp 1: the whole world
    engine.load_checkpoint(f"{root}/a")
    losses = train(engine, rank, 4, range(2, 3))
    assert_matches_reference(engine, losses, ref_model, ref_losses[2:], "(2,2,3) -> (4,1,1)")
    engine.save_checkpoint(f"{root}/b")
    ref_model, ref_losses = reference_run(tiny, sgd, 4, GLOBAL_BATCH, clip=0.5)
    engine = zeroshard.initialize(zeroshard.tensor_parallel(tiny(seed=9), mesh["tp"], TINY_PLAN), sgd,
                                  _config(2), mesh=mesh)
    engine.load_checkpoint(f"{root}/b")
    losses = train(engine, dp_rank, 2, range(3, 4))
    assert_matches_reference(engine, losses, ref_model, ref_losses[3:], "(4,1,1) -> (2,2,2)")
    dist.barrier()


def _single(rank: int, world_size: int, root: str) -> None:
    ref_model, ref_losses = reference_run(tiny, sgd, 4, GLOBAL_BATCH, clip=0.5)
    engine = zeroshard.initialize(tiny(seed=5), sgd, _config(0))
    engine.load_checkpoint(f"{root}/a")
    losses = train(engine, 0, 1, range(2, 4))
    assert_matches_reference(engine, losses, ref_model, ref_losses[2:], "(2,2,3) -> one process")


def test_checkpoint_moves_between_dp_tp_layouts(tmp_path):
    spawn(_across_meshes, 4, str(tmp_path))
    spawn(_single, 1, str(tmp_path))
    ref_model, _ = reference_run(tiny, sgd, 2, GLOBAL_BATCH, clip=0.5)
    whole = zeroshard.consolidate(str(tmp_path / "a"))
    assert list(whole) == list(ref_model.state_dict())
    for name, value in ref_model.state_dict().items():
        close(whole[name], value, rtol=1e-5, atol=2e-6, what=f"consolidated {name}")
