"""Deferred tensors: what a model built under zeroshard.init() is made of (see construct/__init__.py).

A DeferredTensor is a meta tensor (a shape, no data) that reports the device it stands for, so init
code cannot tell it apart: torch.nn.init skips tensors whose `is_meta` is true; ours is false, and
in-place metadata ops or `.data =` work on it as on any tensor. Every op on one runs on meta for its
result's shape and goes to the Recording that made it (recording.py), which can replay it for real.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Protocol

import torch
from torch.utils._pytree import tree_flatten

aten = torch.ops.aten


class Recorder(Protocol):
    """What a deferred tensor needs of the Recording that made it (recording.py implements it; the
    tensor knows only this interface, so the two modules do not import each other)."""

    def run(self, func: Any, args: tuple, kwargs: dict, default_device: torch.device | None) -> Any: ...

    def materialize(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]: ...


class _State(threading.local):
    in_meta_kernel = False  # running an op on DeferredTensors' meta selves
    replaying = False       # materializing: every op is a real one, whatever init() is active


tls = _State()  # per thread

OWN_ATTRIBUTES = ("recording", "deferred_device")  # a DeferredTensor's own; any other is the user's


class DeferredValueError(RuntimeError):
    """Something needs a deferred tensor's data where it can not be materialized."""


@dataclass(frozen=True)
class Ref:
    """Where a recorded tensor lives: its storage (by identity) and its view of that storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def ref_of(t: "DeferredTensor") -> Ref:
    return Ref(storage_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype,
               t.deferred_device)


def as_meta(x: Any) -> Any:
    """A real tensor's stand-in for computing result shapes on meta."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DeferredTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def mutated_args(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments `func` writes to (in-place `self`, `out=`), from its schema."""
    found = []
    for i, info in enumerate(func._schema.arguments):
        if info.alias_info is not None and info.alias_info.is_write:
            value = args[i] if i < len(args) and not info.kwarg_only else kwargs.get(info.name)
            found.extend(x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
    return found


def default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class DeferredTensor(torch.Tensor):
    """A meta tensor that reports `deferred_device`; every op on it is recorded (see module doc)."""

    recording: Recorder
    deferred_device: torch.device

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device, recording: Recorder) -> "DeferredTensor":
        with meta_kernels():
            t = torch.Tensor._make_subclass(cls, meta, meta.requires_grad, dispatch_device=True,
                                            device_for_backend_keys=device)
        t.recording, t.deferred_device = recording, device
        return t

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("meta") if tls.in_meta_kernel else self.deferred_device

    def __deepcopy__(self, memo: dict) -> "DeferredTensor":
        """A recorded clone (nn.TransformerEncoder deep-copies its layer), attributes included."""
        if id(self) not in memo:
            with torch.no_grad():
                copy = self.clone()
            copy.requires_grad_(self.requires_grad)
            copy.__dict__.update({k: v for k, v in self.__dict__.items() if k not in OWN_ATTRIBUTES})
            memo[id(self)] = copy
        return memo[id(self)]

    def tolist(self) -> Any:  # these read values without dispatching an op: materialize first
        return self.recording.materialize([self])[0].tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.recording.materialize([self])[0].numpy(force=force)

    def __repr__(self) -> str:
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.deferred_device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            return torch.device("meta") if tls.in_meta_kernel else args[0].deferred_device
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(a, torch.Tensor) and not isinstance(a, DeferredTensor) for a in flat):
            raise DeferredValueError(
                f"{func} mixes a deferred tensor with a real one outside zeroshard.init(): a model "
                f"built under zeroshard.init() has no data until zeroshard.initialize() (or "
                f"zeroshard.materialize(model)) gives it some")
        return recording_of(flat).run(func, args, kwargs or {}, default_device=None)


@contextmanager
def meta_kernels() -> Iterator[None]:
    """Run ops on DeferredTensors' meta selves: no Python dispatch, meta kernels selected."""
    previous = tls.in_meta_kernel
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        torch._C._set_meta_in_tls_dispatch_include(True)
        tls.in_meta_kernel = True
        try:
            yield
        finally:
            tls.in_meta_kernel = previous


def recording_of(flat: list[Any]) -> Recorder:
    """The recording an op on deferred tensors belongs to: theirs, not whichever init() is active."""
    recordings = {id(a.recording): a.recording for a in flat if isinstance(a, DeferredTensor)}
    if len(recordings) > 1:
        raise DeferredValueError("an op combines tensors built in two different zeroshard.init() "
                                 "blocks; build them in one block (or materialize one first)")
    return next(iter(recordings.values()))


def same_size_resize(func, args: tuple) -> bool:
    if func.overloadpacket is aten.resize_:
        return tuple(args[1]) == tuple(args[0].shape)
    return func.overloadpacket is aten.resize_as_ and args[1].shape == args[0].shape
