"""Engine: wraps a module for ZeRO data parallelism. The stage is data (a StagePolicy), not code paths.

One step, at every stage:
  forward    stage 3 gathers each unit before use and frees it after (hooks in units.Unit);
  backward   each parameter's gradient moves into its flat buffer as soon as it is accumulated;
             complete buffers are reduced in one fixed order (reduce.py): during backward at
             stages 2-3 (and 0-1 with overlap_comm), else at step();
  step       the optimizer updates the flat tensors it owns (fp32 masters), stages 1-2
             all-gather the updated parameters, gradients are cleared.
"""
from __future__ import annotations

from contextlib import contextmanager
from enum import Enum
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn

from ..comm.collectives import Comm
from ..comm.diagnosis import WRITE_GATE
from ..comm.devices import check_placement, group_device, move_buffers
from ..comm.topology import check_mics, read_topology
from ..comm.watch import DivergenceError, Watch
from ..comm.zeropp import build_zeropp
from ..common.states import move
from ..config import Config
from ..construct import deferred_non_parameters, materialize_
from ..core.flat_param import FlatParam
from ..core.heap import HeapReleaser
from ..core.nonfinite import NonFiniteError, NonFiniteGuard
from ..core.optim import OptimizerSpec, build_optimizer, resolve_groups
from ..core.policy import Buckets, StagePolicy
from ..core.precision import LossScaler, Precision, convert_buffers
from ..core.prefetch import UnitOrder, gathering_limits
from ..core.reduce import GradientReducer
from ..core.schedules import refuse_metric_schedule, scheduler_factory
from ..core.pipeline import PipelinedUpdate
from ..core.step import StepInputs, sharded_step
from ..core.units import NamedParams, Unit, build_units, install_hooks, persistent_buffers
from ..offload import nvme
from ..offload.host import Copier, host_empty
from ..parallel.activations import CheckpointStore, checkpoint_units
from ..parallel.dtensor import point
from ..parallel.mesh import Axes, check_parallelized
from .checks import (check_model, check_module_type, check_zeropp_layout, verify_same_on_every_rank,
                     verify_same_optimizer)
from .compat import EngineCompat
from .state import EngineState


class TrainingState(Enum):
    """Where the engine stands between two step() calls (a micro-step)."""

    IDLE = "idle"                    # no engine.backward() since the last step() call
    BACKWARD = "backward"            # inside engine.backward()
    BACKWARD_DONE = "backward done"  # engine.backward() finished its backward: step() need not


_STATE_MOVES = {
    TrainingState.IDLE: {TrainingState.BACKWARD},
    TrainingState.BACKWARD: {TrainingState.BACKWARD_DONE, TrainingState.IDLE},  # IDLE: backward raised
    TrainingState.BACKWARD_DONE: {TrainingState.BACKWARD, TrainingState.IDLE},
}


class Engine(EngineState, EngineCompat):
    """The wrapped model. Use it as the model; call backward() and step() instead of the usual ones.
    (Checkpoints, exports and measurements: state.EngineState; DeepSpeed's conveniences and
    pointers for nn.Module's names: compat.EngineCompat.)"""

    def __init__(self, module: nn.Module, optimizer: OptimizerSpec, config: Config, axes: Axes | None = None,
                 param_groups: list[dict] | None = None, lr_scheduler: Any = None) -> None:
        """Over axes.dp_group (default: the world), with the model split over axes.tp_mesh if given
        (see zeroshard.initialize, which is how an engine is made)."""
        axes = axes or Axes(None, None)
        check_module_type(module)
        check_placement(module, group_device(axes.dp_group))  # local, alike on every rank: before any
        check_parallelized(module, axes)  # collective (a bad mesh fails everywhere)
        topology = read_topology(config.ranks_per_node, dist.get_rank(), dist.get_world_size())
        if axes.replicate_group is not None:  # (local checks, before the first collective)
            check_mics(dist.get_world_size(axes.dp_group), topology, dist.get_world_size())
        check_zeropp_layout(config, axes, topology)
        comm = Comm(axes.dp_group, _watch(axes, config), axes.tp_group, axes.replicate_group,
                    topology)  # watched from the first collective
        if axes.tp_size == 1 and comm.world_size == dist.get_world_size():
            comm.watch.lend()  # zeroshard.mean_over_ranks and gather_objects are watched with it
        verify_same_on_every_rank(comm, module, config)  # first: a rank-local error would leave peers waiting
        if comm.replicas > 1:  # MiCS: and across the shard groups
            verify_same_on_every_rank(Comm(None), module, config)
        check_model(module, config)
        config.check_batch_sizes(comm.data_parallel[1])  # (MiCS: every copy's ranks read their own data)
        # ZeRO++'s groups: made once every rank is known to run the same config (new_group pairs up)
        comm.zeropp = build_zeropp(config.zero, config.quantized_gradient_bits, topology, dist.get_rank(),
                                   dist.get_world_size())
        self.module, self.config, self.comm = module, config, comm
        originals = {id(p): (p.device, p.dtype) for p in module.parameters()}
        self.flats: list[FlatParam] = []  # filled as buffers are built, so a failure can undo them
        self._moved_buffers: list[tuple[nn.Module, str, torch.Tensor]] = []  # likewise
        try:
            self._build(optimizer, param_groups, lr_scheduler)
        except BaseException:
            self._restore_module(originals)  # a failed initialize leaves the model as it was
            if getattr(self, "copier", None) is not None:
                self.copier.close()  # disk offload: no file outlives a failed initialize
            raise
        nvme.tie(self, self._disk)  # files go with the engine
        module._zeroshard_wrapped = True

    def _build(self, optimizer: OptimizerSpec, param_groups: list[dict] | None, lr_scheduler: Any) -> None:
        module, config, comm = self.module, self.config, self.comm
        self.policy = StagePolicy.for_stage(config.stage)
        self.precision = Precision.from_config(config)
        self.scaler = LossScaler(config.scaler, report=comm.rank == 0)
        self.nonfinite = NonFiniteGuard(config.on_nonfinite, comm)  # bf16/fp32: no scaler catches NaNs
        release = config.release_host_memory
        release = release if release is not None else comm.device.type == "cpu"
        self.heap = HeapReleaser() if release else None  # (core/heap.py)
        options, group_of = resolve_groups(module, param_groups)
        # Fail before touching the model where we can: a dry run of the optimizer over stand-ins.
        home = torch.device("cpu") if config.zero.offload_optimizer else comm.device  # where shards live
        stand_ins = [{"params": [nn.Parameter(torch.zeros(1, device=home))], **o} for o in options]
        probe = build_optimizer(optimizer, config, stand_ins, guarded=False)
        verify_same_optimizer(comm, probe)  # each rank would update its shard with its own options
        self.copier: Copier | None = None  # host<->device copies (offload)
        if self.precision.offload or self.precision.offload_params:  # disk offload: its checks, then its
            disk = nvme.open_store(config, comm, module, probe, partial(host_empty, comm.device))  # files
            self.copier = Copier(comm.device, config.delayed_param_update, disk,
                                 casts_on_device=config.offload_casts == "device")
        lr_scheduler = scheduler_factory(lr_scheduler, config.scheduler)
        materialize_(deferred_non_parameters(module), module)  # buffers are replicated: all at once
        # Parameters move to the group's device unit by unit, as their flat buffers are built.
        self._moved_buffers = move_buffers(module, comm.device)
        self.units = self._build_units(group_of)
        self.activations: CheckpointStore | None = None  # ZeRO-R (activation_checkpointing)
        if config.activations is not None:
            self.activations = checkpoint_units(self.units, config.activations, comm)
        self._state_dict_keys = list(module.state_dict().keys())
        with torch.no_grad(), comm.outside_step():
            for b in dict.fromkeys(module.buffers()):
                comm.broadcast(b, 0)
                comm.broadcast_tp(b)  # buffers are replicated over tp as well
                comm.broadcast_replicas(b)  # and over MiCS replicas
        groups = [{"params": [f.opt_param for f in self.flats if f.trainable and f.group == i], **opts}
                  for i, opts in enumerate(options)]
        # Empty groups are kept, so engine.optimizer.param_groups[i] is the user's param_groups[i].
        self.optimizer = build_optimizer(optimizer, config, groups)
        # Optional, as in DeepSpeed: a callable optimizer -> scheduler (a class, a lambda) the engine
        # steps after every real optimizer step and saves in checkpoints.
        self.lr_scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None else None
        refuse_metric_schedule(self.lr_scheduler)
        delayed = self.copier if config.delayed_param_update else None
        self.pipeline = PipelinedUpdate(comm.device) if config.pipelined else None
        for flat in self.flats:
            flat.pipeline = self.pipeline
        self.step_inputs = StepInputs(self.flats, self.optimizer, comm, self.scaler, config.gradient_clipping,
                                      self.policy.shard_optimizer, config.zero.sub_group_size, delayed,
                                      self._after_update, self.nonfinite, self.pipeline)
        self.reducer = GradientReducer(self.units, self.policy, config.overlap_comm, self._note_temporaries)
        z = config.zero
        limits = gathering_limits(z.stage3_prefetch_bucket_size, z.stage3_max_reuse_distance,
                                  config.overlap_comm, comm.device.type)
        self.unit_order = UnitOrder(config.overlap_comm, self._note_temporaries, limits.forward,
                                    z.stage3_max_live_parameters, limits.reuse, self.reducer.reduce_ready,
                                    keep_tail=limits.keep_tail, backward_numel=limits.backward)
        install_hooks(self.units, self.unit_order, self.policy, config.defer_param_gather or config.pipelined,
                      comm.rank, comm.world_size)
        convert_buffers(module, self.precision.param_dtype)  # last: nothing can fail after it
        self._buffers = persistent_buffers(module)
        self.global_steps = 0      # optimizer steps taken (skipped fp16 steps included)
        self.micro_steps = 0       # engine.step() calls
        self.last_grad_norm: float | None = None
        self.step_applied = False  # the last step() updated the parameters (was_step_applied())
        self.state = TrainingState.IDLE
        self._world_comm: Comm | None = None  # checkpoints under tp: see _checkpoint_comm
        self.peak_temporary = 0  # most temporary bytes seen alive at once (sampled; see memory_stats)

    def _set_state(self, new: TrainingState) -> None:
        self.state = move(self.state, new, _STATE_MOVES, "the engine")

    def wait_for_parameters(self) -> None:
        """Stages 1-2 with zeroshard.defer_param_gather: complete the post-step all-gathers still
        in flight. Until then (or the next forward) the module's parameters are empty placeholders;
        call this before reading them directly (at stage 3: inside gathered_parameters()).
        With zeroshard.delayed_param_update it also waits for the update running on the host; with
        a pipelined update, for it and the gathers of what it changed (collective, then)."""
        self._finish_update()
        if self.pipeline is not None:
            self.pipeline.finish()
        if not self.policy.shard_params:
            for flat in self.flats:
                flat.unshard()

    def _finish_update(self) -> None:
        """The host's update over (delayed or pipelined), its error raised; no collective."""
        if self.copier is not None:
            self.copier.finish_update()
        if self.pipeline is not None:
            self.pipeline.finish_local()

    def _restore_module(self, originals: dict[int, tuple[torch.device, torch.dtype]]) -> None:
        """Give every parameter its own tensor again, with its values (from the master where there is
        one), original device and dtype. Collective at stage 3, where every rank fails alike."""
        with torch.no_grad(), self.comm.outside_step():
            for flat in self.flats:
                for p, spec, (_, value) in zip(flat.params, flat.specs, flat.gathered_params()):
                    point(p, value.to(*originals[id(p)], copy=True), spec)
        for m, name, buffer in self._moved_buffers:
            m._buffers[name] = buffer

    def _build_units(self, group_of: dict[int, int]) -> list[Unit]:
        zero = self.config.zero
        buckets = Buckets(zero.reduce_bucket_size, zero.allgather_bucket_size)

        def new_flat(members: NamedParams, group: int) -> FlatParam:
            numel = sum(p.numel() for _, p in members)
            flat = FlatParam(members, self.comm, self.policy, buckets, self.precision, trainable=group >= 0,
                             persistent=numel <= zero.stage3_param_persistence_threshold, group=group,
                             copier=self.copier)
            self.flats.append(flat)  # as soon as it exists, so a failure later can undo it
            return flat
        return build_units(self.module, self.config.unit_modules, group_of, new_flat)

    # ---- the training step ----------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.comm.watch.clock.phase = "forward"
        if self.activations is not None:
            self.activations.reset_peak()  # memory_stats() reports the last forward's
        return self.module(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        """Where the model's parameters and buffers live (the process group's device): put inputs here."""
        return self.comm.device

    def train(self, mode: bool = True) -> "Engine":
        self.module.train(mode)
        return self

    def eval(self) -> "Engine":
        return self.train(False)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of loss x loss scale / accumulation steps, then reduce every gradient buffer not
        yet reduced (stages 2-3; inside no_sync() nothing is reduced)."""
        if loss.numel() != 1:
            raise ValueError(f"backward() needs a scalar loss, got shape {tuple(loss.shape)}")
        if not loss.requires_grad:
            raise ValueError("backward() needs a loss that requires grad; this one was computed under "
                             "torch.no_grad(), detached, or from no trainable parameter")
        self.comm.watch.clock.backwards += 1
        self.comm.watch.check("backward")  # before its collectives: divergent ranks never pair them
        if not self.scaler.enabled:
            self.nonfinite.note_loss(loss)
        self._set_state(TrainingState.BACKWARD)
        self.reducer.begin_backward(self.is_gradient_accumulation_boundary())
        factor = self.scaler.scale / self.config.gradient_accumulation_steps
        try:
            (loss * factor if factor != 1.0 else loss).backward()
        except BaseException as e:
            self._set_state(TrainingState.IDLE)
            if isinstance(e, Exception) and not isinstance(e, (DivergenceError, dist.DistError)):
                # the user's error (a loop may catch it and go on): the reductions this backward
                # began are waited for, and its cycle dropped. Not where the group itself failed
                # (nothing will train on, and a wait would meet the failure again), nor on Ctrl-C.
                self.reducer.backward_failed()
                self._drop_cycle()
            else:
                self.reducer.backward_failed(wait=False)
            raise
        try:
            self._finish_backward()
        except RuntimeError:  # refused after its reductions (a parameter frozen, or written in forward)
            self._drop_cycle()
            self._set_state(TrainingState.IDLE)
            raise
        self._set_state(TrainingState.BACKWARD_DONE)  # decided by API calls, the same on every rank

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate locally without communicating; the first backward
        after it reduces everything accumulated. At stages 2-3 this keeps full-size gradients alive
        between backwards (memory), as FSDP's no_sync does."""
        with self.reducer.no_sync():
            yield

    def is_gradient_accumulation_boundary(self) -> bool:
        """Will the next step() call update the parameters?"""
        return (self.micro_steps + 1) % self.config.gradient_accumulation_steps == 0

    def _finish_backward(self) -> None:
        self.reducer.finish_backward()
        self._reshard_units()

    def _reshard_units(self) -> None:
        if self.policy.shard_params:
            for unit in self.units:
                unit.reshard()

    def step(self) -> None:
        """Called every micro-batch; at accumulation boundaries: reduce (stages 0-1), clip, update
        the owned shards (skipped on fp16 overflow), refresh parameters, clear gradients. First, on
        a rank whose parameters were written in place since, every rank meets at a gate."""
        written = False
        for flat in self.flats:  # before anything changes: a refused step can be retried
            flat.refuse_replaced()
            flat.refuse_lost_writes()
            written |= flat.writes.refuse()
        if written:  # made on every rank (each loads the same state_dict), it trains on; on some only,
            # the ranks would train different models (or a mix of shards): named by the gate.
            self.comm.watch.gate(WRITE_GATE)
        if self.is_gradient_accumulation_boundary() and not self.reducer.saw_backward:  # torch: no update
            raise RuntimeError("step() with no backward since the last update would apply weight decay "
                               "and momentum to zero gradients: call engine.backward(loss) before step()")
        if self.is_gradient_accumulation_boundary() and self.state is TrainingState.BACKWARD_DONE and \
                self.reducer.left_local:  # (after a plain loss.backward() the step completes its reductions)
            raise RuntimeError(f"step() after backwards that all ran inside no_sync(): at stage "
                               f"{self.config.stage} the gradients are reduced during backward, so each rank "
                               f"would update with its own. Run the cycle's last backward outside no_sync(), "
                               f"as with DDP")
        if self.state is not TrainingState.BACKWARD_DONE:
            self._refuse_unscaled_backward()
        self.step_applied = False
        watch = self.comm.watch
        watch.clock.micro += 1  # step() calls begun
        watch.check("step")
        if self.state is not TrainingState.BACKWARD_DONE:
            self._finish_backward()  # the user called loss.backward() instead of engine.backward()
        self._set_state(TrainingState.IDLE)
        self.micro_steps += 1
        if self.micro_steps % self.config.gradient_accumulation_steps:
            return
        self._reshard_units()  # a unit gathered now (a forward without backward) would go stale
        self.wait_for_parameters()  # the optimizer is about to write into what they gather into
        if not self.policy.shard_grads:
            for flat in self.flats:
                if flat.trainable and not flat.reduced:  # unless overlap_comm did it in backward
                    flat.reduce()
        if self.comm.replicas > 1:  # MiCS: each shard group's average, averaged over the copies
            for flat in self.flats:
                flat.average_over_replicas()
        for flat in self.flats:
            flat.offload_grad()  # offload_optimizer: on its way to the host, if it is not yet
        self.reducer.end_step()
        skipped = self.skipped_steps
        try:
            self.last_grad_norm = sharded_step(self.step_inputs, self.global_steps)
        except NonFiniteError:  # raised on every rank, before any update: the step did not happen,
            self._drop_cycle()  # and its gradients go, so a loop that catches it trains on
            raise
        self.step_applied = self.skipped_steps == skipped  # (begun, with the delayed update)
        for flat in self.flats:
            flat.zero_grad()
        self.comm.end_step()
        if self.heap is not None:  # what this step freed and the next may not reuse (core/heap.py)
            self.heap.after_step()
        self.global_steps += 1
        watch.clock.step = self.global_steps
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0 and self.comm.rank == 0:
            self._print_step()

    def _after_update(self) -> None:
        if self.lr_scheduler is not None:  # (only real updates step it: not a skipped fp16 step)
            self.lr_scheduler.step()


def _watch(axes: Axes, config: Config) -> Watch:
    """The engine's collective history, checks and bounded waits (comm/watch.py), over dp; each tp
    rank's dp group (each MiCS replica's shard group) keeps its store keys apart."""
    group = axes.dp_group
    space = f"tp{axes.tp_rank}/" if axes.tp_size > 1 else \
        f"replica{dist.get_rank(axes.replicate_group)}/" if axes.replicate_group is not None else ""
    return Watch(dist.get_rank(group), dist.get_world_size(group), config.collective_timeout,
                 config.check_collectives, on_cuda=group_device(group).type == "cuda", space=space)
