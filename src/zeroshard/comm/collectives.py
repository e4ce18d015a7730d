"""Collectives with accounting: with gloo.py, the only module of zeroshard that calls
torch.distributed collectives (torch.distributed.checkpoint's own, inside dcp.save/load, excepted).

Flat buffers travel through the bucketed collectives of buckets.py (constant-size buckets, a
reduction dtype, `Pending` work), functions over a Comm that call the counted ones here.

Bytes follow the paper's convention, so totals compare directly with 2Ψ / 3Ψ: an all-reduce counts
twice its tensor (it is a reduce-scatter plus an all-gather), an all-gather counts its full output, a
reduce-scatter its full input, a broadcast its tensor. Counts are kept per step (the window between two
`end_step()` calls) and in total; `outside_step()` keeps one-off traffic (set-up, exports) out of the
per-step window so that step figures stay comparable with the formulas.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, Callable, ContextManager, Optional

import torch
import torch.distributed as dist

from ..common.states import temporarily
from .devices import group_device
from .gloo import all_to_all_reduce_scatter
from .topology import Topology
from .watch import Watch

if TYPE_CHECKING:
    from .zeropp import Group, ZeroPP


def _all_gather_flat(*args, **kwargs):
    # torch 2.13 renamed the flat-tensor collectives; older names still work back to torch 2.4.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter_flat(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


Work = Optional[dist.Work]  # a handle to wait on (async_op=True), else None


class _Watched:
    """An issued collective whose wait is bounded and diagnosed (Comm.watch)."""

    def __init__(self, work: dist.Work, watch: Watch) -> None:
        self.work, self.watch = work, watch

    def wait(self) -> None:
        self.watch.wait(self.work)

    @property
    def staging_bytes(self) -> int:
        return getattr(self.work, "staging_bytes", 0)


class Kind(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    BROADCAST = "broadcast"


@dataclass
class Counter:
    calls: int = 0
    bytes: int = 0
    inter_node_bytes: int = 0  # of `bytes`, those of collectives whose group spans nodes (topology.py)


def _fresh() -> dict[Kind, Counter]:
    return {kind: Counter() for kind in Kind}


class Comm:
    """Collectives over one process group, counted by kind. Sums are divided by callers, not here."""

    def __init__(self, group: dist.ProcessGroup | None = None, watch: Watch | None = None,
                 tp_group: dist.ProcessGroup | None = None, replica_group: dist.ProcessGroup | None = None,
                 topology: Topology | None = None, zeropp: ZeroPP | None = None) -> None:
        """Over `group` (default: the world). `watch`: an engine's (fingerprints, checks, bounded
        waits: watch.py), else None. `tp_group` (tensor parallelism, parallel/mesh.py): the ranks
        holding the other shards of this rank's model; only what must agree across the model
        crosses it (norms, verdicts, values of replicated parameters). `replica_group` (MiCS): the
        ranks holding this rank's shard in the other copies of the model; gradients are averaged
        over it. `topology`: the nodes, for the intra/inter-node split of the counts. `zeropp`: the
        ZeRO++ options and their groups (zeropp.py), else None."""
        self.group, self.watch, self.tp_group = group, watch, tp_group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.device = group_device(group)
        self.tp_rank = dist.get_rank(tp_group) if tp_group is not None else 0
        self.tp_size = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.replica_group = replica_group
        self.replica_rank = dist.get_rank(replica_group) if replica_group is not None else 0
        self.replicas = dist.get_world_size(replica_group) if replica_group is not None else 1
        self.topology, self.zeropp = topology, zeropp
        self._inter = topology is not None and topology.spans_nodes(group)
        self._replicas_inter = topology is not None and replica_group is not None and \
            topology.spans_nodes(replica_group)
        self.total = _fresh()
        self.window = _fresh()
        self.largest_bucket = 0  # bytes of the largest staging buffer built (constant: the CB claim)
        self.last_step = _fresh()
        self._counting_step = True
        self.label = ""  # what the next collectives are about ("unit 3 (h.2)"), for the fingerprints

    @property
    def data_parallel(self) -> tuple[int, int]:
        """(this rank's index, ranks) among those that read different data: the shard group's ranks
        in every copy of the model (MiCS: a copy is one shard group; its gradients are averaged
        over the replicas too), which the batch sizes count."""
        return self.replica_rank * self.world_size + self.rank, self.replicas * self.world_size

    def _count(self, kind: Kind, nbytes: int, calls: int = 1, inter: bool | None = None) -> None:
        """`inter`: whether the collective's group spans nodes (default: this Comm's group)."""
        targets = [self.total, self.window] if self._counting_step else [self.total]
        inter = self._inter if inter is None else inter
        for table in targets:
            table[kind].calls += calls
            table[kind].bytes += nbytes
            table[kind].inter_node_bytes += nbytes if inter else 0

    def _issue(self, kind: str, tensor: torch.Tensor, bucket: int, async_op: bool,
               call: Callable[[bool], Work]) -> Work:
        """Issue `call(async_op)`; under a watch, fingerprinted, and waited for with a bound."""
        watch = self.watch
        if watch is None:
            return call(async_op)
        watch.record(kind, self.label, bucket, tensor.numel(), tensor.dtype)
        work = watch.guard(lambda: call(True))
        if async_op:
            return _Watched(work, watch)
        watch.wait(work)
        return None

    def about(self, label: str) -> ContextManager[None]:
        """Collectives inside are fingerprinted as being about `label`."""
        return temporarily(self, "label", label)

    # With one rank a collective is a local identity: it is counted as one, but the backend is not
    # called (on a GPU, NCCL would still launch a copy; there is no peer to agree with or wait for).
    # (`wire`: the reduction dtype the bytes are counted in, where one rank skipped converting to it.)
    def all_reduce(self, tensor: torch.Tensor, async_op: bool = False, bucket: int = 0,
                   wire: torch.dtype | None = None) -> Work:
        """Sum `tensor` over ranks, in place."""
        self._count(Kind.ALL_REDUCE, 2 * tensor.numel() * (wire or tensor.dtype).itemsize)
        if self.world_size == 1:
            return None
        return self._issue("all_reduce", tensor, bucket, async_op,
                           lambda a: dist.all_reduce(tensor, group=self.group, async_op=a))

    def all_gather(self, output: torch.Tensor, shard: torch.Tensor, async_op: bool = False,
                   bucket: int = 0) -> Work:
        """output = concatenation of every rank's `shard` (shard may alias its slice of output)."""
        self._count(Kind.ALL_GATHER, output.numel() * output.element_size())
        if self.world_size == 1:
            if output.data_ptr() != shard.data_ptr():
                output.copy_(shard)
            return None
        return self._issue("all_gather", output, bucket, async_op,
                           lambda a: _all_gather_flat(output, shard, group=self.group, async_op=a))

    def all_gather_over(self, group: Group, output: torch.Tensor, shard: torch.Tensor) -> None:
        """all_gather over one of ZeRO++'s groups (hpZ's secondary partition), synchronously."""
        self._count(Kind.ALL_GATHER, output.numel() * output.element_size(), inter=group.inter)
        if group.size == 1:
            output.copy_(shard)
            return
        self._issue("all_gather", output, 0, False,
                    lambda a: _all_gather_flat(output, shard, group=group.group, async_op=a))

    def all_to_all_over(self, group: Group, output: torch.Tensor, send: torch.Tensor) -> None:
        """output = the group's ranks' parts for this rank (send: equal parts, one per rank, in rank
        order), synchronously: ZeRO++'s quantized reduce-scatter, counted as one (its input's bytes)."""
        self._count(Kind.REDUCE_SCATTER, send.numel() * send.element_size(), inter=group.inter)
        self._issue("all_to_all", send, 0, False,
                    lambda a: dist.all_to_all_single(output, send, group=group.group, async_op=a))

    def reduce_scatter(self, output: torch.Tensor, full: torch.Tensor, async_op: bool = False,
                       bucket: int = 0) -> Work:
        """output = this rank's slice of the sum over ranks of `full` (output may alias that slice).
        With async_op, returns a handle to wait on; `full` must stay alive until then."""
        if self.world_size == 1:
            return self.reduce_alone([(output, full, False)], full.dtype)
        self._count(Kind.REDUCE_SCATTER, full.numel() * full.element_size())
        if self.device.type == "cpu":  # gloo: see gloo.SumOnArrival; the receive buffer is one more `full`
            self.staged(full)
            return self._issue("reduce_scatter", full, bucket, async_op, lambda a: all_to_all_reduce_scatter(
                output, full, self.group, self.world_size, a))
        return self._issue("reduce_scatter", full, bucket, async_op,
                           lambda a: _reduce_scatter_flat(output, full, group=self.group, async_op=a))

    def reduce_alone(self, parts: list[tuple[torch.Tensor, torch.Tensor, bool]], wire: torch.dtype,
                     calls: int = 1) -> None:
        """One rank, where a reduce-scatter's result is its input: `output` (+)= `full` for each
        (output, full, add), converted in the same pass; counted as `calls` reduce-scatters of the
        inputs' bytes in `wire` (the reduction dtype: what the collectives replaced would carry)."""
        self._count(Kind.REDUCE_SCATTER, sum(full.numel() for _, full, _ in parts) * wire.itemsize, calls)
        for output, full, add in parts:
            if add:
                output.add_(full)
            elif output.data_ptr() != full.data_ptr():
                output.copy_(full)

    def broadcast(self, tensor: torch.Tensor, src_rank: int = 0) -> None:
        self._count(Kind.BROADCAST, tensor.numel() * tensor.element_size())
        if self.world_size == 1:
            return
        src = dist.get_global_rank(self.group, src_rank) if self.group else src_rank
        self._issue("broadcast", tensor, 0, False,
                    lambda a: dist.broadcast(tensor, src=src, group=self.group, async_op=a))

    def all_reduce_replicas(self, tensor: torch.Tensor) -> None:
        """MiCS: the mean of `tensor` over the replicas, in place (a no-op without them)."""
        if self.replicas == 1:
            return
        self._count(Kind.ALL_REDUCE, 2 * tensor.numel() * tensor.element_size(), inter=self._replicas_inter)
        dist.all_reduce(tensor, group=self.replica_group)
        tensor.div_(self.replicas)

    def broadcast_replicas(self, tensor: torch.Tensor) -> None:
        """MiCS: replica 0's values in every replica (a no-op without them)."""
        if self.replicas > 1:
            self._count(Kind.BROADCAST, tensor.numel() * tensor.element_size(), inter=self._replicas_inter)
            dist.broadcast(tensor, group=self.replica_group, group_src=0)

    def broadcast_tp(self, tensor: torch.Tensor) -> None:
        """tp rank 0's values on every tp rank (a no-op without tensor parallelism)."""
        if self.tp_group is not None and self.tp_size > 1:
            dist.broadcast(tensor, group=self.tp_group, group_src=0)

    def all_gather_tp(self, output: torch.Tensor, part: torch.Tensor) -> None:
        """Every tp rank's `part`, end to end in `output` (ZeRO-R's partitioned activations)."""
        _all_gather_flat(output, part, group=self.tp_group)

    def all_reduce_tp(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        """Reduce over the tp ranks (a no-op without tensor parallelism)."""
        if self.tp_group is not None and self.tp_size > 1:
            dist.all_reduce(tensor, op=op, group=self.tp_group)

    def staged(self, bucket: torch.Tensor) -> None:
        """Note a staging buffer built for a collective (largest_bucket: the CB claim)."""
        self.largest_bucket = max(self.largest_bucket, bucket.numel() * bucket.element_size())

    def all_gather_objects(self, obj: object) -> list[object]:
        """Small picklable objects from every rank (checks, checkpoint metadata, reports): counted
        in the total, never in a step's window.

        Done with tensors rather than dist.all_gather_object, which needs numpy."""
        with self.outside_step():
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            sizes = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
            self.all_gather(sizes, torch.tensor([payload.numel()], device=self.device))
            longest = int(sizes.max())
            padded = torch.zeros(longest, dtype=torch.uint8, device=self.device)
            padded[:payload.numel()] = payload
            gathered = torch.empty(longest * self.world_size, dtype=torch.uint8, device=self.device)
            self.all_gather(gathered, padded)
        rows = gathered.cpu().view(self.world_size, longest)
        return [pickle.loads(bytes(rows[r, :int(sizes[r])].tolist())) for r in range(self.world_size)]

    def barrier(self) -> None:
        """Wait for every rank (moves no data, so nothing is counted)."""
        self._issue("barrier", torch.empty(0), 0, False, lambda a: dist.barrier(group=self.group, async_op=a))

    def end_step(self) -> None:
        self.last_step, self.window = self.window, _fresh()

    def outside_step(self) -> ContextManager[None]:
        """Traffic inside counts in the total only (set-up, exports, checkpoints)."""
        return temporarily(self, "_counting_step", False)

    def stats(self) -> dict[str, dict[str, dict[str, int]]]:
        def table(t: dict[Kind, Counter]) -> dict[str, dict[str, int]]:
            return {k.value: {"calls": c.calls, "bytes": c.bytes,
                              "intra_node_bytes": c.bytes - c.inter_node_bytes,
                              "inter_node_bytes": c.inter_node_bytes}
                    for k, c in t.items()}
        return {"last_step": table(self.last_step), "total": table(self.total)}
