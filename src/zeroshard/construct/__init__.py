"""Partitioned construction, the user's side: build under init(), and let initialize() (or
materialize()) give the model its values. The mechanism is in tensor.py and recording.py.

    with zeroshard.init():
        model = GPT(config)                       # nothing allocated
    engine = zeroshard.initialize(model, ...)     # each unit materialized, sharded, then freed

At stage 3 a rank never holds more than its shards plus one unit's full parameters; the values are
bit-identical to `GPT(config)` built normally from the same seed, at any world size.

May import: nothing of zeroshard (core's units.py materializes through it).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager, nullcontext
from typing import Iterable, Iterator

import torch
from torch import nn

from .recording import Recording
from .tensor import OWN_ATTRIBUTES, DeferredTensor


@contextmanager
def init(device: torch.device | str | None = None) -> Iterator[Recording]:
    """Tensors made inside this context are deferred: they have shapes but no memory until
    initialize() (or materialize()). `device`: where they would have been made (default: torch's
    default device); its random generator advances exactly as in an ordinary construction."""
    # Factories receive torch's default device explicitly; a torch.device context changes it.
    where = torch.device(device) if device is not None else nullcontext()
    with where:
        recording = Recording(torch.get_default_device())
        try:
            with recording:
                yield recording
        finally:
            recording.release_scratch()


def is_deferred(t: object) -> bool:
    """A tensor built under zeroshard.init() and not materialized yet; a module holding any such
    parameter or buffer."""
    if isinstance(t, nn.Module):
        return any(isinstance(x, DeferredTensor) for x in (*t.parameters(), *t.buffers()))
    return isinstance(t, DeferredTensor)


def materialize_(tensors: Iterable[torch.Tensor], module: nn.Module | None = None) -> dict[int, torch.Tensor]:
    """Give deferred tensors their recorded values. Each keeps its identity (its contents are
    swapped), so modules, optimizers and parameter groups holding it still do; a tensor that is
    weakly referenced (nn.RNN does this) can not be swapped, and is replaced in `module` instead.
    Returns those replacements, {id(old): new}."""
    by_recording: dict[int, list[DeferredTensor]] = {}
    for t in dict.fromkeys(t for t in tensors if isinstance(t, DeferredTensor)):
        by_recording.setdefault(id(t.recording), []).append(t)
    replaced: dict[int, torch.Tensor] = {}
    for deferred in by_recording.values():
        values = deferred[0].recording.materialize(deferred)
        for t, value in zip(deferred, values):
            if isinstance(t, nn.Parameter):
                value = nn.Parameter(value, requires_grad=t.requires_grad)
            # Attributes set on the tensor (e.g. `p._no_weight_decay = True`) stay with it.
            mine = OWN_ATTRIBUTES + ("_is_param",)  # `value` is already a Parameter where needed
            value.__dict__.update({k: v for k, v in t.__dict__.items() if k not in mine})
            try:
                if weakref.getweakrefs(t):
                    raise RuntimeError("weakly referenced")
                torch.utils.swap_tensors(t, value)
            except RuntimeError:  # weakly referenced (nn.RNN), or saved for backward during init
                if module is None:
                    raise
                _replace(module, t, value)
                replaced[id(t)] = value
    return replaced


def _replace(module: nn.Module, old: torch.Tensor, new: torch.Tensor) -> None:
    """Point every attribute of every submodule that holds `old` at `new` (ties included)."""
    for m in module.modules():
        names = [k for k, v in {**m._parameters, **m._buffers, **vars(m)}.items() if v is old]
        for name in names:
            if name in m._buffers:
                m._buffers[name] = new
            else:
                setattr(m, name, new)  # goes through the module's __setattr__ (nn.RNN tracks it)


def deferred_non_parameters(module: nn.Module) -> list[torch.Tensor]:
    """Deferred buffers, and deferred tensors kept as plain module attributes (also inside a
    list, tuple or dict attribute)."""
    found = [b for b in module.buffers() if is_deferred(b)]
    for m in module.modules():
        for name, value in vars(m).items():
            if name in ("_parameters", "_buffers", "_modules"):
                continue
            items = value.values() if isinstance(value, dict) else \
                value if isinstance(value, (list, tuple)) else [value]
            found += [v for v in items if is_deferred(v) and not isinstance(v, nn.Parameter)]
    return found


def materialize(module: nn.Module) -> nn.Module:
    """Materialize a whole model built under init() (all of it at once: for use without an
    engine, e.g. a single-process reference). Returns the module."""
    materialize_(deferred_non_parameters(module), module)  # first, as initialize() does: a
    materialize_(list(module.parameters()), module)        # buffer may hold a parameter's autograd graph
    return module
