"""Loading a checkpoint (save.py writes it): each rank reads the saved pieces that overlap what
it holds now, whatever world size, stage or tp layout the checkpoint was written at.

Invariants:
- Every check comes before the first write: the files' sizes and checksums (integrity.py), the
  metadata against this model (meta.py), each rank's saved random state. Every rank
  passes, or every rank raises the same CheckpointError.
- States in memory: every piece is read by one DCP call into fresh tensors, then applied, so even a
  read that fails leaves the engine untouched.
- States on disk (disk offload): memory must not hold the rank's whole state, which is what disk
  offload is for. The pieces are read and applied one flat buffer at a time, each buffer's
  optimizer state created in its files (not in memory first) and its pages dropped before the next
  buffer is read. The price: a read failing after the checks (the files verified, then unreadable)
  leaves the engine partly loaded; the error says so, and the fix is to load again.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..comm.collectives import Comm
from ..core.flat_param import FlatParam
from ..offload.host import disk_store
from ..parallel.dtensor import canonical, from_canonical
from . import integrity, meta as checkpoint_meta
from .integrity import CheckpointError
from .read import read_meta, resolve_everywhere
from .save import IMPLEMENTATION_KEYS, slices, whole_shapes

Wanted = tuple[str, Any, int, int, int, int]  # (name, piece start or "whole", length, its offset, [a, b))


class _Plan:
    """What one flat buffer reads: DCP request tensors, where each piece goes, and the parameters
    laid out otherwise than saved (tp changed: read whole, then reordered)."""

    def __init__(self, flat: FlatParam, meta: dict[str, Any], with_state: bool) -> None:
        self.flat = flat
        self.with_state = with_state and flat.trainable  # read and write its optimizer state
        self.request: dict[str, torch.Tensor] = {}
        self.wanted: list[Wanted] = []
        self.reorder: dict[str, int] = {}  # name -> the dim this run lays first
        keys = ["param"] + ([f"optim.{k}" for k in meta["elementwise"]] if self.with_state else [])
        for name, start, a, b, dim in slices(flat, *flat.owned_range()):
            if dim != meta.get("dims", {}).get(name, 0):
                self.reorder[name] = dim
                whole = checkpoint_meta.numel(meta, name)
                self.wanted.append((name, "whole", whole, a - start, a, b))
                self._ask(keys, meta, name, 0, whole)
                continue
            for piece, length in self._ask(keys, meta, name, start, b - a):
                self.wanted.append((name, piece, length, a - start + piece, a, b))

    def _ask(self, keys: list[str], meta: dict[str, Any], name: str, start: int, length: int):
        pieces = list(_overlapping(meta, name, start, length))
        for key in keys:
            for piece, n in pieces:
                self.request[f"{key}/{name}/{piece}"] = torch.empty(n)
        return pieces


def load(path: str, flats: list[FlatParam], optimizer: torch.optim.Optimizer, comm: Comm,
         buffers: dict[str, torch.Tensor], optimizer_states: bool = True) -> dict[str, Any]:
    """Collective. Fills parameters, buffers and (with optimizer_states) the optimizer's state and
    hyperparameters; without, the optimizer starts afresh. Returns the `extra` saved."""
    path, parent = resolve_everywhere(path, comm)
    integrity.verify(path, comm, parent)
    meta = read_meta(path, comm.group)
    shapes = {name: shape for name, (shape, _) in whole_shapes(flats).items()}
    trainable = {slot.names[0] for f in flats if f.trainable for slot in f.layout.slots}
    checkpoint_meta.check_compatible(meta, shapes, trainable, optimizer if optimizer_states else None,
                                     IMPLEMENTATION_KEYS,
                                     checkpoint_meta.group_members(flats, len(optimizer.param_groups)))
    saved_keys = checkpoint_meta.read_index(path)
    checkpoint_meta.check_buffers(meta, saved_keys, {n: tuple(b.shape) for n, b in buffers.items()})
    stored_buffers = {f"buffer/{n}": b.shape for n, b in buffers.items()}
    checkpoint_meta.check_stored(meta, saved_keys, trainable if optimizer_states else set(), stored_buffers)
    small: dict[str, Any] = {f"buffer/{n}": torch.empty_like(b, device="cpu") for n, b in buffers.items()}
    if f"rng/{comm.rank}" in saved_keys:
        small[f"rng/{comm.rank}"] = torch.empty_like(torch.get_rng_state())
    if f"rng_cuda/{comm.rank}" in saved_keys and comm.device.type == "cuda":
        small[f"rng_cuda/{comm.rank}"] = torch.empty_like(torch.cuda.get_rng_state(comm.device))
    streamed = any(disk_store(f) is not None for f in flats)  # alike on every rank: the same config
    groups = [[f] for f in flats] if streamed else [flats]  # the same count on every rank
    plans = [_Plan(f, meta, optimizer_states) for f in groups[0]]
    _read(path, comm, small | _requests(plans))
    integrity.agree(comm, _invalid_rng(small, comm))  # the last check, before the first write
    for k, group in enumerate(groups):
        if k > 0:  # read only now: memory holds one flat buffer's pieces at a time
            plans = [_Plan(f, meta, optimizer_states) for f in group]
            try:
                _read(path, comm, _requests(plans))
            except CheckpointError as e:
                raise CheckpointError(f"{e}. The engine is partly loaded (disk offload loads one flat "
                                      f"buffer at a time): load a checkpoint again before training") from None
        for plan in plans:
            _apply(meta, plan, optimizer)
        plans = []
    for group, saved in zip(optimizer.param_groups, meta["param_groups"] if optimizer_states else []):
        # Hyperparameters come from the checkpoint; how this run computes them (a fused CPU kernel
        # over offloaded shards, or not) stays this run's.
        group.update({k: v for k, v in saved.items() if k not in IMPLEMENTATION_KEYS})
    with torch.no_grad():
        for name, b in buffers.items():
            b.copy_(small[f"buffer/{name}"])
    if f"rng/{comm.rank}" in small:
        torch.set_rng_state(small[f"rng/{comm.rank}"])
    if f"rng_cuda/{comm.rank}" in small:
        torch.cuda.set_rng_state(small[f"rng_cuda/{comm.rank}"], comm.device)
    return meta["extra"]


def _requests(plans: list[_Plan]) -> dict[str, torch.Tensor]:
    return {k: v for plan in plans for k, v in plan.request.items()}


def _read(path: str, comm: Comm, request: dict[str, Any]) -> None:
    """Reads into fresh tensors (one DCP call, collective)."""
    try:
        dcp.load(request, checkpoint_id=path, process_group=comm.group)
    except (Exception, CheckpointException) as e:  # DCP's exception is a BaseException
        raise CheckpointError(f"cannot read checkpoint '{path}': {checkpoint_meta.describe(e)}") from None


def _invalid_rng(request: dict[str, Any], comm: Comm) -> str | None:
    """Why this rank's saved random state would be refused by torch (tried on a scratch generator)."""
    try:
        if f"rng/{comm.rank}" in request:
            torch.Generator().set_state(request[f"rng/{comm.rank}"])
        if f"rng_cuda/{comm.rank}" in request:
            torch.Generator(device=comm.device).set_state(request[f"rng_cuda/{comm.rank}"])
    except RuntimeError as e:
        return f"rank {comm.rank}'s saved random state is invalid: {e}"
    return None


def _overlapping(meta: dict[str, Any], name: str, start: int, length: int):
    """Saved pieces of `name` overlapping [start, start + length): (piece start, piece length)."""
    starts = sorted(meta["starts"][name])
    ends = starts[1:] + [math.prod(meta["shapes"][name][0])]
    for s, e in zip(starts, ends):
        if s < start + length and e > start:
            yield s, e - s


def _reorder(meta: dict[str, Any], plan: _Plan) -> None:
    """Each parameter in plan.reorder, read whole in its saved order, becomes one piece "whole" in
    the order this run lays it out."""
    request = plan.request
    for name, dim in plan.reorder.items():
        shape, saved_dim = meta["shapes"][name][0], meta.get("dims", {}).get(name, 0)
        prefixes = {k.rsplit("/", 2)[0] for k in request if k.rsplit("/", 2)[1:2] == [name]}
        for prefix in prefixes:
            pieces = [request.pop(f"{prefix}/{name}/{s}") for s in sorted(meta["starts"][name])]
            whole = from_canonical(torch.cat(pieces), shape, saved_dim)
            request[f"{prefix}/{name}/whole"] = canonical(whole, dim)


def _fresh_state(meta: dict[str, Any], flat: FlatParam, optimizer: torch.optim.Optimizer) -> None:
    """The flat's optimizer state as saved: zeroed elementwise tensors (in their files when the
    master rests in one) and the saved scalars."""
    store = disk_store(flat)
    on_disk = store is not None and store.owns(flat.master)
    state: dict[str, Any] = {}
    for key in meta["elementwise"]:  # in its file (the one the step streams) when the master is in one
        state[key] = store.state_tensor(flat.master, key).zero_() if on_disk else \
            torch.zeros_like(flat.master)
    group = next((g for g in optimizer.param_groups if any(p is flat.opt_param for p in g["params"])), {})
    for key, value in meta["scalars"].get(flat.group, {}).items():
        state[key] = _placed(key, value.clone(), group, flat.master) if isinstance(value, torch.Tensor) \
            else value
    optimizer.state.pop(flat.opt_param, None)
    if state:
        optimizer.state[flat.opt_param] = state


def _placed(key: str, value: torch.Tensor, group: dict, master: torch.Tensor) -> torch.Tensor:
    """A scalar where the loading optimizer keeps it, whatever kept it at the save (another stage,
    offload or device): torch's own rule at load_state_dict. Adam's `step` beside the parameters in
    fp32 for a fused or capturable group (a fused kernel on the GPU reads it there; a host copy from
    a CPU or offloaded run would be read as a device pointer), else as saved, on the CPU; any other
    scalar tensor on the parameters' device, floating ones in their dtype."""
    if key == "step":
        fused = group.get("fused") or group.get("capturable")
        return value.to(master.device, torch.float32) if fused else value.cpu()
    return value.to(master.device, master.dtype if value.is_floating_point() else value.dtype)


def _apply(meta: dict[str, Any], plan: _Plan, optimizer: torch.optim.Optimizer) -> None:
    """Write one flat buffer's pieces into its values and optimizer state, then (disk offload)
    send the pages it wrote to disk and out of memory."""
    _reorder(meta, plan)
    flat, request = plan.flat, plan.request
    flat.before_master_changes()
    if plan.with_state:
        _fresh_state(meta, flat, optimizer)
    elif flat.trainable:
        optimizer.state.pop(flat.opt_param, None)  # starts afresh, as before its first step
    keys = meta["elementwise"] if plan.with_state else []
    lo, hi = flat.owned_range()
    with torch.no_grad():
        for name, piece, length, offset, first, end in plan.wanted:
            a, b = max(lo, offset, first), min(hi, offset + length, end)  # in the buffer
            src, dst = slice(a - offset, b - offset), slice(a - lo, b - lo)
            flat.owned_values()[dst].copy_(request[f"param/{name}/{piece}"][src])
            for key in keys:
                optimizer.state[flat.opt_param][key][dst].copy_(request[f"optim.{key}/{name}/{piece}"][src])
    store = disk_store(flat)
    if store is not None:
        state = optimizer.state.get(flat.opt_param, {}) if flat.trainable else {}
        store.drop_pages([flat.owned_values(), *state.values()])
        store.cache.clear()  # a frozen shard was written through its map, not write_shard()
