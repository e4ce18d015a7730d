"""The optimizer step over flat shards: measure the global gradient norm, decide (skip or not, clip
how much), update sub-group by sub-group, write the updated masters back into the parameters.

Design notes.
- The decision needs the norm, which lives on the device. Reading it on the host (`.item()`) stalls
  the host until the whole backward has run, and the GPU then idles while the host issues the
  update's kernels one by one. Where the optimizer can take the decision as a tensor, it does not
  wait: torch's fused Adam/AdamW read `found_inf` on the device and leave parameters, moments and
  step counts untouched when it is 1 (GradScaler's protocol), and the clip factor is a device
  scalar in the one multiply that makes the fp32 gradient. The host reads the norm only after the
  update is issued, from a pinned copy made as soon as the norm existed, to log it, raise or count
  a skip, and step the lr scheduler. A skipped step then wrote back unchanged masters: the same bits.
- Elsewhere (fp16's loss scaler, which adjusts its scale on the host; the delayed update, which
  starts on a worker thread; optimizers without `found_inf`, or whose state a skipped step would
  touch: fused SGD leaves its first momentum buffer uninitialized) the host decides first, as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

from ..comm.collectives import Comm
from ..common.states import temporarily
from ..offload import host_step
from ..offload.host import Copier
from ..offload.nvme import stream_groups
from .flat_param import FlatParam
from .gather_together import write_back_together
from .nonfinite import NonFiniteGuard
from .optim import has_user_step_hooks
from .pipeline import PipelinedUpdate
from .precision import LossScaler


@dataclass(frozen=True)
class StepInputs:
    """What the optimizer step works with, fixed at initialize (the engine builds it once)."""

    flats: list[FlatParam]  # every buffer (the step takes the trainable ones)
    optimizer: torch.optim.Optimizer
    comm: Comm
    scaler: LossScaler
    max_norm: float  # gradient_clipping; 0: none
    norm_is_sharded: bool  # stages 1-3: each rank holds a shard of the gradient (the norm is summed)
    sub_group_size: int
    delayed: Copier | None = None  # zeroshard.delayed_param_update: the copier whose worker runs it
    after_update: Callable[[], None] = lambda: None  # after a real update (the lr scheduler)
    guard: NonFiniteGuard | None = None  # bf16/fp32: non-finite gradients raise or skip
    pipeline: PipelinedUpdate | None = None  # zeroshard.pipelined_update: the update overlaps the forward


def sharded_step(inputs: StepInputs, step: int) -> float:
    """Unscale, clip by the global norm, skip on overflow, update, write back; `after_update` runs
    once the update is done (not on a skipped step). Returns the global gradient norm, measured at
    every step as DeepSpeed and torch DDP under Trainer measure it (logged as grad_norm), clipping
    or not.

    The norm is one scalar all-reduce over the ranks' shards (stage 0 ranks hold identical reduced
    gradients, so there it is local), and one over tp when the model is split; a non-finite
    element anywhere makes it non-finite on every rank, so all ranks skip (or raise) together.
    Clipping matches torch.nn.utils.clip_grad_norm_ on the full model.

    With `delayed` (ZeRO-Offload's delayed parameter update), the parameters first take the update
    of the previous step, then this step's update starts on a worker thread and overlaps the next
    forward and backward: the gradient of step t is computed with the weights of step t-1. With a
    `pipeline`, this step's update starts on a worker thread and each buffer's next use waits for
    its own part (pipeline.py): the same step as the sequential one, overlapped.

    Without a loss scaler, `guard` (nonfinite.py) turns a non-finite norm (or loss) into an error
    or a skipped step; with one, an overflow skips the step and lowers the scale.
    """
    trainable = [f for f in inputs.flats if f.trainable]
    scaler, delayed = inputs.scaler, inputs.delayed
    guard = None if scaler.enabled else inputs.guard  # (a guard means no loss scaler: bf16/fp32)
    squares = global_squared_norm(trainable, inputs.comm, inputs.norm_is_sharded, guard)
    if guard is not None and delayed is None and \
            decides_on_device(inputs.optimizer, trainable, squares.device):  # see the design notes
        return _step_deciding_on_device(inputs, trainable, squares, guard, step)
    unscaled = squares.sqrt() / scaler.scale if scaler.enabled else squares.sqrt()
    norm = unscaled.item()
    nonfinite = not math.isfinite(norm)
    overflow = scaler.enabled and nonfinite
    if scaler.enabled:
        scaler.update(overflow, step)
    pipeline = inputs.pipeline if inputs.pipeline is not None and delayed is None and \
        inputs.pipeline.applies(inputs.optimizer, trainable, has_user_step_hooks(inputs.optimizer)) else None
    # Offload: wait for the gradients on the host, on this thread (never the delayed update's: the
    # copies are this thread's). This also outlasts every gather of backward that read a host shard,
    # so the delayed write-back below may write the shards. (A pipelined update waits for each.)
    for f in trainable if pipeline is None else []:
        f.wait_offload()
    if delayed is not None:
        delayed.finish_update()
        if delayed.unwritten:
            _write_back(trainable)
            delayed.written()
    if overflow:
        return norm
    if guard is not None:
        if nonfinite:
            guard.handle(trainable, step)  # raises, or counts the skip
            return norm
        guard.end_cycle()
    factor = 1.0 / scaler.scale
    if inputs.max_norm > 0:  # the same fp32 coefficient as the device's decision computes
        factor *= clip_coefficient(unscaled, inputs.max_norm).item()
    if pipeline is not None:  # returns at once: the next forward waits for each buffer's update
        pipeline.start(trainable, inputs.optimizer, factor, step)
        inputs.after_update()  # (the update took a copy of the hyperparameters)
        return norm
    update = partial(_update, trainable, inputs.optimizer, factor, inputs.sub_group_size)
    if delayed is None:
        update(write_back=True)
        inputs.after_update()
    else:
        delayed.start_update(lambda: update(write_back=False), then=inputs.after_update)
    return norm


def _step_deciding_on_device(inputs: StepInputs, trainable: list[FlatParam], squares: torch.Tensor,
                             guard: NonFiniteGuard, step: int) -> float:
    """sharded_step without a host sync before the update (bf16/fp32, fused Adam): the optimizer
    skips on the device where the norm is not finite, and the host looks afterwards."""
    norm_t = squares.sqrt()
    found_inf = (~torch.isfinite(norm_t)).float()
    norm_later = _read_later(norm_t)
    factor: float | torch.Tensor = 1.0
    if inputs.max_norm > 0:  # x1 where the step is skipped, so its fp32 gradient is kept
        factor = torch.where(found_inf > 0, 1.0, clip_coefficient(norm_t, inputs.max_norm))
    for f in trainable:
        f.wait_offload()
    optimizer = inputs.optimizer
    optimizer.found_inf = found_inf  # read by the fused step, as GradScaler sets it
    try:
        _update(trainable, optimizer, factor, inputs.sub_group_size, write_back=True)
    finally:
        del optimizer.found_inf
    norm = norm_later()
    if not math.isfinite(norm):
        guard.handle(trainable, step)  # raises, or counts the skip; the device skipped the update
        return norm
    guard.end_cycle()
    inputs.after_update()
    return norm


def clip_coefficient(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """By how much gradients are scaled to a global norm of `max_norm`: as clip_grad_norm_, in the
    norm's fp32, clamped to 1. Both ways of deciding compute it so, so they clip to the same bits."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def decides_on_device(optimizer: torch.optim.Optimizer, trainable: list[FlatParam],
                      device: torch.device) -> bool:
    """Whether the optimizer can skip a step on the device (see the design notes): torch's own
    fused Adam or AdamW (a subclass may step otherwise and ignore `found_inf`), fused in every
    group (a group that is not refuses `found_inf`), with no step hooks but zeroshard's (the host
    path calls none on a skipped step), over shards on the norm's device and not offloaded (an
    offloaded step runs on the host, which decides there: on a CPU group too, where host and
    device are one memory, so the CPU runs the path a GPU's offload runs)."""
    return (type(optimizer) in (torch.optim.Adam, torch.optim.AdamW)
            and all(group.get("fused") for group in optimizer.param_groups)
            and getattr(optimizer, "_step_supports_amp_scaling", False)
            and not has_user_step_hooks(optimizer)
            and all(f.host is None and f.opt_param.device == device for f in trainable))


def _read_later(value: torch.Tensor) -> Callable[[], float]:
    """A reader of `value` for later: on a GPU a copy into pinned host memory is issued now, so the
    read waits only for the work up to here, not for what is issued in between."""
    if value.device.type != "cuda":
        return value.item
    host = torch.empty((), dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)  # on value's device's stream, which need not be the current device
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(value.device))

    def read() -> float:
        ready.synchronize()
        return host.item()
    return read


def global_squared_norm(trainable: list[FlatParam], comm: Comm, norm_is_sharded: bool,
                        guard: NonFiniteGuard | None) -> torch.Tensor:
    """The squared global gradient norm on comm.device, summed over the ranks' shards and tp."""
    squares = torch.zeros((), dtype=torch.float32, device=comm.device)
    for f in trainable:  # under tp, a replicated buffer counts once: on tp rank 0
        if f.tp_sharded or comm.tp_rank == 0:
            squares += squared_norm(f.local_grad()).to(comm.device)
    if guard is not None:
        squares = guard.fold_into_norm(squares, norm_is_sharded)
    if norm_is_sharded:
        comm.all_reduce(squares)
    comm.all_reduce_tp(squares)  # each tp shard's part of the norm
    return squares


_NORM_CHUNK = 1 << 22  # elements: bounds the fp32 temporary, and reads the buffer in cache-sized pieces


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The fp32 sum of squares of `grad`, without an fp32 copy of the whole shard. On a GPU one
    norm kernel reads 16-bit input straight into fp32 accumulators. On the CPU a 16-bit reduction
    copies its input first and vector_norm sums 1e8 floats 2% off, so the squares are summed
    chunk by chunk: a 16 MiB temporary, which also reads the buffer in cache-sized pieces."""
    if grad.is_cuda:
        return torch.linalg.vector_norm(grad, dtype=torch.float32).square()
    total = torch.zeros((), dtype=torch.float32, device=grad.device)
    for chunk in grad.reshape(-1).split(_NORM_CHUNK):
        total += chunk.float().pow(2).sum()
    return total


def _update(trainable: list[FlatParam], optimizer: torch.optim.Optimizer, factor: float | torch.Tensor,
            sub_group_size: int, write_back: bool) -> None:
    """Step the optimizer one sub-group at a time (DeepSpeed's sub_group_size bounds the fp32
    gradient copies alive at once), writing each back unless the caller does so later. Offloaded
    buffers under torch's fused Adam/AdamW step on the host in one pass (offload/host_step.py);
    the others through optimizer.step(), with an fp32 gradient each."""
    groups = stream_groups(sub_groups(trainable, sub_group_size), optimizer)  # disk offload: streamed
    in_flight: list = []  # the post-step gathers in flight, over every sub-group
    folds = isinstance(factor, float) and host_step.folds(optimizer, has_user_step_hooks(optimizer))
    on_host = {f for f in trainable if f.host is not None} if folds else set()
    scratch = host_step.scratch_for() if on_host else None
    try:
        for group in groups:
            for f in group:
                f.before_master_changes()
            written = frozenset(f for f in group if f in on_host and
                                f.step_on_host(optimizer, factor, scratch, write_back))
            stepped = [f for f in group if f not in on_host]
            for f in stepped:  # fp32 gradient copies for one sub-group at a time
                f.set_step_grad(factor)
            if stepped:
                with temporarily(optimizer, "_zeroshard_stepping", True):
                    optimizer.step()  # steps only the parameters that have a gradient: this sub-group's
            for f in stepped:
                f.clear_step_grad()
            if write_back:  # issues the post-step all-gathers (stages 1-2): in flight as we go on
                write_back_together(group, in_flight, written)
    finally:  # even if a step failed (out of memory): no parameter is left a placeholder
        groups.close()
        for f in trainable:
            f.clear_step_grad()
            if write_back:
                f.wait_write_back()


def _write_back(trainable: list[FlatParam]) -> None:
    try:
        write_back_together(trainable, [])
    finally:
        for f in trainable:
            f.wait_write_back()


def sub_groups(flats: list[FlatParam], size: int) -> list[list[FlatParam]]:
    """Consecutive buffers whose owned elements add up to at most `size` (a larger buffer alone).
    The same on every rank (shards are equal), so the write-backs' collectives pair up."""
    groups: list[list[FlatParam]] = []
    total = 0
    for f in flats:
        if not groups or total + f.master.numel() > size:
            groups.append([])
            total = 0
        groups[-1].append(f)
        total += f.master.numel()
    return groups
