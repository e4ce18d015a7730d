"""Checkpoints with disk offload: saved from files and loaded into them, at another world size and
stage, with disk offload on one side only; consolidated offline; no file left behind."""
from __future__ import annotations

import gc
import os

import torch

import zeroshard
from helpers.models import TinyGPT, assert_weights_match, reference_run
from helpers.spawn import spawn
from test_checkpoint import _train

GLOBAL_BATCH, FIRST, SECOND = 12, 3, 3


def _adamw(p):
    return torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)


def _scheduler(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _engine(stage: int, seed: int, disk: str | None):
    zero: dict = {"stage": stage, "sub_group_size": 700}
    if disk:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": disk, "buffer_count": 2}
        if stage == 3:
            zero["offload_param"] = {"device": "nvme", "nvme_path": disk}
    torch.manual_seed(seed)
    return zeroshard.initialize(TinyGPT(), _adamw, {"zero_optimization": zero}, lr_scheduler=_scheduler)


def _save(rank: int, world_size: int, stage: int, directory: str, disk: str | None) -> None:
    engine = _engine(stage, 0, disk)
    _train(engine, rank, world_size, range(FIRST))
    engine.save_checkpoint(os.path.join(directory, "ckpt"))
    full = engine.full_state_dict()
    if rank == 0:
        torch.save(full, os.path.join(directory, "full_at_save.pt"))


def _resume(rank: int, world_size: int, stage: int, directory: str, disk: str | None) -> None:
    engine = _engine(stage, 1234, disk)  # another seed: nothing may lean on the initialisation
    engine.load_checkpoint(os.path.join(directory, "ckpt"))
    _train(engine, rank, world_size, range(FIRST, FIRST + SECOND))
    reference = reference_run(lambda: (torch.manual_seed(0), TinyGPT())[1], _adamw, FIRST + SECOND,
                              GLOBAL_BATCH, scheduler=_scheduler)[0].state_dict()
    assert_weights_match(engine, reference, 1e-5, 2e-6, f"resumed at stage {stage}, N={world_size}:")
    if disk:  # the loaded optimizer state went back to its files at the first step
        stats = engine.memory_stats()
        assert stats["disk"] == engine.io_stats()["file_bytes"] and stats["optimizer"] - stats["disk"] < 1024
        del engine
        gc.collect()
        torch.distributed.barrier()
        assert not os.listdir(disk)


def test_resume_at_another_world_size_with_disk_offload_on_one_side(tmp_path):
    disk = tmp_path / "nvme"
    disk.mkdir()
    saved, resumed = tmp_path / "a", tmp_path / "b"
    saved.mkdir()
    resumed.mkdir()
    spawn(_save, 2, 3, str(saved), str(disk))  # saved from files: N=2, stage 3, states on disk
    assert not os.listdir(disk)
    full = zeroshard.consolidate(str(saved / "ckpt"))
    expected = torch.load(saved / "full_at_save.pt")
    assert all(torch.equal(full[k], v) for k, v in expected.items())
    spawn(_resume, 3, 2, str(saved), None)  # ... resumed in memory at N=3, stage 2
    spawn(_save, 3, 1, str(resumed), None)  # saved in memory at N=3, stage 1 ...
    spawn(_resume, 2, 3, str(resumed), str(disk))  # ... resumed into files at N=2, stage 3
    assert not os.listdir(disk)
