"""Tensor-parallel parameters in zeroshard's flat buffers: a DTensor keeps its placement, the buffer
holds its local shard.

Invariant: a parameter sharded along dim d over the tp mesh is laid into its flat buffer with d
first (local.movedim(d, 0), flattened), and the parameter's local tensor is a view of that span
moved back. In that order a tp shard is one contiguous block of the whole tensor laid out the same
way (its "canonical" flattening), so every range a data-parallel rank owns is one range of the
full tensor: checkpoint pieces stay (name, start) pairs, at any (dp, tp). Replicated parameters
(and DTensors with a Replicate placement) are laid out as usual (d = 0, offset 0).

Swapping storage: `p.data = DTensor(...)` changes the wrapper's metadata (its dtype: the buffer may
be bf16) but not the tensor DTensor computes with, `p._local_tensor`, which is set alongside. The
wrapper's shape and placement never change, so autograd and the tp plan's hooks see the same
parameter throughout.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


@dataclass(frozen=True)
class TpSpec:
    """Where a DTensor parameter's local shard sits in the whole tensor."""

    mesh: DeviceMesh
    placements: tuple
    global_shape: torch.Size
    dim: int        # the sharded dim, laid first in the flat buffer (0 when replicated)
    offset: int     # the local block's first index along `dim` in the whole tensor
    sharded: bool   # split over tp (False: every tp rank holds all of it)

    @property
    def inner(self) -> int:
        """Elements per index along `dim` (the same in the shard and the whole tensor)."""
        return math.prod(s for i, s in enumerate(self.global_shape) if i != self.dim)

    @property
    def start(self) -> int:
        """Where the local block begins in the whole tensor's canonical flattening."""
        return self.offset * self.inner


def spec_of(p: torch.Tensor) -> TpSpec | None:
    """The TpSpec of a DTensor parameter, None for an ordinary tensor."""
    if not isinstance(p, DTensor):
        return None
    placements = tuple(p.placements)
    if len(placements) != 1 or not isinstance(placements[0], (Shard, Replicate)):
        raise ValueError(f"a tensor-parallel parameter has placements {placements}; zeroshard takes "
                         f"Shard(d) or Replicate() on a 1-D tp mesh (torch's colwise / rowwise plans)")
    local_shape, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh, placements)
    if isinstance(placements[0], Shard):
        dim = placements[0].dim % p.dim()
        return TpSpec(p.device_mesh, placements, p.shape, dim, offsets[dim], True)
    return TpSpec(p.device_mesh, placements, p.shape, 0, 0, False)


def split_over_tp(p: torch.Tensor) -> bool:
    """A DTensor sharded over tp (not replicated there)."""
    return isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements)


def local_of(p: torch.Tensor) -> torch.Tensor:
    """The tensor a rank computes with: the local shard of a DTensor, else the tensor itself."""
    return p._local_tensor if isinstance(p, DTensor) else p


def laid_out(local: torch.Tensor, spec: TpSpec | None) -> torch.Tensor:
    """The local values in flat-buffer order (a view where possible)."""
    return local if spec is None else local.movedim(spec.dim, 0)


def local_view(span: torch.Tensor, shape: torch.Size, spec: TpSpec | None) -> torch.Tensor:
    """The local tensor viewing a flat span laid out by laid_out(); `shape` is the laid-out shape."""
    view = span.view(shape)
    return view if spec is None else view.movedim(0, spec.dim)


def point(p: nn.Parameter, local: torch.Tensor, spec: TpSpec | None) -> None:
    """Make `p` compute with `local` (a view of a flat buffer, or a placeholder)."""
    if spec is None:
        p.data = local
        return
    if p.dtype != local.dtype:  # the wrapper's dtype follows the buffer's (bf16 compute)
        p.data = DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                                    shape=spec.global_shape, stride=_contiguous_strides(spec.global_shape))
    p._local_tensor = local


def full_tensor(local: torch.Tensor, spec: TpSpec | None) -> torch.Tensor:
    """Collective over tp for a sharded spec: the whole tensor from every rank's local shard."""
    if spec is None or not spec.sharded:
        return local
    return DTensor.from_local(local, spec.mesh, spec.placements, run_check=False,
                              shape=spec.global_shape,
                              stride=_contiguous_strides(spec.global_shape)).full_tensor()


def canonical(whole: torch.Tensor, dim: int) -> torch.Tensor:
    """The whole tensor flattened with `dim` first (the order checkpoint pieces are numbered in)."""
    return whole.reshape(-1) if dim == 0 else whole.movedim(dim, 0).reshape(-1)


def from_canonical(flat: torch.Tensor, shape: tuple[int, ...], dim: int) -> torch.Tensor:
    """Inverse of canonical(): the tensor of `shape`, contiguous."""
    if dim == 0:
        return flat.view(shape)
    laid = list(shape)
    laid.insert(0, laid.pop(dim))
    return flat.view(laid).movedim(0, dim).contiguous()


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))
