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


def _streamed(rank: int, world_size: int, directory: str, disk: str) -> None:
    """With states on disk, a load reads one flat buffer's pieces at a time and writes the
    optimizer state straight into its files: memory never holds the rank's whole state."""
    from zeroshard.checkpoint import load as checkpoint_load
    from zeroshard.core.memory import on_disk
    engine = _engine(3, 0, disk)
    _train(engine, rank, world_size, range(FIRST))
    engine.save_checkpoint(os.path.join(directory, "ckpt"))
    expected = engine.full_state_dict()
    reads: list[int] = []
    real_read = checkpoint_load._read

    def counted(path, comm, request):
        reads.append(sum(t.numel() * t.element_size() for t in request.values() if torch.is_tensor(t)))
        return real_read(path, comm, request)

    checkpoint_load._read = counted
    try:
        loaded = _engine(3, 1234, disk)
        loaded.load_checkpoint(os.path.join(directory, "ckpt"))
        assert len(reads) == len(loaded.flats) > 3, reads  # one read per flat buffer ...
        assert max(reads) < sum(reads) / 2, reads  # ... so never the whole state at once
        states = [v for f in loaded.flats if f.trainable for v in loaded.optimizer.state[f.opt_param].values()
                  if torch.is_tensor(v) and v.dim() > 0]
        assert states and all(on_disk(v) for v in states)  # no in-memory copy waiting for a step
        assert all(torch.equal(v, expected[k]) for k, v in loaded.full_state_dict().items())
        # A read failing after the checks (files verified, then unreadable) says what it left.
        calls = []

        def failing(path, comm, request):
            calls.append(1)
            if len(calls) == 2:
                raise zeroshard.CheckpointError("cannot read checkpoint: injected")
            return real_read(path, comm, request)

        checkpoint_load._read = failing
        try:
            loaded.load_checkpoint(os.path.join(directory, "ckpt"))
            raise AssertionError("the injected read failure was not raised")
        except zeroshard.CheckpointError as e:
            assert "partly loaded" in str(e) and "load a checkpoint again" in str(e), e
    finally:
        checkpoint_load._read = real_read


def test_a_load_into_files_streams_one_buffer_at_a_time(tmp_path):
    disk = tmp_path / "nvme"
    disk.mkdir()
    spawn(_streamed, 2, str(tmp_path), str(disk))
    assert not os.listdir(disk)
