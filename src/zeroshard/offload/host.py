"""ZeRO-Offload: model states that rest in host memory, and the copies that move them.

Optimizer offload (stages 1-3) keeps the fp32 master and the optimizer state on the host: each step
the reduced gradient shard goes down in its own dtype and the updated shard comes back up in the
compute dtype. Parameter offload (stage 3) keeps a unit's shard on the host between uses; the
unit's all-gather copies it up first (flat_param.py).

Design notes.
- Host buffers are allocated once, at initialize, one pair per trainable flat buffer: `grad`
  receives the reduced gradient shard, `staging` holds the compute-dtype copy of the updated master
  on its way up. On CUDA they are always pinned: only a copy from pinned memory is asynchronous, and
  a pageable one is staged by the driver through a bounce buffer of its own at a fraction of the
  speed. `pin_memory` pins the offloaded parameter shards, which are copied up at every use, and
  the master only where it is itself copied up (`master_goes_up`): elsewhere nothing copies it,
  and the pinned allocator's power-of-two rounding would cost host memory for nothing. Per step,
  only the sub-group's fp32 gradient temporaries are allocated.
- Copies run on one side stream, so a gradient's way down overlaps the rest of backward and a
  shard's way up overlaps the next sub-group's update. Each copy records an event, and each reader
  waits for its own copy only: the host before it reads `grad`, the compute stream before the
  all-gather that reads a written-back shard. The side stream first waits for the compute stream, so
  a copy never reads a value still being produced.
- A gradient is offloaded as soon as its reduction ends on the backward that ends an accumulation
  cycle; `version` (bumped at every reduction) tells whether a later backward changed it since,
  so correctness never depends on when the early copy happened.
- On a CPU process group host and device are one memory, so the host copies would only duplicate
  what is already there: `grad` is then the reduced gradient itself and an update is written
  straight into the shard, with no `staging`. (Disk offload's largest model is set by this: the
  copy cost a second gradient shard per rank.) Only the delayed parameter update keeps both
  buffers, because its step reads `grad` on a worker thread while the next backward writes the
  gradient.
- Disk offload (nvme/) replaces a host tensor by a file: `disk` is then the rank's store, and the
  master and the shards are made, read and written through the methods below, never by mapping.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from enum import Enum
from typing import Any, Callable

import torch

from ..common.states import move


def master_goes_up(param_dtype: torch.dtype | None, casts_on_device: bool) -> bool:
    """Does the updated fp32 master go up to the device as itself (HostCopies, no `staging`)? Where
    the shard is the device's (param_dtype None: it rests on the host, written there) and what goes
    up is fp32: an fp32 model, or casts on the device."""
    return param_dtype is not None and (param_dtype == torch.float32 or casts_on_device)


def host_empty(device: torch.device, numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
    """A host tensor, pinned if asked and there is a GPU (`device`) to copy to (pinning speeds only that)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=pin and device.type == "cuda")


class Update(Enum):
    """The delayed parameter update's progress (zeroshard.delayed_param_update)."""

    IDLE = "idle"            # nothing to write: the parameters hold every update that succeeded
    RUNNING = "running"      # an update runs on the worker thread
    UNWRITTEN = "unwritten"  # an update has ended that the parameters lack
    FAILED = "failed"        # the worker's update raised: its error waits for the next call that may raise


_UPDATE_MOVES = {Update.IDLE: {Update.RUNNING}, Update.RUNNING: {Update.UNWRITTEN, Update.FAILED},
                 Update.UNWRITTEN: {Update.IDLE, Update.RUNNING}, Update.FAILED: {Update.IDLE}}


class Copier:
    """One engine's host<->device copies: the side stream (CUDA), pinned allocation, and the
    delayed parameter update's worker thread, which the host gradient buffers must wait for."""

    def __init__(self, device: torch.device, delayed: bool = False, disk: Any = None,
                 casts_on_device: bool = False) -> None:
        """delayed: the delayed parameter update is on (the host step overlaps the next backward).
        disk: the rank's nvme.DiskStore with disk offload (the master and shards rest in its files).
        casts_on_device ("zeroshard": {"offload_casts": "device"}): gradients go down and updates
        come up in fp32, converted on the device (see HostCopies)."""
        self.device = device
        self.one_memory = device.type == "cpu" and not delayed  # no copies needed: see the notes
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._worker: ThreadPoolExecutor | None = None
        self.update_state = Update.IDLE
        self._update: Future | None = None  # RUNNING: the worker's update
        self._then: Callable[[], None] = lambda: None  # what follows it on the caller's thread
        self._error: BaseException | None = None  # FAILED: the worker's error, until raised
        self.disk = disk
        self.casts_on_device = casts_on_device
        self._files = 0

    # ---- where offloaded tensors rest: host memory, or files (disk offload) -------------------
    def new_master(self, values: torch.Tensor, pin: bool) -> torch.Tensor:
        """The fp32 master shard with `values`: in host memory, or in a file of the disk store."""
        if self.disk is not None and "optimizer" in self.disk.dirs:
            self._files += 1
            master = self.disk.new_tensor("optimizer", f"flat{self._files}.master", values.numel(),
                                          torch.float32)
            self.disk.write(master, values.float())
            return master
        master = self.host_empty(values.numel(), torch.float32, pin)
        master.copy_(values)
        return master

    def new_shard(self, values: torch.Tensor, pin: bool) -> torch.Tensor:
        """A stage-3 parameter shard at rest with `values`: in host memory, or in a file."""
        if self.disk is not None and "param" in self.disk.dirs:
            self._files += 1
            shard = self.disk.new_tensor("param", f"flat{self._files}.shard", values.numel(), values.dtype)
            self.disk.write(shard, values)
            return shard
        shard = self.host_empty(values.numel(), values.dtype, pin)
        shard.copy_(values)
        return shard

    def on_disk(self, t: torch.Tensor) -> bool:
        """Does `t` rest in a file of the disk store (rather than in host memory)?"""
        return self.disk is not None and self.disk.owns(t)

    def read_shard(self, own: torch.Tensor, shard: torch.Tensor) -> None:
        """own <- an offloaded shard (a file is read into it; host memory is copied, asynchronously
        from pinned memory)."""
        if self.on_disk(shard):
            self.disk.read_shard(shard, own)
        else:
            own.copy_(shard, non_blocking=True)

    def write_shard(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """An offloaded shard <- values (the updated master, in the shard's dtype)."""
        if self.on_disk(shard):
            self.disk.write_shard(shard, values)
        else:
            shard.copy_(values)

    def close(self) -> None:
        """Remove the disk store's files, if any (a failed initialize; teardown does it by itself)."""
        if self.disk is not None:
            self.disk.close()

    def host_empty(self, numel: int, dtype: torch.dtype, pin: bool = True) -> torch.Tensor:
        return host_empty(self.device, numel, dtype, pin)

    def copy(self, dst: torch.Tensor, src: torch.Tensor, after: "torch.cuda.Event | None" = None
             ) -> "torch.cuda.Event | None":
        """dst <- src, on the side stream where there is one, after the compute stream's work so far
        (or after `after`: a pipelined update's thread, whose uploads need not wait for the forward
        issued meanwhile). Both must stay alive and unchanged until the returned event has
        completed (the callers' buffers are persistent)."""
        if self.stream is None:
            dst.copy_(src)
            return None
        if after is not None:
            self.stream.wait_event(after)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    # ---- the delayed parameter update (ZeRO-Offload's DPU) ------------------------------------
    def start_update(self, update: Callable[[], None], then: Callable[[], None]) -> None:
        """Run `update` (the host optimizer step) on a worker thread while training goes on;
        `then` runs on the caller's thread once it is over (the lr scheduler: stepping it while
        the update reads the learning rate would race)."""
        self.finish_update()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroshard-update")
        self._update, self._then = self._worker.submit(update), then
        self._set_update_state(Update.RUNNING)  # the parameters lack it until it is written back

    def finish_update(self, raise_error: bool = True) -> None:
        """Wait for the update in flight, if any, and re-raise its error — or, with raise_error
        False (inside a backward hook, where raising on one rank would leave its peers waiting in
        collectives), keep the error for the next call that may raise (step(), a checkpoint)."""
        if self.update_state is Update.RUNNING:
            error = self._update.exception()
            self._update = None
            if error is None:
                self._set_update_state(Update.UNWRITTEN)
                self._then()
            else:  # a half-updated master must not reach the parameters
                self._error = error
                self._set_update_state(Update.FAILED)
        if raise_error and self.update_state is Update.FAILED:
            error, self._error = self._error, None
            self._set_update_state(Update.IDLE)
            raise error

    @property
    def unwritten(self) -> bool:
        """An update has ended that the parameters lack: write them back, then call written()."""
        return self.update_state is Update.UNWRITTEN

    def written(self) -> None:
        """The parameters hold the master's values (written back, or loaded from a checkpoint)."""
        if self.update_state is Update.UNWRITTEN:
            self._set_update_state(Update.IDLE)

    def _set_update_state(self, new: Update) -> None:
        self.update_state = move(self.update_state, new, _UPDATE_MOVES, "the delayed parameter update")


class HostCopies:
    """The host side of one trainable flat buffer under optimizer offload; see the module notes."""

    def __init__(self, copier: Copier, numel: int, grad_dtype: torch.dtype,
                 param_dtype: torch.dtype | None, master: torch.Tensor | None = None) -> None:
        """param_dtype None: no `staging` (offloaded parameter shards are written on the host).
        Where the copier casts on the device, both host buffers are fp32: a 16-bit gradient is
        converted by the copy down on the device, the fp32 update by the copy up (torch's copy_
        between devices converts on the GPU), twice the link bytes and none of the host's passes.
        Where what goes up is fp32, it is the `master` itself (if pinned, so the copy is
        asynchronous): no `staging`, no host pass to fill it, 4 bytes an element less."""
        self.copier = copier
        own = not copier.one_memory
        goes_up = master_goes_up(param_dtype, copier.casts_on_device)
        if copier.casts_on_device:
            grad_dtype, param_dtype = torch.float32, (None if param_dtype is None else torch.float32)
        self.master = master if own and goes_up and master is not None and \
            not copier.on_disk(master) and (master.is_pinned() or copier.stream is None) else None
        self.grad: torch.Tensor | None = copier.host_empty(numel, grad_dtype) if own else None
        self.staging = copier.host_empty(numel, param_dtype) \
            if own and param_dtype is not None and self.master is None else None
        self._grad_version = -1           # the reduction whose result `grad` holds (or is receiving)
        self._offloaded: "torch.cuda.Event | None" = None     # the gradient's copy down, for the host
        self._written_back: "torch.cuda.Event | None" = None     # for the shard's next reader
        self._staging_read: "torch.cuda.Event | None" = None  # for the next write to `staging`
        self._master_read: "torch.cuda.Event | None" = None   # for the next change of `master`

    @property
    def nbytes(self) -> int:
        """The host buffers this holds (none on one memory: `grad` is then the device's own)."""
        if self.copier.one_memory:
            return 0
        return sum(t.numel() * t.element_size() for t in (self.grad, self.staging) if t is not None)

    def offload(self, device_grad: torch.Tensor, version: int) -> None:
        """Start copying the reduced gradient to the host, unless `grad` already holds this version."""
        if self.copier.one_memory:
            self.grad = device_grad
            return
        if version == self._grad_version:
            return
        self.copier.finish_update(raise_error=False)  # the delayed update may still read `grad`
        self._offloaded = self.copier.copy(self.grad, device_grad)
        self._grad_version = version

    def wait_offload(self, device_grad: torch.Tensor, version: int) -> torch.Tensor:
        """The reduced gradient of this step, on the host and complete."""
        self.offload(device_grad, version)
        if self._offloaded is not None:
            self._offloaded.synchronize()
            self._offloaded = None
        return self.grad

    def offloaded(self) -> torch.Tensor:
        """`grad`, once the copy down offload() issued is complete (any thread may wait for it)."""
        done = self._offloaded
        if done is not None:
            done.synchronize()
        return self.grad

    def before_device_grad_changes(self) -> None:
        """The device gradient is about to be written (a reduction, zeroing): an offload still
        reading it must finish first. Stream order only; the host does not wait."""
        if self._offloaded is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(self._offloaded)

    def drop_device_grad(self) -> None:
        """The device gradient is freed (stages 2-3, after the step): on one memory `grad` was it."""
        if self.copier.one_memory:
            self.grad = None

    def write_back(self, master: torch.Tensor, device_shard: torch.Tensor,
                   after: "torch.cuda.Event | None" = None) -> None:
        """device_shard <- master in the compute dtype, by way of `staging` (or straight from the
        master, where it is what goes up). Asynchronous on CUDA: wait_write_back() orders the
        shard's next reader after it, before_master_changes() the master's next writer."""
        if self.master is not None:
            self._written_back = self._master_read = self.copier.copy(device_shard, self.master, after)
            return
        self.write_back_target(device_shard).copy_(master)
        self.send(device_shard, after)

    def before_master_changes(self) -> None:
        """The master is about to be written (a step, a load): its copy up must have read it."""
        if self._master_read is not None:
            self._master_read.synchronize()
            self._master_read = None

    def write_back_target(self, device_shard: torch.Tensor) -> torch.Tensor | None:
        """The host tensor the updated master's compute-dtype copy is written into: `staging`
        (free again: the previous send has read it), or on one memory the device shard itself;
        None where the master itself goes up. The step in one pass (host_step.py) writes it as it
        updates; send() takes it up."""
        if self.copier.one_memory:
            return device_shard
        if self.master is not None:
            return None
        if self._staging_read is not None:
            self._staging_read.synchronize()  # the previous write-back may still read `staging`
            self._staging_read = None
        return self.staging

    def send(self, device_shard: torch.Tensor, after: "torch.cuda.Event | None" = None) -> None:
        """Start copying `staging` into the device shard (nothing to copy on one memory)."""
        if not self.copier.one_memory:
            self._written_back = self._staging_read = self.copier.copy(device_shard, self.staging, after)

    def wait_write_back(self) -> None:
        """Order the compute stream (and so the collectives issued from it) after the write-back."""
        if self._written_back is not None:
            torch.cuda.current_stream(self.copier.device).wait_event(self._written_back)
            self._written_back = None


def disk_store(flat: Any) -> Any:
    """The disk store (nvme/) behind the flat's offloaded states, or None without disk offload."""
    return getattr(flat.copier, "disk", None) if flat.copier is not None else None
