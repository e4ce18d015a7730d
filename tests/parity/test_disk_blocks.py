"""Disk offload's I/O split into blocks (`aio.block_size` below a file's size): every byte lands where
it belongs, whatever the block size, the tensor's place in its file, or how little one pread/pwrite
moves; and training through small blocks is bit-identical to training in memory.

The files are read back with plain Python file I/O, not through the store: the reference does not
share the code under test."""
from __future__ import annotations

import os

import pytest
import torch

from helpers.spawn import spawn
from test_offload import _train
from zeroshard.offload.nvme.store import DiskStore

BLOCK = 4096  # the smallest block the store takes: 4 KiB


def _file_bytes(store: DiskStore, t: torch.Tensor) -> bytes:
    with open(store.path_of(t), "rb") as f:
        return f.read()


def _limited(call, most: int):
    """os.preadv / os.pwritev that move at most `most` bytes per call (a short read or write)."""
    def short(fd, buffers, offset):
        (view,) = buffers
        return call(fd, [view[:most]], offset)
    return short


@pytest.mark.parametrize("short", [None, 1000])
def test_blocks_cover_every_byte_of_a_tensor_at_any_offset(tmp_path, monkeypatch, short):
    if short is not None:  # every call moves less than asked: the loops must go on until done
        monkeypatch.setattr(os, "preadv", _limited(os.preadv, short))
        monkeypatch.setattr(os, "pwritev", _limited(os.pwritev, short))
    (tmp_path / "run" / "rank0").mkdir(parents=True)
    # A block below the minimum is taken as 4 KiB.
    store = DiskStore({"optimizer": str(tmp_path / "run" / "rank0")}, block_size=100)
    assert store.block == BLOCK
    numel = 5 * BLOCK // 4 + 333  # 5 whole blocks of fp32 and a partial one
    whole = store.new_tensor("optimizer", "t", numel, torch.float32)
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    store.write(whole, values)
    assert _file_bytes(store, whole) == values.numpy().tobytes()
    # A view that starts and ends inside blocks (file offset 4 * 1500, not a multiple of the block).
    part = whole[1500:1500 + 2 * BLOCK // 4 + 17]
    patch = torch.randn(part.numel(), generator=torch.Generator().manual_seed(1))
    store.write(part, patch)
    expected = values.clone()
    expected[1500:1500 + patch.numel()] = patch
    assert _file_bytes(store, whole) == expected.numpy().tobytes()
    out = torch.empty(part.numel())
    store.read(part, out)
    assert torch.equal(out, patch)
    back = torch.empty(numel)
    store.read(whole, back)
    assert torch.equal(back, expected)
    assert store.total == {"read": 4 * (numel + part.numel()), "written": 4 * (numel + part.numel())}
    # A buffer of the wrong size is refused, not read short.
    with pytest.raises(ValueError, match="buffer"):
        store.read(whole, torch.empty(numel - 1))
    store.close()
    assert not os.listdir(tmp_path)  # close() removes the rank's directory with its files, and the run's


def _small_blocks(rank: int, world_size: int, path: str) -> None:
    """Stage 3 with the optimizer states and parameter shards in files moved 4 KiB at a time (each
    file holds several blocks and a partial one), fp32 and bf16: bit-identical to memory offload.
    With fused AdamW, so the host's step in one pass runs over the streamed buffers too."""
    for precision in ("fp32", "bf16"):
        base = {"bf16": {"enabled": precision == "bf16"}, "gradient_clipping": 0.5}
        zero = {"stage": 3, "sub_group_size": 3000}
        memory = {**zero, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
        ref, ref_losses = _train(rank, world_size, {**base, "zero_optimization": memory}, d=32, fused=True)
        ref_state = ref.full_state_dict()
        disk = {**zero, "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 2},
                "offload_param": {"device": "nvme", "nvme_path": path, "max_in_cpu": 0}}
        engine, losses = _train(rank, world_size, {**base, "zero_optimization": disk,
                                                   "aio": {"block_size": BLOCK}}, d=32, fused=True)
        store = engine.copier.disk
        assert store.block == BLOCK
        files = [store.path_of(f.master) for f in engine.flats if f.trainable]
        assert min(os.path.getsize(p) for p in files) > 2 * BLOCK, "each file must span several blocks"
        assert any(os.path.getsize(p) % BLOCK for p in files), "and some end in a partial block"
        assert losses == ref_losses, precision  # bit for bit
        state = engine.full_state_dict()
        assert all(torch.equal(state[k], v) for k, v in ref_state.items()), precision
        engine.close()


def test_training_through_small_blocks_is_bit_identical(tmp_path):
    spawn(_small_blocks, 2, str(tmp_path))
    assert not os.listdir(tmp_path)


def test_state_files_take_their_dtype_and_each_step_counts_its_own_bytes(tmp_path):
    """A state's file holds the dtype asked for (the master's when none is), and io figures are
    exact per step: a step's `last_step` is what moved between two end_step() calls, from zero."""
    (tmp_path / "opt").mkdir()
    store = DiskStore({"optimizer": str(tmp_path / "opt")})
    try:
        master = store.new_tensor("optimizer", "flat0.master", 1000, torch.float32)
        assert store.state_tensor(master, "exp_avg").dtype == torch.float32
        half = store.state_tensor(master, "exp_avg_sq", torch.bfloat16)
        assert half.dtype == torch.bfloat16 and os.path.getsize(store.path_of(half)) == 2000
        values = torch.arange(1000, dtype=torch.float32)
        for step in range(3):
            store.write(master, values + step)
            out = torch.empty(1000)
            store.read(master, out)
            assert torch.equal(out, values + step)
            store.end_step()
            assert store.stats()["last_step"] == {"read": 4000, "written": 4000}, step
        assert store.stats()["total"] == {"read": 12000, "written": 12000}
    finally:
        store.close()
