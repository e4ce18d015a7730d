"""Test set-up shared by every test module: `helpers` is importable (pytest puts this folder on
sys.path), and a one-process gloo group for tests that call zeroshard without spawning ranks."""
from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(scope="module")
def one_process_group():
    """A world of one in this process (what initialize() itself starts when nothing else is set)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
