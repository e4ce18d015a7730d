"""Flat parameters: one padded, contiguous buffer per (unit, parameter group), sharded over ranks.

Invariants (N ranks, S = shard size, rank r owns elements [r*S, (r+1)*S) of the padded buffer):
- module parameters are views of `full` while it is gathered (always, at stages 0-2);
- `shard` is this rank's slice, in the compute dtype: an alias of `full` at stages 0-2, its own
  tensor at stage 3 (in host memory with offload_param, unless the buffer stays gathered), and None
  at stage 3 where a 16-bit buffer has a device fp32 master: each gather casts the master into its
  place in `full` (as FSDP2 does), so no lasting 16-bit copy (2Ψ/N) sits beside the master;
- `master` is what the optimizer updates (fp32; the whole buffer at stage 0, the shard otherwise). It
  aliases the parameters when they are fp32 and not offloaded, otherwise it is a copy written back
  after each step (with offload_optimizer it is on the host, and so are `host`'s transfer buffers);
- each trainable FlatParam is reduced exactly once per backward (or per step at stages 0-1), in the
  same order on every rank, so the collectives always match across ranks;
- under tensor parallelism the buffer holds local shards (parallel/dtensor.py says in which order),
  and its parameters are either all split over tp (`tp_sharded`) or all replicated there.
"""
from __future__ import annotations

from enum import Enum
from typing import Any

import torch
from torch import nn

from ..comm import buckets, quantized
from ..comm.buckets import Pending, complete
from ..comm.collectives import Comm
from ..common.states import move
from ..offload.host import Copier, HostCopies, master_goes_up
from ..parallel.dtensor import TpSpec, laid_out, local_of, local_view, point, spec_of
from .flat_grad import FlatGrad
from .partition import Slot, build_layout
from .placeholders import Home, InPlaceWrites, Placeholders
from .policy import Buckets, StagePolicy
from .precision import Precision


class ParamState(Enum):
    SHARDED = "sharded"      # only the shard exists; module parameters are empty placeholders
    UNSHARDING = "unsharding"  # an all-gather into `full` is in flight (prefetch; after the step until
                             # it ends, or the next forward with defer_param_gather); placeholders
    UNSHARDED = "unsharded"    # `full` is allocated and current; module parameters view it
    UPDATING = "updating"    # kept gathered, and a pipelined update (pipeline.py) is changing the
                             # shard: `full` is stale until its first use gathers it; placeholders


_PARAM_MOVES = {
    ParamState.SHARDED: {ParamState.UNSHARDING},
    ParamState.UNSHARDING: {ParamState.UNSHARDED, ParamState.SHARDED},
    ParamState.UNSHARDED: {ParamState.SHARDED, ParamState.UNSHARDING, ParamState.UPDATING},
    ParamState.UPDATING: {ParamState.UNSHARDING},
}


class FlatParam(FlatGrad):
    """The parameters of one (unit, group), laid end to end; see the module docstring. (Its
    gradient's side: flat_grad.FlatGrad.)"""

    def __init__(self, named_params: list[tuple[tuple[str, ...], nn.Parameter]], comm: Comm,
                 policy: StagePolicy, buckets: Buckets, precision: Precision, trainable: bool,
                 persistent: bool = False, group: int = 0, copier: Copier | None = None) -> None:
        self.params = [p for _, p in named_params]
        self.specs: list[TpSpec | None] = [spec_of(p) for p in self.params]  # None: not a DTensor
        self.tp_sharded = any(s is not None and s.sharded for s in self.specs)
        self._spec_by_id = {id(p): spec for p, spec in zip(self.params, self.specs)}
        self.layout = build_layout([(names, tuple(laid_out(local_of(p), spec).shape))
                                    for (names, p), spec in zip(named_params, self.specs)], comm.world_size)
        self.comm, self.policy, self.buckets, self.precision = comm, policy, buckets, precision
        self.trainable, self.group = trainable, group  # group: the user's parameter group (-1: frozen)
        self.label = ""  # "unit 3 (h.2)": names its collectives in fingerprints (set by the engine)
        self.slot_of = {id(p): slot for p, slot in zip(self.params, self.layout.slots)}
        self.range = self.layout.shard_range(comm.rank)
        source = self._initial_values()
        owned = source if not policy.shard_optimizer else source[self.range[0]:self.range[1]]
        self.full = source.to(precision.param_dtype)  # the same tensor when no conversion is needed
        self.persistent = not policy.shard_params or persistent
        self.shard = self.full[self.range[0]:self.range[1]]
        self.shard_on_host = policy.shard_params and precision.offload_params and not self.persistent
        if self.shard_on_host:  # in host memory, or in a file with disk offload
            self.shard = copier.new_shard(self.full[self.range[0]:self.range[1]], precision.pin_params)
        elif policy.shard_params:
            cast = trainable and not self.persistent and precision.param_dtype != torch.float32 and \
                not precision.offload  # (the master is on the device: cast from it at each gather)
            self.shard = None if cast else self.shard.clone()
        self.copier = copier
        self._host_read: "torch.cuda.Event | None" = None  # the last copy up of a host shard
        self.host: HostCopies | None = None  # offload_optimizer: the gradient's and update's host copies
        self.state = ParamState.UNSHARDED
        self.gather_behind_forward = False  # stages 1-2 with defer_param_gather: set by the engine
        self.pipeline: Any = None  # the engine's PipelinedUpdate (pipeline.py), if it pipelines
        self._placeholder = Placeholders(self.full.dtype, self.full.device)  # a write into one is refused
        self.homes: list[list[Home]] = []  # where the model holds each parameter (units.build_units)
        # Each parameter's view of `full`, made once: `full` keeps one storage, resized in place by
        # reshard() and start_unshard(), so the views stay valid (stage 3 points parameters at them).
        self._views = [local_view(self.full[slot.span], slot.shape, spec)
                       for slot, spec in zip(self.layout.slots, self.specs)]
        self._point_params_at_full()
        self.master: torch.Tensor | None = None
        self.opt_param: nn.Parameter | None = None
        self._gathering: Pending = []  # an all-gather issued (a prefetch, or after the step)
        self.secondary: torch.Tensor | None = None  # hpZ: 1/k of what forward gathered (comm/zeropp.py)
        self._init_grads()
        if trainable:
            self._init_trainable(owned)  # before reshard(): `owned` may share storage with `full`
        apart = self.owned_values().untyped_storage().data_ptr() != self.full.untyped_storage().data_ptr()
        self.writes = InPlaceWrites(self.params, self.layout.slots, watched=self.persistent and apart,
                                    kept=self.persistent)  # (in-place writes: placeholders.py)
        if not self.persistent:
            self.reshard()

    def _initial_values(self) -> torch.Tensor:
        """The padded buffer in the parameters' own dtype, equal to rank 0's values on every rank."""
        # On the group's device: a model built on the CPU moves here one buffer at a time.
        source = torch.zeros(self.layout.padded_numel, dtype=self.params[0].dtype, device=self.comm.device)
        with torch.no_grad():
            for p, slot, spec in zip(self.params, self.layout.slots, self.specs):
                source[slot.span].copy_(laid_out(local_of(p), spec).detach().reshape(-1))
            with self.comm.outside_step():
                self.comm.broadcast(source, 0)  # every rank starts from rank 0's values, as DDP does
                if not self.tp_sharded:
                    self.comm.broadcast_tp(source)  # and a replicated parameter from tp rank 0's
                self.comm.broadcast_replicas(source)  # MiCS: every copy from replica 0's
        return source

    def _init_trainable(self, owned_source: torch.Tensor) -> None:
        p = self.precision
        self._allocate_grads()
        updated = self.shard if self.policy.shard_optimizer else self.full
        if p.offload:  # fp32 copy of the original values (not of their rounded compute copy)
            # pin_memory pins the master only where it is itself copied up: elsewhere nothing copies
            # it, and pinning would cost host bytes (the pinned allocator rounds up to a power of two)
            up_dtype = None if self.shard_on_host else p.param_dtype  # None: written on the host
            pin = p.pin_memory and master_goes_up(up_dtype, self.copier.casts_on_device)
            self.master = self.copier.new_master(owned_source, pin)  # host memory, or a file
            self.host = HostCopies(self.copier, self.master.numel(), self.grad_dtype, up_dtype, self.master)
        elif p.separate_master:
            self.master = owned_source.to(torch.float32, copy=True)
        else:
            self.master = updated
        self.opt_param = nn.Parameter(self.master)  # shares storage: updates land in `master`

    # ---- parameters -------------------------------------------------------------------------
    def _point_params_at_full(self) -> None:
        for p, view, spec in zip(self.params, self._views, self.specs):
            point(p, view, spec)

    def refuse_lost_writes(self) -> None:
        """None of a gathered buffer that will be freed was written in place (the write goes with it)."""
        if self.state is ParamState.UNSHARDED and not self.persistent:
            self._placeholder.refuse_lost(self.params, self.layout.slots)

    def refuse_replaced(self) -> None:
        """No parameter was replaced, in the model or its tensor, nor a placeholder written."""
        views = self._views if self.state is ParamState.UNSHARDED else None
        self._placeholder.refuse_replaced(self.params, self.specs, views, self.layout.slots, self.homes)

    def _set_state(self, new: ParamState) -> None:
        self.state = move(self.state, new, _PARAM_MOVES, "a flat parameter's storage")

    def start_unshard(self) -> None:
        """Issue the all-gather of `full` without waiting (stage 3 with overlap_comm; a buffer
        whose pipelined update makes it stale: after those ahead of it, pipeline.issue_before)."""
        if self.state is ParamState.UPDATING:
            self.pipeline.issue_before(self)
            self.issue_unshard()
        elif self.state is ParamState.SHARDED:
            self.issue_unshard()

    def start_unshard_updated(self) -> None:
        if self.state is ParamState.UPDATING:
            self.issue_unshard()

    def finish_unshard_updated(self) -> None:
        if self.state is ParamState.UNSHARDING and self.persistent:
            self.unshard()

    def issue_unshard(self) -> None:
        """Issue the all-gather of `full`: left in flight (UNSHARDING), except a post-step gather
        through several buckets, which completes here, one at a time (in flight together, their
        buckets would add up to a second copy of the parameters), unless deferred."""
        shard = self.outgoing_shard()
        with torch.no_grad():
            if self.state is ParamState.UNSHARDED and not self.gather_behind_forward and \
                    len(self.layout.shard_chunks(self.buckets.gather)) > 1:
                self._all_gather(self.full, shard)
                return
            self.mark_unsharding(self._unshard_gather(shard))

    def _unshard_gather(self, shard: torch.Tensor) -> Pending:
        """Issue the gather that makes `full` current: from hpZ's secondary shards (inside the node)
        where forward left them, quantized (qwZ) in forward, else exact and left in flight."""
        pp = self.comm.zeropp
        if pp is not None and pp.changes_gathers and not self.persistent:
            with self.comm.about(self.label):
                if self.secondary is not None:
                    quantized.gather_secondary(self.comm, self.full, self.secondary)
                    return []
                if pp.weight_bits and torch._C._current_graph_task_id() == -1:  # forward, not backward
                    quantized.gather_quantized(self.comm, self.full, shard)
                    return []
        return self._all_gather(self.full, shard, async_op=True)

    def outgoing_shard(self) -> torch.Tensor:
        """The shard a gather sends (a freed buffer first gets its storage back: a prefetch)."""
        return self._storage_back() if self.state is ParamState.SHARDED else self._shard_on_device()

    def mark_unsharding(self, pending: Pending) -> None:
        """An all-gather into `full` is in flight: unshard() completes it."""
        self._gathering = pending
        if self.state is ParamState.UNSHARDED:  # stray reads fail loudly, not see half-written values
            self._placeholder.point(self.params, self.specs)
        self._set_state(ParamState.UNSHARDING)

    def _storage_back(self) -> torch.Tensor:
        """Give `full` its storage back for a gather; returns the shard to send."""
        # Resize the same storage back rather than allocating a new tensor: views that autograd
        # saved during forward keep pointing at this storage and become valid again.
        self.full.untyped_storage().resize_(self.full.numel() * self.full.element_size())
        return self._shard_on_device()

    def await_host_read(self) -> None:
        """Before the host writes an offloaded shard: wait for the last copy that reads it."""
        if self._host_read is not None:
            self._host_read.synchronize()
            self._host_read = None

    def _shard_on_device(self) -> torch.Tensor:
        """The shard, ready for a collective to read: a host shard is copied up into its own place
        in `full` (the all-gather then runs in place), as is the master cast to 16 bits where no
        shard is kept; a written-back update is waited for, and a pipelined update before it
        (not raising its error inside backward, where one rank leaving would strand its peers)."""
        self.wait_update(raise_error=torch._C._current_graph_task_id() == -1)
        if self.shard is None:
            own = self.full[self.range[0]:self.range[1]]
            own.copy_(self.master)
            return own
        if self.shard_on_host:
            own = self.full[self.range[0]:self.range[1]]
            self.copier.read_shard(own, self.shard)  # pinned: ordered on the compute stream, host free
            if own.is_cuda:  # the host must not write the shard until this copy has read it
                self._host_read = torch.cuda.Event()
                self._host_read.record()
            return own
        if self.host is not None:
            self.host.wait_write_back()
        return self.shard

    def unshard(self) -> None:
        """Make `full` current and point module parameters at it (a no-op where it is: always at
        stages 0-2, except after a step with gather_behind_forward)."""
        if self.state is not ParamState.UNSHARDED:
            self.start_unshard()
            with torch.no_grad():
                complete(self._gathering)
        self.refuse_replaced()  # (after the collective: a rank refusing alone leaves no peer waiting)
        if self.state is not ParamState.UNSHARDED:
            self._point_params_at_full()
            self._set_state(ParamState.UNSHARDED)

    def reshard(self, keep_secondary: bool = False) -> None:
        """Release `full` (stage 3): parameters become empty, so stray use fails loudly. `keep_secondary`
        (a unit's forward ends): with hpZ, keep this rank's 1/k of `full` for backward's gather."""
        if self.persistent or self.state is ParamState.SHARDED:
            return
        complete(self._gathering)  # an all-gather in flight must land before its storage goes
        self.refuse_replaced()  # (their values would be lost unseen) ...
        self.refuse_lost_writes()  # ... as would a write in place
        pp = self.comm.zeropp
        if keep_secondary and pp is not None and pp.secondary is not None and self.secondary is None:
            a, b = quantized.secondary_range(pp, self.full.numel())
            self.secondary = self.full[a:b].clone()
        self._placeholder.point(self.params, self.specs)
        self.full.untyped_storage().resize_(0)
        self._set_state(ParamState.SHARDED)

    def unshard_again(self) -> None:
        """Refresh a `full` that is kept gathered (persistent) from the shards."""
        with torch.no_grad():
            self._all_gather(self.full, self.shard)

    def _all_gather(self, full: torch.Tensor, shard: torch.Tensor, async_op: bool = False) -> Pending:
        chunks = self.layout.shard_chunks(self.buckets.gather)
        with self.comm.about(self.label):
            return buckets.gather_shards(self.comm, full, shard, chunks, async_op)

    def gathered_params(self) -> list[tuple[Slot, torch.Tensor]]:
        """(slot, value) of every parameter (its local shard under tp), viewing one new gathered copy
        (collective at stage >= 1)."""
        full = self.gathered_copy()
        return [(slot, local_view(full[slot.span], slot.shape, spec))
                for slot, spec in zip(self.layout.slots, self.specs)]

    def owned_range(self) -> tuple[int, int]:
        """Elements of the padded buffer this rank keeps a lasting copy of: all of them where the
        buffer is replicated (a trainable one at stage 0, a frozen one below stage 3), else its shard."""
        whole = not self.policy.shard_optimizer if self.trainable else not self.policy.shard_params
        return (0, self.layout.padded_numel) if whole else self.range

    def owned_values(self) -> torch.Tensor:
        """The tensor covering owned_range(): the master (trainable), else the shard or the buffer."""
        if self.trainable:
            return self.master
        return self.shard if self.policy.shard_params else self.full

    def gathered_copy(self) -> torch.Tensor:
        """The full padded values (from the fp32 master where there is one: with the delayed
        update it is a step newer than the parameters), in a new tensor."""
        if self.trainable and self.precision.separate_master:
            owned = self.master.to(self.full.device)
            if not self.policy.shard_optimizer:
                return owned.clone()
            out = torch.empty(self.layout.padded_numel, dtype=owned.dtype, device=owned.device)
            self._all_gather(out, owned)
            return out
        if self.state is ParamState.UNSHARDED:
            return self.full.detach().clone()
        out = torch.empty(self.layout.padded_numel, dtype=self.full.dtype, device=self.full.device)
        self._all_gather(out, self.shard.to(out.device))
        return out

    def write_back(self) -> None:
        """After the optimizer step: refresh the compute-dtype parameters from the master, then
        issue the all-gather where `full` is kept (stages 1-2, and stage-3 buffers kept gathered).
        unshard() completes it: the step does, once every buffer's is issued, so they pipeline and
        overlap the next sub-group's update (gather_together.write_back_together sends small
        buffers' as one); with gather_behind_forward, the next forward does."""
        if self.write_back_shard():
            self.issue_unshard()

    def write_back_shard(self, written: bool = False) -> bool:
        """Copy the master's new values into what the parameters are computed from (the shard, or
        `full` at stage 0). `written`: the step already wrote them into write_back_target() (the
        step in one pass); only what follows is left (sending them up). Returns whether `full`
        must then be all-gathered (write_back)."""
        self._values_change()
        self.send_values(written)
        return self.policy.shard_optimizer and self.persistent

    def _values_change(self) -> None:
        self.secondary = None  # (hpZ's secondary shard holds the values before the change)
        # The values change under every parameter's feet (they view `full`, or are placeholders):
        # a graph recorded before, backpropagated after, is refused by autograd as in plain torch.
        torch.autograd.graph.increment_version(self.params)
        self.note_writes()

    def note_writes(self) -> None:
        """The versions now are no user's write (the engine's, or gathered_parameters' taken/undone)."""
        self.writes.note()
        self._placeholder.note(self.params)

    def begin_update(self, pending: Any) -> None:
        """A pipelined update of this buffer starts (pipeline.py), on the caller's thread: what
        autograd sees changes now; a `full` kept gathered is stale until gathered again."""
        self._values_change()
        self.pending = pending
        if self.policy.shard_optimizer and self.persistent:
            self._placeholder.point(self.params, self.specs)  # stray reads fail loudly
            self._set_state(ParamState.UPDATING)

    def send_values(self, written: bool, after: Any = None) -> None:
        """The master's new values on their way into the shard (write_back_shard's data movement;
        a pipelined update's worker runs it, its copies up ordered `after` a CUDA event)."""
        updated = self.shard if self.policy.shard_optimizer else self.full
        with torch.no_grad():
            if self.master is not updated and self.host is not None and not self.shard_on_host:
                if written:
                    self.host.send(updated, after)  # by way of a pinned buffer, asynchronously
                else:
                    self.host.write_back(self.master, updated, after)
            elif self.master is not updated and self.shard_on_host and not written:
                self.await_host_read()
                self.copier.write_shard(updated, self.master)  # host memory, or its file
            elif self.master is not updated and updated is not None and not written:  # (None: cast at
                updated.copy_(self.master)                                              # the next unshard)

    def write_back_target(self) -> torch.Tensor | None:
        """Where the step may write the updated master's compute-dtype copy as it updates, on the
        host (offload/host_step.py): the host staging buffer (on one memory, the shard itself), or
        an offloaded parameter shard in host memory. None where the master is what the parameters
        compute with, or the copy goes elsewhere (a file, the device): write_back_shard does it."""
        updated = self.shard if self.policy.shard_optimizer else self.full
        if self.master is updated or updated is None:
            return None
        if self.host is not None and not self.shard_on_host:
            return self.host.write_back_target(updated)
        if self.shard_on_host and self.shard.device.type == "cpu" and not self.copier.on_disk(self.shard):
            self.await_host_read()  # the last unshard's copy up may still read it
            return self.shard
        return None

    def before_master_changes(self) -> None:
        """The master is about to be written (the step, a load): a copy up still reading it ends first."""
        self.secondary = None  # (hpZ's secondary shard holds the values before the change)
        if self.host is not None:
            self.host.before_master_changes()

    def wait_write_back(self) -> None:
        """Complete the all-gather write_back() issued, unless the next forward is to."""
        if self.state is ParamState.UNSHARDING and not self.gather_behind_forward:
            self.unshard()
