"""Disk offload (ZeRO-Infinity) on CPU: the states resting in files must not change a bit of training,
must not come back into memory, must checkpoint and resume at another world size with disk offload
on one side only, and must leave no file behind."""
from __future__ import annotations

import gc
import os

import pytest
import torch

from helpers.accounting import live_tensor_bytes
from helpers.spawn import spawn
from test_offload import _train



def nvme(path: str, optimizer: bool = True, params: bool = False, buffers: int = 4) -> dict:
    zero: dict = {}
    if optimizer:
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "buffer_count": buffers}
    if params:
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}
    return zero


def _files(path: str) -> list[str]:
    return [os.path.join(d, f) for d, _, files in os.walk(path) for f in files]


def _parity(rank: int, world_size: int, path: str) -> None:
    for precision in ("fp32", "bf16"):
        for stage in (1, 2, 3):
            base = {"bf16": {"enabled": precision == "bf16"}, "gradient_clipping": 0.5,
                    "gradient_accumulation_steps": 2}
            zero = {"stage": stage, "sub_group_size": 700}  # several sub-groups: the buffers cycle
            ref, ref_losses = _train(rank, world_size, {**base, "zero_optimization": zero})
            ref_state = ref.full_state_dict()
            variants = {"optimizer": nvme(path, buffers=2 if stage == 2 else 4)}
            if stage == 3:
                variants |= {"params": nvme(path, optimizer=False, params=True),
                             "both": nvme(path, params=True, buffers=1)}
            for name, extra in variants.items():
                what = f"{precision} stage {stage} nvme {name}"
                engine, losses = _train(rank, world_size, {**base, "zero_optimization": {**zero, **extra}})
                assert losses == ref_losses, what  # bit for bit: the files hold values, never round them
                state = engine.full_state_dict()
                assert all(torch.equal(state[k], ref_state[k]) for k in ref_state), what
                _check_places(engine, what)
                if name == "both":  # explicitly, while the engine is alive (a worker ending in os._exit)
                    engine.close()
                    torch.distributed.barrier()
                    assert not _files(path), (what, _files(path))
                del engine
                gc.collect()  # the engine's teardown removes its files
                torch.distributed.barrier()  # every rank's
                assert not _files(path), (what, _files(path))


def _check_places(engine, what: str) -> None:
    """memory_stats() by place: what rests in files is on disk, not host; io_stats() counts the
    step's traffic: the optimizer step reads and writes every state file once."""
    stats, io, cfg = engine.memory_stats(), engine.io_stats(), engine.config.nvme
    assert stats["device"] + stats["host"] + stats["disk"] == \
        stats["model_states"] + stats["buffers"] + stats["temporary"] + stats["transfer"], what
    assert stats["disk"] == io["file_bytes"] > 0, (what, stats, io)
    owned = sum(f.layout.shard_numel for f in engine.flats if f.trainable)
    if cfg.optimizer:  # fp32 master + AdamW's two moments per owned element; steps stay in memory
        assert stats["optimizer"] - stats["disk"] + (stats["params"] if cfg.params else 0) < 1024, what
        assert io["last_step"]["read"] >= 12 * owned and io["last_step"]["written"] >= 12 * owned, what
    if cfg.params:
        shards = sum(f.shard.numel() * f.shard.element_size() for f in engine.flats if f.shard_on_host)
        assert stats["params"] >= shards > 0, what


@pytest.mark.parametrize("world_size", [2, 3])
def test_disk_offload_matches_training_in_memory(tmp_path, world_size):
    spawn(_parity, world_size, str(tmp_path))
    assert not os.listdir(tmp_path)  # no file, and no run directory, left behind


def _cache(rank: int, world_size: int, path: str) -> None:
    """offload_param.max_in_cpu: shards kept in host memory spare their reads and change no bit,
    whether everything fits or the least recently used shards are evicted."""
    def run(max_in_cpu: int):
        zero = {"stage": 3, **nvme(path, optimizer=False, params=True)}
        zero["offload_param"]["max_in_cpu"] = max_in_cpu
        engine, losses = _train(rank, world_size, {"zero_optimization": zero, "bf16": {"enabled": True}})
        return engine, losses, engine.full_state_dict(), engine.io_stats(), engine.memory_stats()

    plain, plain_losses, plain_state, plain_io, plain_stats = run(0)
    shards = [f.shard.numel() for f in plain.flats if f.shard_on_host]
    assert plain_io["cache_hits"] == plain_io["cached"] == 0 and len(shards) > 2
    del plain
    for capacity in (10**9, max(shards) + 1):  # all of them; one at a time, evicting
        engine, losses, state, io, stats = run(capacity)
        assert losses == plain_losses and all(torch.equal(state[k], v) for k, v in plain_state.items())
        assert io["cache_hits"] > 0 and io["total"]["read"] < plain_io["total"]["read"], (io, plain_io)
        assert 0 < io["cached"] <= 2 * capacity  # bf16: 2 bytes per element
        assert stats["transfer"] == plain_stats["transfer"] + io["cached"]
        del engine
        gc.collect()


def test_cached_shards_spare_reads_and_change_nothing(tmp_path):
    spawn(_cache, 2, str(tmp_path))
    assert not os.listdir(tmp_path)


def _census(rank: int, world_size: int, path: str) -> None:
    """From outside the library: a census of every live tensor storage, split into anonymous memory
    and file-backed maps, and the process's resident file pages. With the states on disk, memory
    holds less than the same run with them in host memory by at least the states minus the buffers."""
    zero = {"stage": 3, "sub_group_size": 8_000}
    cpu = {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
    engine, losses = _train(rank, world_size, {"zero_optimization": {**zero, **cpu}}, d=64)
    in_memory = _anonymous_bytes()
    del engine
    gc.collect()
    disk = {"zero_optimization": {**zero, **nvme(path, params=True, buffers=2)}}
    engine, disk_losses = _train(rank, world_size, disk, d=64)
    assert disk_losses == losses
    stats = engine.memory_stats()
    on_disk = _anonymous_bytes()
    buffers = engine.io_stats()["buffers"]
    assert stats["disk"] > 500_000 and buffers < stats["disk"] * 0.6, (stats, buffers)
    assert in_memory - on_disk >= stats["disk"] - buffers, (in_memory, on_disk, stats["disk"], buffers)
    assert _resident_file_pages(path) == 0  # the step never maps the files: nothing of them resident


def _anonymous_bytes() -> int:
    """live_tensor_bytes() less the storages that map a file."""
    gc.collect()
    mapped = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.untyped_storage().filename:
            mapped[obj.untyped_storage().data_ptr()] = obj.untyped_storage().nbytes()
    return live_tensor_bytes() - sum(mapped.values())


def _resident_file_pages(path: str) -> int:
    """Resident bytes of this process's mappings of files under `path` (/proc/self/smaps)."""
    resident, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                inside = len(fields) >= 6 and fields[5].startswith(path)
            elif inside and fields[0] == "Rss:":
                resident += int(fields[1]) * 1024
    return resident


def test_the_states_do_not_come_back_into_memory(tmp_path):
    spawn(_census, 2, str(tmp_path))
    assert not os.listdir(tmp_path)
