"""Flat buffers over the wire in constant-size buckets (the paper's CB: a bucket never grows with
the model), converted to a reduction dtype on the way, synchronously or issued as `Pending` work
that `complete()` finishes later (overlap_comm, prefetch).

Invariants: a buffer of any size is moved in chunks of at most `bucket_size` elements of each
shard, so the staging memory is one bucket, not one buffer; a staged copy exists only when the
layout or the dtype needs it (one chunk in the buffer's own dtype runs in place), or when several
buffers travel as one collective (`gather_together`, `reduce_scatter_together`: within one bucket
size); every reduction averages (divides by the ranks) exactly once, before it is summed. With
one rank the mean is the buffer itself: nothing is staged where the reduction dtype holds its values
exactly, and the buffer goes into its destination in one pass (a copy, converting, or an add).

These are functions over a `Comm` (collectives.py), whose counted collectives (all_gather,
reduce_scatter, all_reduce) they call: only collectives.py calls torch.distributed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from .quantized import reduce_scatter_quantized

if TYPE_CHECKING:
    from .collectives import Comm


Pending = list  # [(Work, then: Callable | None, the tensor kept alive)]: issued, not yet complete


def complete(pending: Pending) -> None:
    """Wait for issued collectives in issue order and run what follows each (copy back, add)."""
    for work, then, _ in pending:
        if work is not None:
            work.wait()
        if then is not None:
            then()
    pending.clear()


def _mean_part(bucket: torch.Tensor, ranks: int) -> torch.Tensor:
    """Divide `bucket` by the ranks in place (its part of the mean), unless there is one rank: a
    division by 1 changes no bit, and on one GPU it is a pass over the model's gradient."""
    return bucket.div_(ranks) if ranks > 1 else bucket


def _exact_in(full: torch.Tensor, dtype: torch.dtype) -> bool:
    """Does reducing `full` in `dtype` keep its values exactly? (Then, with one rank, where the
    mean over ranks is `full` itself, it needs no converted copy.)"""
    return dtype == full.dtype or dtype == torch.float32 and full.dtype in (torch.bfloat16, torch.float16)


def gather_shards(comm: Comm, full: torch.Tensor, shard: torch.Tensor, chunks: list[tuple[int, int]],
                  async_op: bool = False) -> Pending:
    """full = every rank's shard, one column block [a, b) of the shards per collective.
    Returns what is still in flight (nothing unless async_op)."""
    pending: Pending = []
    if len(chunks) == 1:
        pending.append((comm.all_gather(full, shard, async_op), None, shard))
    else:
        rows = full.view(comm.world_size, -1)
        for i, (a, b) in enumerate(chunks):
            bucket = torch.empty(comm.world_size * (b - a), dtype=full.dtype, device=full.device)
            comm.staged(bucket)
            work = comm.all_gather(bucket, shard[a:b].contiguous(), async_op, bucket=i)
            pending.append((work, lambda a=a, b=b, bucket=bucket: rows[:, a:b].copy_(
                bucket.view(comm.world_size, b - a)), bucket))
    if not async_op:
        complete(pending)
    return pending

def gather_together(comm: Comm, fulls: list[torch.Tensor], shards: list[torch.Tensor],
                    async_op: bool = False) -> Pending:
    """fulls[i] = every rank's shards[i], for several buffers in one all-gather: the shards go
    end to end into one bucket (rank by rank), copied out into each `full` once it lands."""
    n, sizes = comm.world_size, [s.numel() for s in shards]
    send = torch.cat(shards)
    bucket = torch.empty(n * send.numel(), dtype=send.dtype, device=send.device)
    comm.staged(bucket)

    def copy_out() -> None:
        rows, start = bucket.view(n, -1), 0
        for full, size in zip(fulls, sizes):
            full.view(n, -1).copy_(rows[:, start:start + size])
            start += size
        # Freed now, not when the last reference goes: the backend's work object may hold both
        # a moment after wait() returns (gloo's worker thread), and a memory census would see them.
        for staging in (bucket, send):
            staging.untyped_storage().resize_(0)
    pending: Pending = [(comm.all_gather(bucket, send, async_op), copy_out, bucket)]
    if not async_op:
        complete(pending)
    return pending

def _destination(target: torch.Tensor, dtype: torch.dtype,
                 accumulate: bool) -> tuple[torch.Tensor, Callable[[], object] | None]:
    """Where a reduction in `dtype` lands for `target`, and what then follows: straight into its
    place (no second buffer, no copy), or apart and then added or converted."""
    if not accumulate and target.dtype == dtype:
        return target, None
    reduced = torch.empty(target.numel(), dtype=dtype, device=target.device)
    then = (lambda: target.add_(reduced)) if accumulate else (lambda: target.copy_(reduced))
    return reduced, then


def reduce_scatter_mean(comm: Comm, out: torch.Tensor, full: torch.Tensor, chunks: list[tuple[int, int]],
                        dtype: torch.dtype, accumulate: bool, async_op: bool = False) -> Pending:
    """out (+)= this rank's shard of the mean over ranks of `full`, reduced in `dtype`. `full` is
    consumed: it may be divided in place and reduced from."""
    pending: Pending = []
    n = comm.world_size
    if n == 1 and _exact_in(full, dtype):  # (`full` converted into `out` in one pass, no bucket)
        comm.reduce_alone([(out, full, accumulate)], dtype, calls=len(chunks))
        return pending
    if n > 1 and comm.zeropp is not None and comm.zeropp.grad_bits:  # qgZ: whole, quantized
        reduce_scatter_quantized(comm, out, full, accumulate)
        return pending
    if len(chunks) == 1 and full.dtype == dtype:  # `full` (the caller's to consume) is the bucket:
        # no staged copy, which with accumulation at stages 2-3 would be one more full-size buffer a
        # unit; it stays referenced until done. In place when `out` aliases its slice of `full`.
        reduced, then = _destination(out, dtype, accumulate)
        pending.append((comm.reduce_scatter(reduced, _mean_part(full, n), async_op), then, full))
    else:
        rows = full.view(n, -1)
        for i, (a, b) in enumerate(chunks):  # one column block of every rank's part, converted
            bucket = _mean_part(rows[:, a:b].to(dtype, copy=True).contiguous().view(-1), n)
            comm.staged(bucket)
            reduced, then = _destination(out[a:b], dtype, accumulate)
            pending.append((comm.reduce_scatter(reduced, bucket, async_op, bucket=i), then, bucket))
    if not async_op:
        complete(pending)
    return pending

def reduce_scatter_together(comm: Comm, outs: list[torch.Tensor], fulls: list[torch.Tensor],
                            accumulate: list[bool], async_op: bool = False) -> Pending:
    """outs[i] (+)= this rank's shard of the mean over ranks of fulls[i], for several buffers in
    one collective: every rank's part of each buffer goes end to end into one bucket (the same
    division and sum as one buffer at a time, so the same bits)."""
    n = comm.world_size
    if n == 1:  # (one dtype throughout: see flat_grad.reducible_together)
        comm.reduce_alone(list(zip(outs, fulls, accumulate)), fulls[0].dtype)
        return []
    if comm.zeropp is not None and comm.zeropp.grad_bits:  # qgZ: one buffer at a time, quantized
        for out, full, add in zip(outs, fulls, accumulate):
            reduce_scatter_quantized(comm, out, full, add)
        return []
    bucket = _mean_part(torch.cat([f.view(n, -1) for f in fulls], dim=1).view(-1), n)
    comm.staged(bucket)
    reduced = torch.empty(bucket.numel() // n, dtype=bucket.dtype, device=bucket.device)

    def copy_out() -> None:
        start = 0
        for out, add in zip(outs, accumulate):
            part = reduced[start:start + out.numel()]
            out.add_(part) if add else out.copy_(part)
            start += out.numel()
    pending: Pending = [(comm.reduce_scatter(reduced, bucket, async_op), copy_out, bucket)]
    if not async_op:
        complete(pending)
    return pending

def all_reduce_mean(comm: Comm, full: torch.Tensor, bucket_size: int, dtype: torch.dtype,
                    async_op: bool = False) -> Pending:
    """full = the mean over ranks of `full`, in buckets of `bucket_size`, reduced in `dtype`."""
    pending: Pending = []
    step = max(1, bucket_size)
    wire = dtype
    if comm.world_size == 1 and _exact_in(full, dtype):
        dtype = full.dtype  # (the buffer is its own mean: no converted copy, nothing copied back)
    for a in range(0, full.numel(), step):
        bucket = full[a:a + step].to(dtype)  # a view when the dtypes agree
        if bucket.dtype != full.dtype:
            comm.staged(bucket)
        _mean_part(bucket, comm.world_size)
        copy_back = (lambda a=a, bucket=bucket: full[a:a + step].copy_(bucket)) \
            if bucket.dtype != full.dtype else None
        work = comm.all_reduce(bucket, async_op, bucket=a // step, wire=wire)
        pending.append((work, copy_back, bucket))
    if not async_op:
        complete(pending)
    return pending
