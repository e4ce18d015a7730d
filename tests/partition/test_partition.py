"""Partition arithmetic: shards tile the padded buffer exactly, for every size and world size."""
from __future__ import annotations

import pytest

from zeroshard.core.partition import build_layout, padded_numel


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numel", [0, 1, 5, 12, 13, 1000])
def test_shards_tile_the_padded_buffer(numel, world_size):
    layout = build_layout([(("w",), (numel,))], world_size)
    assert layout.padded_numel % world_size == 0
    assert 0 <= layout.padding < world_size
    covered = [i for r in range(world_size) for i in range(*layout.shard_range(r))]
    assert covered == list(range(layout.padded_numel))


def test_slots_are_end_to_end_and_keep_all_names():
    layout = build_layout([(("a.weight", "b.weight"), (3, 4)), (("a.bias",), (3,)), (("c",), ())], 5)
    assert [(s.offset, s.numel) for s in layout.slots] == [(0, 12), (12, 3), (15, 1)]
    assert layout.slots[0].names == ("a.weight", "b.weight")
    assert layout.numel == 16 and layout.padded_numel == 20 and layout.shard_numel == 4


@pytest.mark.parametrize("bucket", [1, 3, 8, 100])
def test_chunks_cover_the_shard_within_the_bucket(bucket):
    layout = build_layout([(("w",), (37,))], 3)
    chunks = layout.shard_chunks(bucket)
    assert chunks[0][0] == 0 and chunks[-1][1] == layout.shard_numel
    assert all(a < b and b == c for (a, b), (c, _) in zip(chunks, chunks[1:]))
    assert all(3 * (b - a) <= max(bucket, 3) for a, b in chunks)


def test_bad_world_size():
    with pytest.raises(ValueError, match="world_size"):
        padded_numel(4, 0)
    with pytest.raises(ValueError, match="rank 3"):
        build_layout([(("w",), (4,))], 3).shard_range(3)
