"""Sharded checkpoints on torch.distributed.checkpoint (DCP) that load at any world size and stage.

Layout-free format: every rank writes only the elements it owns, as *pieces* of each parameter
(flattened, fp32, keyed "param/<name>/<start>") and of each elementwise optimizer state
("optim.<key>/<name>/<start>"). Nothing in the files depends on N, padding or the stage, so on load
each rank reads exactly the pieces that overlap what it now holds. Small state (shapes, scalar
optimizer state, counters, scaler, scheduler, config, the user's client_state) is one pickled blob
written by rank 0; RNG states are per rank.

Atomic: DCP writes into "<dir>/.<tag>.tmp"; only when every rank is done does rank 0 rename it to
"<dir>/<tag>" and then replace "<dir>/latest". A crash at any point leaves `latest` naming the
previous complete checkpoint.
"""
from __future__ import annotations

import math
import os
import pickle
import shutil
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from .comm import Comm
from .flat_param import FlatParam

LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, or from another model; nothing was modified."""


# ---- where each rank's elements are -------------------------------------------------------------
def _slices(flat: FlatParam, lo: int, hi: int):
    """(canonical name, start within the parameter, [a, b) within the padded buffer) of every
    parameter's elements that fall in [lo, hi)."""
    for slot in flat.layout.slots:
        a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
        if a < b:
            yield slot.names[0], a - slot.offset, a, b


# ---- save -----------------------------------------------------------------------------------------
def save(directory: str, tag: str, flats: list[FlatParam], optimizer: torch.optim.Optimizer, comm: Comm,
         buffers: dict[str, torch.Tensor], extra: dict[str, Any]) -> str:
    """Collective. Returns the path of the committed checkpoint."""
    final, tmp = os.path.join(directory, tag), os.path.join(directory, f".{tag}.tmp")
    if comm.rank == 0:
        os.makedirs(directory, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # the leftovers of an interrupted save
    comm.barrier()
    state: dict[str, Any] = {f"rng/{comm.rank}": torch.get_rng_state()}
    if comm.device.type == "cuda":  # dropout on the GPU draws from the GPU's generator
        state[f"rng_cuda/{comm.rank}"] = torch.cuda.get_rng_state(comm.device)
    elementwise: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}
    on_device: dict[int, list[str]] = {}  # scalars kept beside the parameters (fused/capturable Adam)
    for flat in flats:
        owned = slice(*flat.range)  # each rank writes only its own shard, at every stage
        values = flat.owned_values().detach()
        values = values[owned] if values.numel() == flat.layout.padded_numel else values
        opt_state = optimizer.state.get(flat.opt_param, {}) if flat.trainable else {}
        for name, start, a, b in _slices(flat, *flat.range):
            piece = slice(a - flat.range[0], b - flat.range[0])
            state[f"param/{name}/{start}"] = values[piece].float().cpu().clone()
            for key, value in opt_state.items():
                if _is_elementwise(value, flat):
                    v = value[owned] if value.numel() == flat.layout.padded_numel else value
                    state[f"optim.{key}/{name}/{start}"] = v[piece].float().cpu().clone()
                    elementwise.add(key)
        for key, value in opt_state.items():
            if not _is_elementwise(value, flat):
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    raise CheckpointError(f"optimizer state '{key}' is neither elementwise nor a scalar; "
                                          f"it cannot be saved shard by shard")
                if isinstance(value, torch.Tensor):  # saved on the CPU: loadable without a GPU
                    if value.device.type != "cpu":
                        on_device.setdefault(flat.group, []).append(key)
                    value = value.detach().cpu()
                scalars.setdefault(flat.group, {})[key] = value
    pieces = comm.all_gather_objects(sorted(k for k in state if k.startswith("param/")))
    if comm.rank == 0:
        state["meta"] = pickle.dumps(_meta(flats, optimizer, buffers, extra, elementwise, scalars, on_device,
                                           pieces))
        state.update({f"buffer/{name}": b.detach().cpu() for name, b in buffers.items()})
    dcp.save(state, checkpoint_id=tmp, process_group=comm.group)
    comm.barrier()
    if comm.rank == 0:
        _commit(directory, tmp, final, tag)
    comm.barrier()
    return final


def _is_elementwise(value: Any, flat: FlatParam) -> bool:
    """Optimizer state with one value per element (momentum, variance) rather than a 0-d scalar."""
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == flat.master.shape


def _meta(flats, optimizer, buffers, extra, elementwise, scalars, on_device, pieces) -> dict[str, Any]:
    lengths: dict[str, list[tuple[int, int]]] = {}
    shapes = {slot.names[0]: (slot.shape, slot.names) for f in flats for slot in f.layout.slots}
    for keys in pieces:
        for key in keys:
            _, name, start = key.rsplit("/", 2)
            lengths.setdefault(name, []).append(int(start))
    trainable = sorted(slot.names[0] for f in flats if f.trainable for slot in f.layout.slots)
    return {"format": 1, "shapes": shapes, "starts": lengths, "elementwise": sorted(elementwise),
            "trainable": trainable,
            "scalars": scalars, "scalars_on_device": on_device, "buffers": list(buffers),
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups],
            "extra": extra}


def _commit(directory: str, tmp: str, final: str, tag: str) -> None:
    old = final + ".old"
    if os.path.exists(final):  # replace an existing tag without a moment where neither exists
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    pointer = os.path.join(directory, f".{LATEST}.tmp")
    with open(pointer, "w") as f:
        f.write(tag)
    os.replace(pointer, os.path.join(directory, LATEST))


# ---- load -----------------------------------------------------------------------------------------
def resolve(path: str, missing_ok: bool = False) -> str | None:
    """A checkpoint directory, or a parent holding `latest`. With missing_ok, a path that does not
    exist or an empty directory (nothing saved yet) gives None instead of an error."""
    if missing_ok and (not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))):
        return None
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint path '{path}' does not exist")
    if os.path.isfile(os.path.join(path, LATEST)):
        with open(os.path.join(path, LATEST)) as f:
            tag = f.read().strip()
        path = os.path.join(path, tag)
        if not os.path.isdir(path):
            raise CheckpointError(f"'{LATEST}' names '{tag}', which does not exist in "
                                  f"{os.path.dirname(path)}")
    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no .metadata): an interrupted "
                              f"save, or not a zeroshard checkpoint directory")
    return path


def info(path: str, missing_ok: bool = False) -> dict[str, Any] | None:
    """What a checkpoint holds besides tensors, read without a process group: its path, tag,
    global_steps, world_size, stage, config and client_state. None if missing (with missing_ok)."""
    resolved = resolve(path, missing_ok)
    if resolved is None:
        return None
    extra = read_meta(resolved, no_dist=True)["extra"]
    return {"path": resolved, "tag": os.path.basename(resolved), **extra}


def read_meta(path: str, process_group=None, no_dist: bool = False) -> dict[str, Any]:
    blob: dict[str, Any] = {"meta": b""}
    try:
        dcp.load(blob, checkpoint_id=path, process_group=process_group, no_dist=no_dist)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        # corrupt files surface here, before anything is modified
        raise CheckpointError(f"cannot read checkpoint '{path}': {_describe(e)}") from None
    return pickle.loads(blob["meta"])


def _describe(error: BaseException) -> str:
    failures = getattr(error, "failures", None)  # DCP: {rank: exception or (exception, traceback)}
    if not failures:
        return f"{type(error).__name__}: {error}"
    rank, first = next(iter(sorted(failures.items(), key=lambda item: item[0])))
    first = first[0] if isinstance(first, tuple) else first
    hint = " (a truncated or corrupt file?)" if isinstance(first, (EOFError, pickle.UnpicklingError)) else ""
    return f"rank {rank} failed with {type(first).__name__}: {first}{hint}; {len(failures)} rank(s) failed"


def check_compatible(meta: dict[str, Any], flats: list[FlatParam], optimizer: torch.optim.Optimizer) -> None:
    ours = {slot.names[0]: tuple(slot.shape) for f in flats for slot in f.layout.slots}
    theirs = {name: tuple(shape) for name, (shape, _) in meta["shapes"].items()}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        raise CheckpointError(f"checkpoint is from another model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}")
    wrong = [(n, theirs[n], s) for n, s in ours.items() if theirs[n] != s]
    if wrong:
        name, saved, now = wrong[0]
        raise CheckpointError(f"checkpoint is from another model: '{name}' has shape {saved} there, "
                              f"{now} here ({len(wrong)} shapes differ)")
    trainable = {slot.names[0] for f in flats if f.trainable for slot in f.layout.slots}
    if "trainable" in meta and trainable != set(meta["trainable"]):
        changed = sorted(trainable ^ set(meta["trainable"]))
        raise CheckpointError(f"parameters frozen at save time are trainable now, or the reverse: "
                              f"{changed[:5]}; their optimizer state cannot match. Freeze the same "
                              f"parameters as when saving, or start from the weights alone "
                              f"(zeroshard.consolidate)")
    if len(meta["param_groups"]) != len(optimizer.param_groups):
        raise CheckpointError(f"checkpoint has {len(meta['param_groups'])} parameter groups, the "
                              f"optimizer has {len(optimizer.param_groups)}")


def load(path: str, flats: list[FlatParam], optimizer: torch.optim.Optimizer, comm: Comm,
         buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Collective. Fills parameters, optimizer state and buffers; returns the `extra` saved."""
    path = resolve(path)
    meta = read_meta(path, comm.group)
    check_compatible(meta, flats, optimizer)
    request: dict[str, Any] = {f"buffer/{n}": torch.empty_like(b, device="cpu") for n, b in buffers.items()}
    saved_keys = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    if f"rng/{comm.rank}" in saved_keys:
        request[f"rng/{comm.rank}"] = torch.empty_like(torch.get_rng_state())
    if f"rng_cuda/{comm.rank}" in saved_keys and comm.device.type == "cuda":
        request[f"rng_cuda/{comm.rank}"] = torch.empty_like(torch.cuda.get_rng_state(comm.device))
    wanted = []  # (flat, name, piece start, piece length, [a, b) in the buffer)
    for flat in flats:
        lo, hi = flat.owned_range()
        for name, start, a, b in _slices(flat, lo, hi):
            for piece, length in _overlapping(meta, name, start, b - a):
                wanted.append((flat, name, piece, length, a - start + piece))
                keys = ["param"] + ([f"optim.{k}" for k in meta["elementwise"]] if flat.trainable else [])
                for key in keys:
                    request[f"{key}/{name}/{piece}"] = torch.empty(length)
    try:  # reads into fresh tensors: a failure here leaves the engine untouched
        dcp.load(request, checkpoint_id=path, process_group=comm.group)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot read checkpoint '{path}': {_describe(e)}") from None
    _apply(meta, request, wanted, flats, optimizer)
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(request[f"buffer/{name}"])
    if f"rng/{comm.rank}" in request:
        torch.set_rng_state(request[f"rng/{comm.rank}"])
    if f"rng_cuda/{comm.rank}" in request:
        torch.cuda.set_rng_state(request[f"rng_cuda/{comm.rank}"], comm.device)
    return meta["extra"]


def _overlapping(meta: dict[str, Any], name: str, start: int, length: int):
    """Saved pieces of `name` overlapping [start, start + length): (piece start, piece length)."""
    starts = sorted(meta["starts"][name])
    ends = starts[1:] + [math.prod(meta["shapes"][name][0])]
    for s, e in zip(starts, ends):
        if s < start + length and e > start:
            yield s, e - s


def _apply(meta, request, wanted, flats, optimizer) -> None:
    for flat in flats:
        if flat.trainable:
            optimizer.state[flat.opt_param] = {k: torch.zeros_like(flat.master) for k in meta["elementwise"]}
            on_device = meta.get("scalars_on_device", {}).get(flat.group, [])  # absent: saved on CPU
            for key, value in meta["scalars"].get(flat.group, {}).items():
                copy = value.clone() if isinstance(value, torch.Tensor) else value
                if key in on_device:  # where the optimizer keeps it (fused Adam: beside the params)
                    copy = copy.to(flat.master.device)
                optimizer.state[flat.opt_param][key] = copy
            if not optimizer.state[flat.opt_param]:
                del optimizer.state[flat.opt_param]
    with torch.no_grad():
        for flat, name, piece, length, offset in wanted:
            lo, hi = flat.owned_range()
            a, b = max(lo, offset), min(hi, offset + length)  # in the buffer
            src = slice(a - offset, b - offset)
            dst = slice(a - lo, b - lo)
            flat.owned_values()[dst].copy_(request[f"param/{name}/{piece}"][src])
            for key in (meta["elementwise"] if flat.trainable else []):
                optimizer.state[flat.opt_param][key][dst].copy_(request[f"optim.{key}/{name}/{piece}"][src])
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        # Hyperparameters come from the checkpoint; how this run computes them (a fused CPU kernel
        # over offloaded shards, or not) stays this run's.
        group.update({k: v for k, v in saved.items() if k not in _IMPLEMENTATION_KEYS})


_IMPLEMENTATION_KEYS = {"fused", "foreach", "capturable", "differentiable"}


# ---- offline ------------------------------------------------------------------------------------
def consolidate(path: str) -> dict[str, torch.Tensor]:
    """Full fp32 weights under the model's own names (every alias of a tied weight), and the
    persistent buffers, in the model's state_dict order. No process group needed."""
    path = resolve(path)
    meta = read_meta(path, no_dist=True)
    request: dict[str, Any] = {f"buffer/{n}": None for n in meta["buffers"]}
    md = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    for key in request:
        request[key] = torch.empty(md[key].size, dtype=md[key].properties.dtype)
    for name, starts in meta["starts"].items():
        for key in starts:
            request[f"param/{name}/{key}"] = torch.empty(md[f"param/{name}/{key}"].size)
    dcp.load(request, checkpoint_id=path, no_dist=True)
    values: dict[str, torch.Tensor] = {}
    for name, (shape, aliases) in meta["shapes"].items():
        pieces = [request[f"param/{name}/{s}"] for s in sorted(meta["starts"].get(name, []))]
        flat = torch.cat(pieces) if pieces else torch.zeros(0)  # a zero-element parameter has none
        for alias in aliases:
            values[alias] = flat.view(shape).clone()
    values.update({n: request[f"buffer/{n}"] for n in meta["buffers"]})
    order = meta["extra"].get("state_dict_keys", list(values))
    return {k: values[k] for k in order if k in values}
