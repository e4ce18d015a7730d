"""Test set-up shared by every test module: `helpers` is importable (pytest puts this folder on
sys.path), a one-process gloo group for tests that call zeroshard without spawning ranks, and GPU
tests skipped where there is no GPU. Every group here is started with its backend named, so the
suite runs the same on a GPU machine as on CI."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


def pytest_collection_modifyitems(config, items):
    """Tests marked `cuda` need a GPU: skipped, by name, where torch sees none (CI)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU visible); run `pytest -m cuda` on a GPU machine")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_process_group():
    """A world of one in this process (what initialize() itself starts when nothing else is set)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
