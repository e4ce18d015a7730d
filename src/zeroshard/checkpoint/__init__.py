"""Sharded checkpoints on torch.distributed.checkpoint, loadable at any world size, stage or
tensor-parallel layout: save (save.py), load (load.py), finding and reading them (read.py:
resolve, info, consolidate), the metadata's checks (meta.py), checksums (integrity.py) and the
atomic commit (commit.py); full weights written as one file (export.py).
May import: common, config, comm, parallel, offload, core.
"""
from .integrity import CheckpointError
from .read import consolidate, info, read_meta, resolve

__all__ = ["CheckpointError", "consolidate", "info", "read_meta", "resolve"]
