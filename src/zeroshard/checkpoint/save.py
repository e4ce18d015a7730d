"""Saving sharded checkpoints on torch.distributed.checkpoint (DCP), loadable at any world size and stage.

Layout-free format: every rank writes only the elements it owns, as *pieces* of each parameter
(flattened, fp32, keyed "param/<name>/<start>"; a parameter split over tp along dim d is
flattened with d first, meta["dims"][name] = d, so each rank's piece is one range: see
parallel/dtensor.py) and of each elementwise optimizer state
("optim.<key>/<name>/<start>"). Nothing in the files depends on N, padding or the stage, so on load
each rank reads exactly the pieces that overlap what it now holds. Small state (shapes, scalar
optimizer state, counters, scaler, scheduler, config, the user's client_state) is one pickled blob
written by rank 0; RNG states are per rank.

Atomic: DCP writes into "<dir>/.<tag>.tmp"; only when every rank is done, and the manifest of
checksums is written (integrity.py), does rank 0 rename it to "<dir>/<tag>" and then replace
"<dir>/latest" (commit.py: the commit, failed saves and what interrupted ones leave).
Verified: load, info and consolidate check every file's size and checksum, then the metadata,
before reading a tensor (read.py; integrity.py and meta.py state the invariants).
"""
from __future__ import annotations

import os
import pickle
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.agree import first_error
from ..comm.collectives import Comm
from ..core.flat_param import FlatParam
from ..core.memory import on_disk
from . import integrity, meta as checkpoint_meta
from .commit import LATEST, LatestNotUpdated, commit, failure_of, sweep_leftovers
from .integrity import CheckpointError, agree

# Optimizer options that say how a run computes, not what: each run keeps its own on load.
IMPLEMENTATION_KEYS = {"fused", "foreach", "capturable", "differentiable"}


# ---- where each rank's elements are -------------------------------------------------------------
def slices(flat: FlatParam, lo: int, hi: int):
    """(canonical name, start within the whole parameter, [a, b) within the padded buffer, the dim
    laid first) of every parameter's elements that fall in [lo, hi). Under tp the buffer holds a
    shard, which begins at spec.start of the whole parameter (flattened with spec.dim first)."""
    for slot, spec in zip(flat.layout.slots, flat.specs):
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            base, dim = (spec.start, spec.dim) if spec is not None and spec.sharded else (0, 0)
            yield slot.names[0], base + a - slot.offset, a, b, dim


def whole_shapes(flats: list[FlatParam]) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """name -> (the whole parameter's shape, all its names): the shard's, without tp."""
    return {slot.names[0]: (tuple(spec.global_shape) if spec is not None else tuple(slot.shape), slot.names)
            for f in flats for slot, spec in zip(f.layout.slots, f.specs)}


# ---- save -----------------------------------------------------------------------------------------
def check_tag(tag: object) -> str:
    """A tag names one directory inside save_dir, beside the `latest` pointer and the hidden
    `.TAG.tmp` of a save in progress: anything else is refused before a byte is written."""
    if not isinstance(tag, str):  # as load_checkpoint's
        raise TypeError(f"checkpoint tag must be a string, got {type(tag).__name__}: e.g. f'step{{n}}'")
    if not tag or tag == LATEST or tag.startswith(".") or tag.endswith(".old") or "/" in tag or "\\" in tag:
        raise ValueError(f"checkpoint tag {tag!r} cannot name a checkpoint: a tag is one directory name, "
                         f"not '{LATEST}' (the pointer to the newest), not starting with '.' or ending in "
                         f"'.old', without '/'; e.g. 'step100' or 'epoch1-step100'")
    return tag


def save(directory: str, tag: str, flats: list[FlatParam], optimizer: torch.optim.Optimizer, comm: Comm,
         buffers: dict[str, torch.Tensor], extra: dict[str, Any], writes_shards: bool = True) -> str:
    """Collective. Returns the path of the committed checkpoint. `writes_shards` False: a MiCS
    replica beyond the first, whose shards the first copy's ranks write (it writes its RNG state)."""
    final, tmp = os.path.join(directory, tag), os.path.join(directory, f".{tag}.tmp")
    made = None
    if comm.rank == 0:
        try:
            os.makedirs(directory, exist_ok=True)
            sweep_leftovers(directory)
        except OSError as e:
            made = f"cannot save a checkpoint into '{directory}': {e}"
    agree(comm, made)  # every rank raises the error (none is left waiting for rank 0)
    writable = os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK)
    agree(comm, None if writable else f"rank {comm.rank} cannot write into '{directory}' (rank 0 "
                    f"made it): every rank must save into one directory that all of them can reach")
    state: dict[str, Any] = {f"rng/{comm.rank}": torch.get_rng_state()}
    if comm.device.type == "cuda":  # dropout on the GPU draws from the GPU's generator
        state[f"rng_cuda/{comm.rank}"] = torch.cuda.get_rng_state(comm.device)
    elementwise: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}
    for flat in flats if writes_shards else []:
        owned = slice(*flat.range)  # each rank writes only its own shard, at every stage
        values = flat.owned_values().detach()
        values = values[owned] if values.numel() == flat.layout.padded_numel else values
        opt_state = optimizer.state.get(flat.opt_param, {}) if flat.trainable else {}
        for name, start, a, b, _ in slices(flat, *flat.range):
            piece = slice(a - flat.range[0], b - flat.range[0])
            state[f"param/{name}/{start}"] = _stored(values[piece])
            for key, value in opt_state.items():
                if _is_elementwise(value, flat):
                    v = value[owned] if value.numel() == flat.layout.padded_numel else value
                    state[f"optim.{key}/{name}/{start}"] = _stored(v[piece])
                    elementwise.add(key)
        for key, value in opt_state.items():
            if not _is_elementwise(value, flat):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    raise CheckpointError(f"optimizer state '{key}' is neither elementwise nor a scalar; "
                                          f"it cannot be saved shard by shard")
                if isinstance(value, torch.Tensor):  # on the CPU: loadable without a GPU (a load
                    value = value.detach().cpu()      # puts it where the loading optimizer keeps it)
                scalars.setdefault(flat.group, {})[key] = value
    pieces = comm.all_gather_objects(sorted(k for k in state if k.startswith("param/")))
    if comm.rank == 0:
        state["meta"] = pickle.dumps(_meta(flats, optimizer, buffers, extra, elementwise, scalars, pieces))
        state.update({f"buffer/{name}": b.detach().cpu() for name, b in buffers.items()})
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=comm.group)
    except CheckpointException as e:  # raised on every rank: DCP gathers the writers' errors
        failed = failure_of(e)
    else:
        failed = integrity.commit_manifest(tmp, comm)  # every rank is done writing once this returns
    unpointed = None
    if comm.rank == 0 and failed is None:
        try:
            commit(directory, tmp, final, tag)
        except LatestNotUpdated as e:
            unpointed = e.strerror
        except OSError as e:
            failed = f"rank 0: {e}"
    failed, unpointed = first_error(comm, failed), first_error(comm, unpointed)  # rank 0's, on all
    if unpointed:
        raise CheckpointError(f"checkpoint '{tag}' saved, complete, at '{final}', but '{LATEST}' could not "
                              f"be moved to it ({unpointed}): it still names the checkpoint before. Load "
                              f"this one by its tag (load_checkpoint('{directory}', tag='{tag}')); free "
                              f"space in '{directory}' and the next save moves '{LATEST}'")
    if failed:
        if comm.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        comm.barrier()  # every rank raises once they are gone
        raise CheckpointError(f"checkpoint '{tag}' not saved ({failed}). Its partial files were removed; "
                              f"'{LATEST}' and the checkpoints in '{directory}' are untouched, and the "
                              f"engine can train on: free space in '{directory}' (or save elsewhere) and "
                              f"save again")
    return final


def _stored(piece: torch.Tensor) -> torch.Tensor:
    """A piece as saved: an fp32 CPU copy, or, where it rests in a file (disk offload), the piece
    itself, which DCP then streams from its file rather than from a copy of the whole state."""
    piece = piece.float().cpu()
    return piece if on_disk(piece) else piece.clone()


def _is_elementwise(value: Any, flat: FlatParam) -> bool:
    """Optimizer state with one value per element (momentum, variance) rather than a 0-d scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == flat.master.shape


def _meta(flats, optimizer, buffers, extra, elementwise, scalars, pieces) -> dict[str, Any]:
    lengths: dict[str, set[int]] = {}
    for keys in pieces:  # a replicated parameter's pieces come from every tp rank: once each
        for key in keys:
            _, name, start = key.rsplit("/", 2)
            lengths.setdefault(name, set()).add(int(start))
    dims = {slot.names[0]: spec.dim for f in flats for slot, spec in zip(f.layout.slots, f.specs)
            if spec is not None and spec.sharded and spec.dim != 0}
    trainable = sorted(slot.names[0] for f in flats if f.trainable for slot in f.layout.slots)
    return {"format": checkpoint_meta.FORMAT, "shapes": whole_shapes(flats),
            "starts": {name: sorted(found) for name, found in lengths.items()}, "dims": dims,
            "elementwise": sorted(elementwise), "trainable": trainable, "scalars": scalars,
            "buffers": list(buffers),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "group_members": checkpoint_meta.group_members(flats, len(optimizer.param_groups)),
            "optimizer": type(optimizer).__name__, "extra": extra}
