"""Flat parameters: one padded, contiguous buffer per (unit, parameter group), sharded over ranks.

Invariants (N ranks, S = shard size, rank r owns elements [r*S, (r+1)*S) of the padded buffer):
- module parameters are views of `full` while it is gathered (always, at stages 0-2);
- `shard` is this rank's slice: an alias of `full` at stages 0-2, its own tensor at stage 3;
- the optimizer sees `opt_param` (the whole buffer at stage 0, the shard otherwise) whose `.grad` is
  the mean over ranks of the gradients once `reduce_grads()` has run;
- each trainable FlatParam is reduced exactly once per backward (or per step at stages 0-1), in the
  same order on every rank, so the collectives always match across ranks.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

from .comm import Comm
from .partition import build_layout


@dataclass(frozen=True)
class StagePolicy:
    """A ZeRO stage as data: which model states are sharded across the data-parallel ranks."""

    shard_optimizer: bool
    shard_grads: bool
    shard_params: bool

    @staticmethod
    def for_stage(stage: int) -> "StagePolicy":
        return StagePolicy(stage >= 1, stage >= 2, stage >= 3)


class ParamState(Enum):
    SHARDED = "sharded"    # only the shard exists; module parameters are empty placeholders
    GATHERED = "gathered"  # `full` is allocated and current; module parameters view it


@dataclass(frozen=True)
class Buckets:
    """Largest number of elements a single collective may move (DeepSpeed's bucket sizes)."""

    reduce: int
    gather: int


class FlatParam:
    """The parameters of one (unit, group), laid end to end; see the module docstring."""

    def __init__(self, named_params: list[tuple[tuple[str, ...], nn.Parameter]], comm: Comm,
                 policy: StagePolicy, buckets: Buckets, trainable: bool, persistent: bool = False,
                 group: int = 0) -> None:
        self.params = [p for _, p in named_params]
        self.layout = build_layout([(names, tuple(p.shape)) for names, p in named_params], comm.world_size)
        self.comm, self.policy, self.buckets, self.trainable = comm, policy, buckets, trainable
        self.group = group  # index of the user's parameter group (-1: frozen parameters)
        self.slot_of = {id(p): slot for p, slot in zip(self.params, self.layout.slots)}
        first = self.params[0]
        self.full = torch.zeros(self.layout.padded_numel, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for p, slot in zip(self.params, self.layout.slots):
                self.full[slot.offset:slot.offset + slot.numel].copy_(p.detach().reshape(-1))
            with comm.outside_step():
                comm.broadcast(self.full, 0)  # every rank starts from rank 0's values, as DDP does
        start, end = self.layout.shard_range(comm.rank)
        self.persistent = not policy.shard_params or persistent
        self.shard = self.full[start:end].clone() if policy.shard_params else self.full[start:end]
        self.state = ParamState.GATHERED
        self._placeholder = torch.empty(0, dtype=first.dtype, device=first.device)
        self._point_params_at_full()
        if not self.persistent:
            self.free()
        self.grad_full: torch.Tensor | None = None   # full-size gradient accumulator
        self.grad_shard: torch.Tensor | None = None
        self.opt_param: nn.Parameter | None = None
        self.reduced = False      # reduced since the last step? (stages 2-3)
        self.has_grad = False     # does grad_shard hold a reduced gradient yet?
        self._pending: set[int] = set()
        if trainable:
            self._init_grads()

    def _init_grads(self) -> None:
        padded, (start, end) = self.layout.padded_numel, self.layout.shard_range(self.comm.rank)
        if self.policy.shard_grads:
            self.grad_shard = torch.zeros_like(self.shard)
        else:
            self.grad_full = torch.zeros(padded, dtype=self.full.dtype, device=self.full.device)
            self.grad_shard = self.grad_full[start:end]  # reduce-scattered in place at stage 1
        target = self.shard if self.policy.shard_optimizer else self.full
        self.opt_param = nn.Parameter(target)  # shares storage: updates land in the buffer
        self.opt_param.grad = self.grad_shard if self.policy.shard_optimizer else self.grad_full
        self._pending = set(self.slot_of)

    # ---- parameters -------------------------------------------------------------------------
    def _point_params_at_full(self) -> None:
        for p, slot in zip(self.params, self.layout.slots):
            p.data = self.full[slot.offset:slot.offset + slot.numel].view(slot.shape)

    def gather(self) -> None:
        """Make `full` current and point module parameters at it (stage 3; a no-op otherwise)."""
        if self.state is ParamState.GATHERED:
            return
        # Resize the same storage back rather than allocating a new tensor: views that autograd
        # saved during forward keep pointing at this storage and become valid again.
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        with torch.no_grad():
            self._all_gather(self.full, self.shard)
        self._point_params_at_full()
        self.state = ParamState.GATHERED

    def free(self) -> None:
        """Release `full` (stage 3). Parameters become empty so stray use fails loudly, not silently."""
        if self.persistent or self.state is ParamState.SHARDED:
            return
        for p in self.params:
            p.data = self._placeholder
        self.full.untyped_storage().resize_(0)
        self.state = ParamState.SHARDED

    def sync_after_step(self) -> None:
        """Every rank updated only its shard: all-gather where `full` is kept (stages 1-2, and
        stage-3 buffers below the persistence threshold)."""
        if self.trainable and self.policy.shard_optimizer and self.persistent:
            with torch.no_grad():
                self._all_gather(self.full, self.shard)

    def _all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        chunks = self.layout.shard_chunks(self.buckets.gather)
        if len(chunks) == 1:
            self.comm.all_gather(full, shard)
            return
        rows = full.view(self.comm.world_size, -1)
        for a, b in chunks:  # constant-size bucket: gather one column block of every rank's shard
            bucket = torch.empty(self.comm.world_size * (b - a), dtype=full.dtype, device=full.device)
            self.comm.all_gather(bucket, shard[a:b].contiguous())
            rows[:, a:b].copy_(bucket.view(self.comm.world_size, b - a))

    def gathered_copy(self) -> torch.Tensor:
        """The full padded values, gathered into a new tensor if needed (for exports)."""
        if self.state is ParamState.GATHERED:
            return self.full.detach().clone()
        out = torch.empty_like(self.full)
        out.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        self._all_gather(out, self.shard)
        return out

    # ---- gradients ----------------------------------------------------------------------------
    def accumulate(self, param: nn.Parameter) -> bool:
        """Move `param.grad` into the flat gradient buffer; True once every parameter has reported."""
        slot = self.slot_of[id(param)]
        if self.grad_full is None:  # stages 2-3: a temporary, freed by reduce_grads()
            self.grad_full = torch.zeros(self.layout.padded_numel, dtype=self.full.dtype, device=self.full.device)
        self.grad_full[slot.offset:slot.offset + slot.numel].add_(param.grad.reshape(-1))
        param.grad = None
        self._pending.discard(id(param))
        return not self._pending

    def reduce_grads(self) -> None:
        """Average the gradient over ranks: all-reduce (stage 0) or reduce-scatter into the shard."""
        full = self.grad_full
        if full is None:  # no parameter of this buffer got a gradient here: it contributes zeros
            full = torch.zeros(self.layout.padded_numel, dtype=self.full.dtype, device=self.full.device)
        full.div_(self.comm.world_size)
        if not self.policy.shard_optimizer:
            step = max(1, self.buckets.reduce)
            for a in range(0, full.numel(), step):
                self.comm.all_reduce(full[a:a + step])
        elif not self.policy.shard_grads:
            self._reduce_scatter(self.grad_shard, full)  # in place: grad_shard aliases its slice
        else:
            if self.has_grad:  # a second backward before the step: add to what is there
                fresh = torch.empty_like(self.grad_shard)
                self._reduce_scatter(fresh, full)
                self.grad_shard.add_(fresh)
            else:
                self._reduce_scatter(self.grad_shard, full)
            self.grad_full = None
        self.has_grad, self.reduced = True, True
        self._pending = set(self.slot_of)

    def _reduce_scatter(self, out: torch.Tensor, full: torch.Tensor) -> None:
        chunks = self.layout.shard_chunks(self.buckets.reduce)
        if len(chunks) == 1:
            self.comm.reduce_scatter(out, full)
            return
        rows = full.view(self.comm.world_size, -1)
        for a, b in chunks:  # constant-size bucket: one column block of every rank's part
            self.comm.reduce_scatter(out[a:b], rows[:, a:b].contiguous().view(-1))

    def zero_grad(self) -> None:
        if self.grad_full is not None and not self.policy.shard_grads:
            self.grad_full.zero_()
        elif self.grad_shard is not None:
            self.grad_shard.zero_()
        self.has_grad, self.reduced = False, False

    # ---- accounting ---------------------------------------------------------------------------
    def bytes_held(self) -> dict[str, int]:
        """Bytes by category: persistent params / grads, and temporaries alive right now."""
        def nbytes(t: torch.Tensor | None) -> int:
            return 0 if t is None else t.numel() * t.element_size()
        sharded_g = self.policy.shard_grads
        if not self.policy.shard_params:
            params, gathered_temp = nbytes(self.full), 0
        elif self.persistent:  # stage 3 below the persistence threshold: shard and full both kept
            params, gathered_temp = nbytes(self.shard) + nbytes(self.full), 0
        else:
            params = nbytes(self.shard)
            gathered_temp = nbytes(self.full) if self.state is ParamState.GATHERED else 0
        return {
            "params": params,
            "grads": nbytes(self.grad_shard) if sharded_g else nbytes(self.grad_full),
            "temporary": gathered_temp + (nbytes(self.grad_full) if sharded_g else 0),
        }
