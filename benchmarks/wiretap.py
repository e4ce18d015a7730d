"""Bytes each implementation sends through torch.distributed, counted at the Python API.

Paper convention, per rank: an all-reduce of B bytes counts 2B (reduce-scatter + all-gather), an
all-gather counts its output, a reduce-scatter its input, a broadcast its tensor. What bypasses the
Python API is not seen: DDP's C++ reducer, and DeepSpeed's shared-memory ops where it uses them.
"""
from __future__ import annotations

import inspect
from collections import Counter
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    return sum(_nbytes(t) for t in x) if isinstance(x, (list, tuple)) else 0  # lists of lists too


# name -> (the argument counted, multiplier)
COUNTED = {"all_reduce": ("tensor", 2), "all_gather_into_tensor": ("output_tensor", 1),
           "_all_gather_base": ("output_tensor", 1), "all_gather": ("tensor_list", 1),
           "reduce_scatter_tensor": ("input", 1), "_reduce_scatter_base": ("input", 1),
           "reduce_scatter": ("input_list", 1), "broadcast": ("tensor", 1), "all_to_all_single": ("input", 1),
           # torch 2.13 names
           "all_gather_single": ("output_tensor", 1), "reduce_scatter_single": ("input", 1),
           "all_reduce_coalesced": ("tensors", 2), "all_gather_coalesced": ("output_tensor_lists", 1),
           "all_to_all": ("input_tensor_list", 1), "reduce": ("tensor", 1), "gather": ("tensor", 1),
           "scatter": ("tensor", 1)}
# The kind each counted function belongs to (as zeroshard's comm_stats() names them).
KIND = {name: next((k for k in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all") if k in name),
                   name)
        for name in COUNTED}


def by_kind(counts: Counter, all_to_all_reduces: bool = False) -> dict[str, int]:
    """Bytes per collective kind, from wiretap's per-function counts (kinds with no bytes left out).
    all_to_all_reduces: count all_to_all_single as a reduce-scatter of its input (zeroshard's on
    gloo: every rank's slices, summed on arrival; the same bytes per rank as a ring reduce-scatter)."""
    out: Counter = Counter()
    for name, nbytes in counts.items():
        out["reduce_scatter" if all_to_all_reduces and name == "all_to_all_single" else KIND[name]] += nbytes
    return dict(+out)


@contextmanager
def wiretap() -> Iterator[Counter]:
    """Count bytes per collective kind while inside (in torch.distributed and its c10d module)."""
    counts: Counter = Counter()
    modules = [dist, dist.distributed_c10d]
    saved = [(m, name, getattr(m, name)) for m in modules for name in COUNTED if hasattr(m, name)]

    depth = [0]  # a deprecated collective calling its successor counts once

    def tapped(name, fn):
        argument, factor = COUNTED[name]
        signature = inspect.signature(fn)

        def call(*args, **kwargs):
            if depth[0] == 0:
                counts[name] += factor * _nbytes(signature.bind(*args, **kwargs).arguments[argument])
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call
    originals = {}
    for m, name, fn in saved:
        originals.setdefault(name, fn)  # the c10d function, whichever module it was reached from
        setattr(m, name, tapped(name, originals[name]))
    try:
        yield counts
    finally:
        for m, name, fn in saved:
            setattr(m, name, fn)
