"""The offloaded update pipelined with the next forward: the same step, started early.

Sequentially, an offloaded step runs backward, then the host's whole update, then the next forward:
the device waits for the host and the host for the device. The update needs nothing from the next
forward, and the next forward's unit k needs only unit k's update. So once the step has decided
(the global norm, clipping, a skip: one scalar read at the end of backward), step() hands the
update to a worker thread and returns; the worker updates the offloaded buffers one at a time, in
the order the forward uses them, and starts each one's copy up as soon as its update ends. The next
forward's gather of a buffer (FlatParam._shard_on_device, the one place a shard is read) waits for
that buffer's update alone.

Design notes.
- The same bits as the sequential step: the worker runs the same per-buffer update (host_step.py,
  with the hyperparameters copied when the step started, so an lr scheduler stepped meanwhile
  changes nothing) on the same gradients (references taken at the start: a gradient freed or
  rewritten afterwards is not the one read, see FlatGrad._grad_will_change), and each buffer's
  values become visible only after its update.
- The worker moves data only. Collectives stay on the caller's thread, in an order every rank
  shares: a buffer kept gathered (stages 1-2, persistent stage-3 buffers) is UPDATING after step()
  and all-gathered at its first use, after every UPDATING buffer before it in the update's order
  (issue_before), so ranks issue the same gathers in the same order even if a unit is skipped on
  one of them.
- Bookkeeping that autograd sees (version counters, placeholders) is done by the caller when the
  update starts, not by the worker.
- An error in the worker's update is kept and raised by every later wait that may raise (a forward,
  step(), a checkpoint) until load_checkpoint() resets it: part of the model then holds the update
  and part does not, and training on must not look normal. Inside backward (a re-gather), a wait
  does not raise: one rank leaving backward would leave its peers waiting in collectives.
- Only torch's fused Adam/AdamW with its update folded (host_step.folds), and offloaded state in
  host memory; otherwise step() runs the sequential update.
"""
from __future__ import annotations

import threading
from contextlib import nullcontext
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ..offload import host_step

if TYPE_CHECKING:
    from .flat_param import FlatParam


class UpdateFailed(RuntimeError):
    """The pipelined host update of a step failed; the model holds part of it."""


class Pending:
    """One buffer's update in flight: set once the worker has updated its master and started its
    copy up (or failed, or never got to it)."""

    def __init__(self, pipeline: "PipelinedUpdate") -> None:
        self.pipeline = pipeline
        self.done = threading.Event()

    def wait(self, flat: "FlatParam", raise_error: bool) -> None:
        self.done.wait()
        if self.pipeline.error is None:
            flat.pending = None
        elif raise_error:
            raise self.pipeline.failure()


class PipelinedUpdate:
    """The engine's pipelined update (zeroshard.pipelined_update): at most one in flight."""

    def __init__(self, device: torch.device) -> None:
        self.device = device  # the compute device (the worker's CUDA calls name it)
        self.order: list[FlatParam] = []  # the buffers of the last update, in update order
        self.error: BaseException | None = None  # the worker's, until reset()
        self._step = 0
        self.started = 0  # updates begun here (the others ran sequentially: see applies())
        self._future: Future | None = None
        self._worker: ThreadPoolExecutor | None = None

    @staticmethod
    def applies(optimizer: torch.optim.Optimizer, trainable: list["FlatParam"], has_hooks: bool) -> bool:
        return all(f.host is not None for f in trainable) and host_step.folds(optimizer, has_hooks)

    def start(self, trainable: list["FlatParam"], optimizer: torch.optim.Optimizer, factor: float,
              step: int) -> None:
        """Begin the update of every buffer by `factor` x its host gradient; returns at once."""
        self.finish_local()
        copies = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        group_of = {id(p): copy for g, copy in zip(optimizer.param_groups, copies) for p in g["params"]}
        jobs = []
        for f in trainable:
            pending = Pending(self)
            jobs.append((f, f.host.grad, group_of[id(f.opt_param)], pending))
            f.begin_update(pending)
        self.order, self._step = list(trainable), step
        self.started += 1
        # marked here, not only by the worker's first update: the caller's lr scheduler steps next,
        # and torch warns ("lr_scheduler.step() before optimizer.step()") where the mark is not yet set
        optimizer._opt_called = True
        after = None  # the uploads follow what was issued before the step, not the next forward
        if self.device.type == "cuda":
            after = torch.cuda.Event()
            after.record(torch.cuda.current_stream(self.device))
        if self._worker is None:
            self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="zeroshard-pipeline")
        self._future = self._worker.submit(self._run, jobs, optimizer, factor, after)

    def _run(self, jobs: list[tuple[Any, ...]], optimizer: torch.optim.Optimizer, factor: float,
             after: Any) -> None:
        """The worker: one buffer after another; never raises (the error is kept)."""
        scratch = host_step.scratch_for()
        on_device = torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()
        try:
            with on_device:
                for f, grad, group, pending in jobs:
                    f.before_master_changes()
                    if not f.copier.one_memory:
                        grad = f.host.offloaded()  # its copy down, complete
                    written = f.step_on_host(optimizer, factor, scratch, True, grad, group)
                    f.send_values(written, after)
                    pending.done.set()
        except BaseException as e:  # noqa: BLE001 (kept, and raised on the caller's thread)
            self.error = e
        finally:
            for *_, pending in jobs:  # nobody waits forever, on success or not
                pending.done.set()

    def finish_local(self) -> None:
        """Wait for the worker (no collective); raise its error, if any."""
        if self._future is not None:
            self._future.result()
            self._future = None
        if self.error is not None:
            raise self.failure()

    def finish(self) -> None:
        """Collective: the update done and every buffer it changed gathered where it is kept so."""
        self.finish_local()
        for f in self.order:
            f.wait_update()
        for f in self.order:
            f.start_unshard_updated()
        for f in self.order:
            f.finish_unshard_updated()
        self.order = []

    def issue_before(self, flat: "FlatParam") -> None:
        """Before `flat`'s post-update gather: those of the UPDATING buffers ahead of it in the
        update's order (every rank issues them in that order)."""
        for f in self.order:
            if f is flat:
                return
            f.start_unshard_updated()

    def failure(self) -> UpdateFailed:
        error = UpdateFailed(f"the host update of step {self._step} failed ({self.error!r}); the model "
                             f"now holds part of that update: load a checkpoint (engine.load_checkpoint) "
                             f"to go on")
        error.__cause__ = self.error
        return error

    def reset(self) -> None:
        """Before a checkpoint load replaces every value: wait for the worker, forget its error."""
        if self._future is not None:
            self._future.result()
            self._future = None
        self.error = None
        for f in self.order:
            f.pending = None
