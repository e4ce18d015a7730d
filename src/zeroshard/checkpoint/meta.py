"""What a checkpoint says it holds, checked before anything is read from it.

Invariants:
- The metadata (the pickled `meta` dict save.py writes) is checked for structure
  (`check_meta`), against this model (`check_compatible`) and against DCP's index of stored tensors
  (`check_stored`) before any state is touched: a load that passes all three cannot fail halfway on
  what the checkpoint says. Every rank reads identical bytes, so every rank reaches the same verdict.
- Only CheckpointError leaves this module: a damaged pickle or a wrong type is named, never raised
  as whatever exception the bad value happens to cause (the metadata fuzz in test_fuzz holds this).
"""
from __future__ import annotations

import math
import pickle
from typing import Any, Iterable

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from .integrity import METADATA, CheckpointError

FORMAT = 1  # of the `meta` dict
_REQUIRED = ("format", "shapes", "starts", "elementwise", "scalars", "buffers", "param_groups", "extra")
_SCALER = ("scale", "tolerance", "clean_steps", "skipped_steps")
_EXTRA = ("global_steps", "scaler", "lr_scheduler", "client_state")  # what engine.load_checkpoint reads
_WEIGHTS_ALONE = "load the weights alone: engine.load_checkpoint(path, load_optimizer_states=False)"


def _need(ok: bool, what: str) -> None:
    if not ok:
        raise CheckpointError(f"the checkpoint's metadata is invalid: {what}")


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not a tensor (whose comparisons are not booleans)


def _is_number(x: Any) -> bool:
    """A finite real scalar: an int, a float or a 0-d tensor (as optimizers keep `step`)."""
    if isinstance(x, torch.Tensor):
        return x.dim() == 0 and not x.is_complex() and bool(torch.isfinite(x))
    return type(x) is int or type(x) is float and math.isfinite(x)


def _strings(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(s, str) for s in x)


def numel(meta: dict[str, Any], name: str) -> int:
    return math.prod(meta["shapes"][name][0])


def check_meta(meta: Any) -> None:
    """What load, info and consolidate rely on in `meta` (see checkpoint._meta for its making)."""
    _need(isinstance(meta, dict), f"a {type(meta).__name__}, not a dict")
    _need(all(k in meta for k in _REQUIRED), f"missing {[k for k in _REQUIRED if k not in meta]}")
    _need(_is_int(meta["format"]) and meta["format"] == FORMAT,
          f"format {meta['format']!r}, where this version reads format {FORMAT}")
    _check_shapes(meta)
    _need(_strings(meta["elementwise"]), f"elementwise keys {meta['elementwise']!r}")
    _need(_strings(meta.get("trainable", [])) and set(meta.get("trainable", [])) <= set(meta["shapes"]),
          "trainable names that are not parameters")
    _check_scalars(meta)
    _need(_strings(meta["buffers"]), f"buffers {meta['buffers']!r}")
    groups = meta["param_groups"]
    _need(isinstance(groups, list) and all(isinstance(g, dict) and _strings(list(g)) and "params" not in g
                                           for g in groups), "param_groups are not a list of dicts")
    members = meta.get("group_members", [])  # (absent: saved before it was)
    _need(isinstance(members, list) and all(_strings(m) for m in members), "group_members")
    _need(isinstance(meta.get("optimizer", ""), str), f"optimizer {meta.get('optimizer')!r}")
    _check_extra(meta["extra"])


def _check_shapes(meta: dict[str, Any]) -> None:
    shapes, starts = meta["shapes"], meta["starts"]
    _need(isinstance(shapes, dict) and isinstance(starts, dict), "shapes or starts are not dicts")
    for name, entry in shapes.items():
        _need(isinstance(name, str) and isinstance(entry, (tuple, list)) and len(entry) == 2,
              f"shapes[{name!r}] is {entry!r}")
        shape, aliases = entry
        _need(isinstance(shape, (tuple, list)) and all(_is_int(d) and d >= 0 for d in shape),
              f"'{name}' has shape {shape!r}")
        _need(_strings(aliases) and len(aliases) > 0, f"'{name}' has aliases {aliases!r}")
    for name, found in starts.items():
        _need(name in shapes, f"pieces of '{name}', which is not a parameter")
        _need(isinstance(found, (list, tuple)) and all(_is_int(s) for s in found), f"starts of '{name}'")
        total, ordered = numel(meta, name), sorted(found)
        tiles = ordered == [] if total == 0 else ordered != [] and ordered[0] == 0 and ordered[-1] < total
        _need(len(set(ordered)) == len(ordered) and tiles,
              f"the pieces of '{name}' (starts {ordered[:5]}) do not tile its {total} elements")
    missing = [n for n in shapes if n not in starts and numel(meta, n) > 0]
    _need(not missing, f"no pieces of {missing[:5]}")


def _check_scalars(meta: dict[str, Any]) -> None:
    scalars = meta["scalars"]
    _need(isinstance(scalars, dict), "scalars are not a dict")
    for group, state in scalars.items():
        _need(_is_int(group) and isinstance(state, dict), f"scalars of group {group!r}")
        for key, value in state.items():
            _need(isinstance(key, str) and key not in meta["elementwise"] and _is_number(value),
                  f"scalar optimizer state {key!r} = {value!r} of group {group}")


def _check_extra(extra: Any) -> None:
    _need(isinstance(extra, dict), f"extra is {extra!r}")
    steps, scaler = extra.get("global_steps"), extra.get("scaler")
    _need(_is_int(steps) and steps >= 0, f"global_steps {steps!r}")
    _need(isinstance(scaler, dict) and all(_is_number(scaler.get(k)) for k in _SCALER),
          f"loss scaler state {scaler!r}")
    _need(all(k in extra for k in _EXTRA), f"extra lacks {[k for k in _EXTRA if k not in extra]}")
    _need(isinstance(extra["lr_scheduler"], (dict, type(None))), "lr_scheduler state")
    _need(_strings(extra.get("state_dict_keys", [])), "state_dict_keys")


def group_members(flats: list, groups: int) -> list[list[str]]:
    """The names of the parameters in each of the optimizer's `groups` parameter groups."""
    return [sorted(slot.names[0] for f in flats if f.group == g for slot in f.layout.slots)
            for g in range(groups)]


def check_compatible(meta: dict[str, Any], ours: dict[str, tuple[int, ...]], trainable: set[str],
                     optimizer: torch.optim.Optimizer | None, implementation_keys: Iterable[str],
                     members: list[list[str]] | None = None) -> None:
    """The checkpoint (its meta checked) is of this model: the same parameters and shapes; and,
    when its optimizer state is to be loaded (`optimizer` given), the same optimizer class, the
    same parameters trainable, the same parameter groups (`members`: their parameters' names), and
    hyperparameters of the same kind."""
    theirs = {name: tuple(shape) for name, (shape, _) in meta["shapes"].items()}
    missing, extra = sorted(set(ours) - set(theirs)), sorted(set(theirs) - set(ours))
    if missing or extra:
        tied = set(meta.get("extra", {}).get("state_dict_keys", [])) - set(theirs)  # saved as aliases
        hint = (f"; the checkpoint's model tied {sorted(tied & set(missing))[:5]} to another parameter "
                f"(shared weights, e.g. tie_word_embeddings) and this one does not: tie them as it did"
                if tied & set(missing) else "")
        raise CheckpointError(f"checkpoint is from another model: missing {missing[:5]}, "
                              f"unexpected {extra[:5]}{hint}")
    wrong = [(n, theirs[n], s) for n, s in ours.items() if theirs[n] != s]
    if wrong:
        name, saved, now = wrong[0]
        raise CheckpointError(f"checkpoint is from another model: '{name}' has shape {saved} there, "
                              f"{now} here ({len(wrong)} shapes differ)")
    if optimizer is None:
        return
    saved_class, our_class = meta.get("optimizer"), type(optimizer).__name__  # absent: saved before it was
    if saved_class is not None and saved_class != our_class:
        raise CheckpointError(f"the checkpoint holds {saved_class}'s state, but this engine's optimizer is "
                              f"{our_class}: that state would be misread or ignored. Resume with "
                              f"{saved_class}, or {_WEIGHTS_ALONE}")
    if "trainable" in meta and trainable != set(meta["trainable"]):
        changed = sorted(trainable ^ set(meta["trainable"]))
        raise CheckpointError(f"parameters frozen at save time are trainable now, or the reverse: "
                              f"{changed[:5]}; their optimizer state cannot match. Freeze the same "
                              f"parameters as when saving, or {_WEIGHTS_ALONE}")
    groups = optimizer.param_groups
    if len(meta["param_groups"]) != len(groups):
        raise CheckpointError(f"checkpoint has {len(meta['param_groups'])} parameter groups, the "
                              f"optimizer has {len(groups)}; use as many, or {_WEIGHTS_ALONE}")
    for i, (theirs, mine) in enumerate(zip(meta.get("group_members") or [], members or [])):
        if sorted(theirs) != mine:
            moved = sorted(set(theirs) ^ set(mine))
            raise CheckpointError(f"param_groups[{i}] holds other parameters than at save time ({moved[:5]} "
                                  f"moved between groups): the saved group's hyperparameters and state would "
                                  f"apply to them. Group the parameters as when saving, or {_WEIGHTS_ALONE}")
    _check_groups(meta["param_groups"], groups, set(implementation_keys) | {"params"})


def _check_groups(saved: list[dict[str, Any]], ours: list[dict[str, Any]], skip: set[str]) -> None:
    """A saved hyperparameter replaces ours only if it is of the same kind (a number for a number,
    a flag for a flag, a tuple of as many numbers): a damaged lr would otherwise fail the next step."""
    for i, (theirs, mine) in enumerate(zip(saved, ours)):
        for key in sorted(set(theirs) & set(mine) - skip):
            _need(_kind(theirs[key]) == _kind(mine[key]) or theirs[key] is None or mine[key] is None,
                  f"param_groups[{i}]['{key}'] is {theirs[key]!r} there, {mine[key]!r} here")


def _kind(x: Any) -> Any:
    if isinstance(x, (bool, str)):
        return type(x)
    if isinstance(x, (tuple, list)):
        return tuple(_kind(v) for v in x)
    return "number" if _is_number(x) else "other"


def describe(error: BaseException) -> str:
    """One line for a failed DCP read: the first failing rank's exception."""
    failures = getattr(error, "failures", None)  # DCP: {rank: exception or (exception, traceback)}
    if not failures:
        return f"{type(error).__name__}: {error}"
    rank, first = next(iter(sorted(failures.items(), key=lambda item: item[0])))
    first = first[0] if isinstance(first, tuple) else first
    hint = " (a truncated or corrupt file?)" if isinstance(first, (EOFError, pickle.UnpicklingError)) else ""
    return f"rank {rank} failed with {type(first).__name__}: {first}{hint}; {len(failures)} rank(s) failed"


def read_index(path: str) -> dict[str, Any]:
    """DCP's index of what is stored ({key: storage metadata}), read after the files are verified."""
    from torch.distributed.checkpoint import FileSystemReader
    try:
        index = FileSystemReader(path).read_metadata().state_dict_metadata
    except Exception as e:  # a damaged pickle raises anything
        raise CheckpointError(f"cannot read '{METADATA}' of '{path}': {type(e).__name__}: {e}") from None
    _need(isinstance(index, dict), f"'{METADATA}' holds no index of stored tensors")
    return index


def stored_size(index: dict[str, Any], key: str) -> tuple[int, ...] | None:
    md = index.get(key)
    if isinstance(md, TensorStorageMetadata) and isinstance(md.size, torch.Size):
        return tuple(md.size)
    return None


def check_buffers(meta: dict[str, Any], index: dict[str, Any], ours: dict[str, tuple[int, ...]]) -> None:
    """The checkpoint holds this model's buffers (those state_dict() holds), no other, each of its
    shape: a buffer added or removed since the save is named, not met as damaged metadata."""
    missing, extra = sorted(set(ours) - set(meta["buffers"])), sorted(set(meta["buffers"]) - set(ours))
    if missing or extra:
        raise CheckpointError(f"checkpoint is from another model: buffers missing {missing[:5]}, unexpected "
                              f"{extra[:5]}; load it into the model it was saved from")
    for name, shape in ours.items():
        saved = stored_size(index, f"buffer/{name}")
        if saved is not None and tuple(saved) != tuple(shape):
            raise CheckpointError(f"checkpoint is from another model: buffer '{name}' has shape "
                                  f"{tuple(saved)} there, {tuple(shape)} here")


def check_stored(meta: dict[str, Any], index: dict[str, Any], optimized: set[str],
                 tensors: dict[str, tuple[int, ...]]) -> None:
    """Every piece `meta` names is stored, 1-d, as long as its starts imply: the parameter's, and
    for `optimized` names each elementwise state's; and each of `tensors` with its shape."""
    for name, found in meta["starts"].items():
        ordered = sorted(found)
        keys = ["param"] + ([f"optim.{k}" for k in meta["elementwise"]] if name in optimized else [])
        for start, end in zip(ordered, ordered[1:] + [numel(meta, name)]):
            for key in keys:
                _check_size(index, f"{key}/{name}/{start}", (end - start,))
    for key, shape in tensors.items():
        _check_size(index, key, tuple(shape))


def _check_size(index: dict[str, Any], key: str, shape: tuple[int, ...]) -> None:
    size = stored_size(index, key)
    _need(size == shape, f"'{key}' should have shape {shape}; " + ("none is stored" if size is None
                                                                   else f"the stored one has {size}"))


def empty_stored(index: dict[str, Any], key: str) -> torch.Tensor:
    """An empty tensor to read the stored tensor `key` into, as stored (shape and dtype)."""
    size, md = stored_size(index, key), index.get(key)
    _need(size is not None and isinstance(md.properties.dtype, torch.dtype), f"'{key}' is not stored")
    return torch.empty(size, dtype=md.properties.dtype)
