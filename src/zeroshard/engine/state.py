"""An Engine's state, in and out, outside the training step: checkpoints saved and loaded (at any
world size and stage), the full state dict exported, and what the engine holds and sends, measured
(memory, traffic, disk I/O).

`EngineState` is mixed into engine.Engine, whose constructor builds what these methods read (the
flat buffers, optimizer, scaler, scheduler, comm). Every method that moves data is collective.
"""
from __future__ import annotations

import logging
import os
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from ..checkpoint import load as checkpoint_load, read as checkpoint_read, save as checkpoint_save
from ..checkpoint.integrity import CheckpointError
from ..comm.collectives import Comm
from ..core import memory
from ..core.flat_param import ParamState
from ..offload import nvme
from ..parallel.dtensor import full_tensor
from . import gathered

logger = logging.getLogger("zeroshard")


class EngineState:
    """Checkpoints, exports and measurements of an Engine (see the module docstring)."""

    @property
    def _disk(self) -> Any:
        """Disk offload's store (nvme/), or None without it."""
        return self.copier.disk if self.copier is not None else None

    # ---- checkpoints ----------------------------------------------------------------------------------
    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: Any = None) -> str:
        """Collective. Each rank writes only what it owns; the checkpoint loads at any world size
        and stage. Returns its path; `save_dir/latest` names it once every rank is done."""
        if self.micro_steps % self.config.gradient_accumulation_steps or self.reducer.saw_backward:
            raise RuntimeError("save_checkpoint() in the middle of gradient accumulation (a step() or a "
                               "backward() since the last update) would lose the accumulated gradients; "
                               "save after the step() that ends the cycle")
        tag = checkpoint_save.check_tag(f"step{self.global_steps}" if tag is None else tag)
        # the ranks meet first (comm/watch.gate): a save on some ranks only, or on one that skipped a
        # step while its peer stalls in it, is named, never left to pair its writes' collectives
        self.comm.watch.gate("save_checkpoint()")
        self.wait_for_parameters()
        extra = {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                 "scaler": self.scaler.state_dict(), "config": self.config.raw,
                 "lr_scheduler": self.lr_scheduler.state_dict() if self.lr_scheduler else None,
                 "world_size": self.comm.world_size, "tp": self.comm.tp_size, "stage": self.config.stage,
                 "replicas": self.comm.replicas,
                 "state_dict_keys": self._state_dict_keys, "client_state": client_state}
        with torch.no_grad(), self.comm.outside_step():
            return checkpoint_save.save(save_dir, tag, self.flats, self.optimizer, self._checkpoint_comm,
                                        self._buffers, extra, writes_shards=self.comm.replica_rank == 0)

    @property
    def _checkpoint_comm(self) -> Comm:
        """Checkpoints are written by every rank of the model, tp shards included: over the world
        when the model is split over tp (dp alone holds only one tp rank's shards), or replicated
        (MiCS: a shard group is one copy of many; the first copy's ranks write the shards)."""
        if self.comm.tp_size == 1 and self.comm.replicas == 1:
            return self.comm
        if self._world_comm is None:
            self._world_comm = Comm(None)
        return self._world_comm

    def _resolve_alike(self, target: str, missing_ok: bool) -> str | None:
        """checkpoint_read.resolve, agreed: every rank finds the same checkpoint (or none, or the same
        error). Where they differ (node-local disks), none goes on alone to load, or to start afresh
        while the others load: every rank raises an error naming what each found."""
        try:
            mine: tuple[str, str | None] = ("found", checkpoint_read.resolve(target, missing_ok))
        except CheckpointError as e:
            mine = ("error", str(e))
        views = self._checkpoint_comm.all_gather_objects(mine)
        if any(view != views[0] for view in views):
            seen = "; ".join(f"rank {r}: " + (f"'{found}'" if kind == "found" and found else
                                              "nothing (missing_ok)" if kind == "found" else found)
                             for r, (kind, found) in enumerate(views))
            raise CheckpointError(f"the ranks find different checkpoints at '{target}' ({seen}): every rank "
                                  f"must load from one directory that all of them can reach")
        if views[0][0] == "error":
            raise CheckpointError(views[0][1])
        return views[0][1]

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, *,
                        missing_ok: bool = False) -> tuple[str | None, Any]:
        """Collective; DeepSpeed's call. Load `load_dir/tag`, or without a tag the checkpoint that
        `load_dir/latest` names (or `load_dir` itself, a checkpoint directory), written at any world
        size and stage; returns (its path, the saved client_state). Nothing changes if it fails.
        With missing_ok, a missing or empty directory is no error: it logs a line and returns
        (None, None), so "resume if there is anything to resume" is one call. With
        load_optimizer_states=False, the weights, buffers, step count, random state and client_state
        are loaded; the optimizer starts afresh (no state, this run's hyperparameters) and the lr
        scheduler and loss scale stay as this engine has them (fresh in a new one): for a new
        optimizer, new parameter groups or other parameters frozen. load_module_only loads the
        weights and buffers alone: step count and random state stay this run's, and the optimizer
        starts afresh as with load_optimizer_states=False (DeepSpeed keeps its in-memory moments).
        load_lr_scheduler_states=False keeps this engine's scheduler (its own schedule from step 0)."""
        if tag is not None and not isinstance(tag, str):
            raise TypeError(f"load_checkpoint(load_dir, tag): tag is a checkpoint's name under load_dir, "
                            f"got {tag!r}; missing_ok is keyword-only: load_checkpoint(dir, missing_ok=True)")
        if not load_module_strict:
            raise ValueError("load_checkpoint(load_module_strict=False): zeroshard loads every parameter (a "
                             "checkpoint of another model is refused by name); to load part of a model, "
                             "load its state_dict into the model before zeroshard.initialize()")
        target = load_dir if tag is None else os.path.join(load_dir, tag)
        self.comm.watch.gate("load_checkpoint()")  # (as save_checkpoint: a load on some ranks only is named)
        path = self._resolve_alike(target, missing_ok)
        if path is None:
            logger.info("no checkpoint in '%s': starting from the model's own values", target)
            return None, None
        load_optimizer_states = load_optimizer_states and not load_module_only
        on_gpu = self.comm.device.type == "cuda"  # load_module_only keeps this run's random state:
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state(self.comm.device) if on_gpu else None) \
            if load_module_only else None
        self._reshard_units()  # what is gathered now would shadow the loaded shards
        for flat in self.flats:
            flat.secondary = None  # (hpZ: what forward left for backward holds old values)
        if self.pipeline is not None:
            self.pipeline.reset()  # a failed update's error is answered by this load
        self.wait_for_parameters()
        for flat in self.flats:
            flat.await_host_read()  # an offloaded shard is written in place
        with torch.no_grad(), self.comm.outside_step():
            extra = checkpoint_load.load(target, self.flats, self.optimizer, self._checkpoint_comm,
                                         self._buffers, load_optimizer_states)
            disk = self._disk
            for flat in self.flats:
                flat.zero_grad()
                if flat.trainable:
                    flat.write_back()  # with disk offload, reads the master's file through its map ...
                    if disk is not None:
                        disk.drop_pages([flat.master])  # ... whose pages go, one buffer at a time
                elif flat.policy.shard_params and flat.persistent:
                    flat.unshard_again()
            for flat in self.flats:
                flat.wait_write_back()
        self.reducer.end_step()  # the loaded state starts a cycle: a step() needs a backward first
        if self.copier is not None:
            self.copier.written()  # the parameters are the loaded master's
        if load_module_only:
            torch.set_rng_state(rng[0])  # DeepSpeed's load_module_only loads the module alone
            if on_gpu:
                torch.cuda.set_rng_state(rng[1], self.comm.device)
            return path, extra["client_state"]
        # Checkpoints are taken at accumulation boundaries; the accumulation steps may differ now.
        self.global_steps = extra["global_steps"]
        self.micro_steps = self.global_steps * self.config.gradient_accumulation_steps
        clock = self.comm.watch.clock
        clock.step, clock.micro = self.global_steps, self.micro_steps
        if load_optimizer_states:
            self.scaler.load_state_dict(extra["scaler"])
            schedule = extra["lr_scheduler"] if load_lr_scheduler_states else None
            if self.lr_scheduler is not None and schedule is not None:
                self.lr_scheduler.load_state_dict(schedule)
        return path, extra["client_state"]

    # ---- views and measurements -----------------------------------------------------------------
    @contextmanager
    def gathered_parameters(self, *params: Any, modifier_rank: int | None = None) -> Iterator[nn.Module]:
        """Collective. Inside, engine.module's parameters hold their full values at every stage (at
        stage 3 the whole model is gathered at once, in the compute dtype): read weights outside
        forward, or, with modifier_rank, change them in place on that rank; on exit its changes go
        to every rank and into the training state (fp32 masters included; in 16-bit precision the
        values inside are the compute copies, so a write reaches the masters rounded to 16 bits:
        load exact fp32 weights before initialize()). Yields the module. A
        forward inside uses the gathered weights and issues no collective, so one rank may run it
        alone (rank 0 generating). As DeepSpeed's GatheredParameters, FSDP's summon_full_params, but
        always of every parameter: DeepSpeed's positional `params` is refused by name."""
        modifier_rank = gathered.check_can_gather(self.comm, params, modifier_rank,
                                                  self.config.delayed_param_update)
        if self.policy.shard_params or modifier_rank is not None:  # it issues collectives
            self.comm.watch.gate("gathered_parameters()")
        self.wait_for_parameters()
        with gathered.full_parameters(self.units, self.flats, self.comm, modifier_rank):
            yield self.module

    def full_state_dict(self, rank0_only: bool = False) -> dict[str, torch.Tensor]:
        """Collective: the model's state_dict with full fp32 parameters, on CPU, on every rank; with
        rank0_only, on rank 0 alone (the others take part in the gathers, keep nothing and get {}:
        an export on a node of N ranks then holds one host copy of the model, not N)."""
        values: dict[str, torch.Tensor] = {}
        keep = not rank0_only or self.comm.rank == 0
        self.comm.watch.gate("full_state_dict()")  # a rank alone is named, not left to pair its gathers
        self.wait_for_parameters()
        with torch.no_grad(), self.comm.outside_step():
            for flat in self.flats:
                for spec, (slot, value) in zip(flat.specs, flat.gathered_params()):
                    whole = full_tensor(value, spec)  # collective over tp for a split parameter
                    if keep:
                        values.update(dict.fromkeys(slot.names, whole.float().cpu().clone()))
            for name, buffer in self._buffers.items():
                copy = buffer.detach().clone()
                self.comm.broadcast(copy, 0)  # rank 0's running statistics, as DDP keeps them
                if keep:
                    values[name] = (copy.float() if copy.is_floating_point() else copy).cpu()
        return {k: values[k] for k in self._state_dict_keys if k in values}

    def memory_stats(self) -> dict[str, int]:
        """Bytes this rank holds now: model states by category, module buffers and temporaries;
        with activation_checkpointing, the checkpointed inputs the last forward kept, by place.
        `model_states_in_step`: the model states from backward through the step, gradients
        included (stages 2-3 free them after the step, so `model_states` then has none)."""
        self._finish_update()  # the optimizer state is the update's until it ends
        stats = memory.engine_stats(self.flats, self.optimizer, self.module, self.precision.offload,
                                    self.peak_temporary, self.comm.largest_bucket)
        if self.activations is not None:
            stats["checkpointed_activations"] = self.activations.peak["device"]
            stats["checkpointed_activations_host"] = self.activations.peak["host"]
        return stats

    def _note_temporaries(self) -> None:
        """Sample the temporaries (gathered units, full-size gradients, in-flight reductions) at
        the moments they peak: after each unit is gathered and when a buffer's gradient is complete."""
        # (After every gather: the flats with nothing temporary, most of them at stage 3, are passed
        # over by the cheapest test, or a model of many units would spend O(units) calls per gather.)
        now = sum(memory.temporary_bytes(f) for f in self.flats
                  if f.state is not ParamState.SHARDED or f.grads.full is not None or f.grads.inflight
                  or f.secondary is not None)
        self.peak_temporary = max(self.peak_temporary, now)

    def comm_stats(self) -> dict[str, dict[str, Any]]:
        """Per collective kind: calls and bytes (paper convention), for the last step and in total;
        "store": the divergence checks' c10d-store writes and reads (calls, payload bytes), in total,
        outside the collectives' figures (check_collectives); with activation_checkpointing,
        "activation_all_gather": the all-gathers over tp before each recompute, in total."""
        extra = {} if self.activations is None else {"activation_all_gather": dict(self.activations.gathers)}
        return {**self.comm.stats(), "store": dict(self.comm.watch.store_traffic), **extra}

    def close(self) -> None:
        """Remove disk offload's files now. They also go when the engine is collected and at
        interpreter exit; call this where neither runs (a fork-started worker ends with os._exit).
        The engine cannot train afterwards."""
        if self._disk is not None:
            self._disk.close()

    def io_stats(self) -> dict[str, Any]:
        """Disk offload: bytes read and written in the last step and in total (zeros without it)."""
        return nvme.io_stats(self._disk)

    def num_parameters(self, trainable_only: bool = False) -> int:
        """Ψ: distinct parameters (tied weights once), without padding; under tp, this rank's part
        (its shards of the split parameters and the replicated ones), which ZeRO shards over dp."""
        return sum(f.layout.numel for f in self.flats if f.trainable or not trainable_only)
