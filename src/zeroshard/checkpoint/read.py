"""Finding and reading checkpoints: `resolve` (a checkpoint directory, or a parent holding
`latest`; an interrupted commit's `TAG.old`), `info` (what it holds besides tensors, without a
process group), `read_meta` (the pickled metadata, checked) and `consolidate` (full fp32 weights
under the model's own names, offline). Every file is verified (sizes and checksums) before a tensor
is read: integrity.py and meta.py state the invariants.
"""
from __future__ import annotations

import os
import pickle
import warnings
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.collectives import Comm
from ..parallel.dtensor import from_canonical
from . import integrity, meta as checkpoint_meta
from .export import write_weights
from .commit import LATEST, recovered
from .integrity import CheckpointError, agree


def resolve(path: str, missing_ok: bool = False) -> str | None:
    """A checkpoint directory, or a parent holding `latest`. With missing_ok, a path that does not
    exist or an empty directory (nothing saved yet) gives None instead of an error."""
    return None if missing_ok and _nothing_saved(path) else _resolve(path)[0]


def _nothing_saved(path: str) -> bool:
    return not os.path.exists(path) or (os.path.isdir(path) and not os.listdir(path))


def _resolve(path: str) -> tuple[str, str | None]:
    """(the checkpoint directory, the parent whose `latest` named it, or None if named directly; a
    Trainer checkpoint-N folder stands for the `zeroshard` one inside). An error about a checkpoint
    found through `latest` offers the newest complete sibling."""
    if not os.path.exists(path):
        if (old := recovered(path)) is not None:
            return old, None
        there = integrity.committed(os.path.dirname(path.rstrip(os.sep)))
        raise CheckpointError(f"checkpoint path '{path}' does not exist" +
                              (f"; the checkpoints beside it: {', '.join(there)}" if there else ""))
    own = not any(os.path.exists(os.path.join(path, name)) for name in (LATEST, integrity.METADATA))
    # a Trainer checkpoint-N folder that ZeroTrainer wrote, or a `zeroshard train --out` folder
    for inner in (os.path.join(path, "zeroshard"), os.path.join(path, "checkpoints")):
        if own and os.path.isdir(inner):
            return _resolve(inner)
    parent = None
    if os.path.isfile(os.path.join(path, LATEST)):
        with open(os.path.join(path, LATEST)) as f:
            tag = f.read().strip()
        parent, path = path, os.path.join(path, tag)
        path = recovered(path) or path
        if not os.path.isdir(path):
            raise CheckpointError(f"'{LATEST}' names '{tag}', which does not exist in {parent}"
                                  + integrity.offer(parent, path))
    if parent is None and (held := integrity.committed(path)):  # a parent whose `latest` is gone
        raise CheckpointError(f"'{path}' holds checkpoints ({', '.join(held)}) but no '{LATEST}' file "
                              f"naming the one to load: load one by its path, or write its name into "
                              f"{os.path.join(path, LATEST)}")
    if parent is None and (steps := _trainer_checkpoints(path)):
        raise CheckpointError(f"'{path}' is a Trainer output_dir: give one of its checkpoints "
                              f"({', '.join(steps)}), e.g. the newest, {os.path.join(path, steps[-1])}")
    if not os.path.isfile(os.path.join(path, integrity.METADATA)):
        raise CheckpointError(f"'{path}' is not a complete checkpoint (no .metadata): an interrupted save, "
                              f"or not a zeroshard checkpoint directory" + integrity.offer(parent, path))
    return path, parent


def _trainer_checkpoints(path: str) -> list[str]:
    """The checkpoint-N folders ZeroTrainer wrote in `path` (an output_dir), by step."""
    if not os.path.isdir(path):
        return []
    found = [d for d in os.listdir(path) if d.startswith("checkpoint-") and d[11:].isdigit()
             and os.path.isdir(os.path.join(path, d, "zeroshard"))]
    return sorted(found, key=lambda d: int(d[11:]))


def resolve_everywhere(path: str, comm: Comm) -> tuple[str, str | None]:
    """_resolve on every rank, which must agree (a `latest` replaced meanwhile would split them)."""
    try:
        local: Any = _resolve(path)
    except CheckpointError as e:
        local = str(e)
    views = comm.all_gather_objects(local)
    agree(comm, next((v for v in views if isinstance(v, str)), None))
    if len(set(views)) > 1:
        raise CheckpointError(f"the ranks found different checkpoints at '{path}' ({sorted(set(views))}): "
                              f"was '{LATEST}' replaced while loading?")
    return views[0]


def info(path: str, missing_ok: bool = False) -> dict[str, Any] | None:
    """What a checkpoint holds besides tensors, read without a process group: its path, tag,
    global_steps, world_size, stage, config and client_state. None if missing (with missing_ok).
    Its files are verified first."""
    if missing_ok and _nothing_saved(path):
        return None
    resolved, parent = _resolve(path)
    integrity.verify(resolved, parent=parent)
    extra = read_meta(resolved, no_dist=True)["extra"]
    return {"path": resolved, "tag": os.path.basename(resolved), **extra}


def _dcp_load(state: dict[str, Any], path: str, process_group, no_dist: bool) -> None:
    """dcp.load; reading in this process alone is what no_dist asks for, so DCP's warning that
    it assumes so is not passed on to the user."""
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        dcp.load(state, checkpoint_id=path, process_group=process_group, no_dist=no_dist)


def read_meta(path: str, process_group=None, no_dist: bool = False) -> dict[str, Any]:
    """The `meta` dict, checked (meta.check_meta). Identical bytes on every rank, so every
    rank reaches the same verdict."""
    blob: dict[str, Any] = {"meta": b""}
    try:
        _dcp_load(blob, path, process_group, no_dist)
        meta = pickle.loads(blob["meta"])
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        # corrupt files surface here, before anything is modified
        raise CheckpointError(f"cannot read checkpoint '{path}': {checkpoint_meta.describe(e)}") from None
    checkpoint_meta.check_meta(meta)
    return meta


# ---- offline ------------------------------------------------------------------------------------
def consolidate(path: str, output: str | None = None) -> dict[str, torch.Tensor]:
    """Full fp32 weights under the model's own names (every alias of a tied weight), and the
    persistent buffers, in the model's state_dict order. No process group needed. With `output`,
    also written there: a safetensors file where the name ends in .safetensors, else torch.save."""
    path, parent = _resolve(path)
    integrity.verify(path, parent=parent)
    meta = read_meta(path, no_dist=True)
    md = checkpoint_meta.read_index(path)
    checkpoint_meta.check_stored(meta, md, set(), {})  # the parameters' pieces; buffers have any shape
    request: dict[str, Any] = {f"buffer/{n}": checkpoint_meta.empty_stored(md, f"buffer/{n}")
                               for n in meta["buffers"]}
    for name, starts in meta["starts"].items():
        for key in starts:
            request[f"param/{name}/{key}"] = torch.empty(md[f"param/{name}/{key}"].size)
    try:
        _dcp_load(request, path, None, no_dist=True)
    except (Exception, CheckpointException) as e:
        raise CheckpointError(f"cannot read checkpoint '{path}': {checkpoint_meta.describe(e)}") from None
    values: dict[str, torch.Tensor] = {}
    for name, (shape, aliases) in meta["shapes"].items():
        pieces = [request[f"param/{name}/{s}"] for s in sorted(meta["starts"].get(name, []))]
        flat = torch.cat(pieces) if pieces else torch.zeros(0)  # a zero-element parameter has none
        whole = from_canonical(flat, shape, meta.get("dims", {}).get(name, 0))
        for alias in aliases:
            values[alias] = whole.clone()
    for n in meta["buffers"]:  # floating ones in fp32, as engine.full_state_dict() gives them
        b = request[f"buffer/{n}"]
        values[n] = b.float() if b.is_floating_point() else b
    order = meta["extra"].get("state_dict_keys", list(values))
    weights = {k: values[k] for k in order if k in values}
    if output is not None:
        write_weights(weights, output)
    return weights
