"""Partitioned construction: build a model without allocating it, then materialize it piece by
piece with the values an ordinary construction would have given, bit for bit.

    with zeroshard.init():
        model = GPT(config)          # no parameter memory is allocated
    engine = zeroshard.initialize(model, ...)   # stage 3: each rank holds its shards + one unit

Design. Under init(), tensor factories make DeferredTensors: meta tensors (shape, no data) that
report the device they stand for, so init code cannot tell them apart (torch.nn.init skips tensors
whose `is_meta` is true; ours is false). Every op on a DeferredTensor, inside init() or after, runs
on meta for its result's shape and is appended to the model's Recording. A random op also runs
once on a real scratch tensor of the same layout, which advances the generator exactly as the
ordinary construction would, and the generator state from before it is saved.

materialize() replays only the recorded ops the requested tensors depend on: a backward slice over
storages (an op is needed if it writes a needed storage; then what it reads is needed too).
Random ops are re-run from their saved generator state: the same op on the same layout from the
same state gives the same bits, whatever the world size. Views are not replayed: every recorded
tensor is rebuilt from (storage, offset, size, stride) of the storage it views.
An op that reads a value (`.item()`, `bool(t)`) materializes its inputs and runs for real.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

aten = torch.ops.aten

# Ops that overwrite every element of `self` with random numbers: their scratch run needs only a
# tensor of the right layout, not the old values.
_OVERWRITING_RANDOM = {"uniform_", "normal_", "random_", "exponential_", "cauchy_", "log_normal_",
                       "geometric_", "bernoulli_"}
_READS_VALUES = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}
_UNSUPPORTED = {aten.set_, aten.resize_, aten.resize_as_}  # change which memory a tensor uses

_in_meta_kernel = threading.local()


class DeferredValueError(RuntimeError):
    """Something needs a deferred tensor's data where it can not be materialized."""


@dataclass(frozen=True)
class _Ref:
    """Where a recorded tensor lives: its storage (by identity) and its view of that storage."""

    key: int
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype
    device: torch.device


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: dict
    reads: frozenset[int]
    writes: frozenset[int]
    creates: list[tuple[_Ref, int]]   # (output ref, position in the flattened outputs)
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state before the op


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _ref(t: "DeferredTensor") -> _Ref:
    return _Ref(_key(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, t.deferred_device)


def _as_meta(x: Any) -> Any:
    """A real tensor's stand-in for computing result shapes on meta."""
    if isinstance(x, torch.Tensor) and not isinstance(x, DeferredTensor):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta")
    return x


def _mutated(func, args: tuple, kwargs: dict) -> list[Any]:
    """The arguments `func` writes to (in-place `self`, `out=`), from its schema."""
    found = []
    for i, info in enumerate(func._schema.arguments):
        if info.alias_info is not None and info.alias_info.is_write:
            value = args[i] if i < len(args) and not info.kwarg_only else kwargs.get(info.name)
            found.extend(x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor))
    return found


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cpu":
        return torch.default_generator
    module = torch.get_device_module(device.type)
    return module.default_generators[device.index if device.index is not None else module.current_device()]


class DeferredTensor(torch.Tensor):
    """A meta tensor that reports `deferred_device`; every op on it is recorded (see module doc)."""

    recording: "Recording"
    deferred_device: torch.device

    @staticmethod
    def __new__(cls, meta: torch.Tensor, device: torch.device, recording: "Recording") -> "DeferredTensor":
        with _meta_kernels():
            t = torch.Tensor._make_subclass(cls, meta, meta.requires_grad, dispatch_device=True,
                                            device_for_backend_keys=device)
        t.recording, t.deferred_device = recording, device
        return t

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("meta") if getattr(_in_meta_kernel, "on", False) else self.deferred_device

    def tolist(self) -> Any:  # these read values without dispatching an op: materialize first
        return self.recording.materialize([self])[0].tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return self.recording.materialize([self])[0].numpy(force=force)

    def __repr__(self) -> str:
        return f"DeferredTensor(shape={tuple(self.shape)}, dtype={self.dtype}, device={self.deferred_device})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.prim.device.default:
            return torch.device("meta") if getattr(_in_meta_kernel, "on", False) else args[0].deferred_device
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(a, torch.Tensor) and not isinstance(a, DeferredTensor) for a in flat):
            raise DeferredValueError(
                f"{func} mixes a deferred tensor with a real one outside zeroshard.init(): a model "
                f"built under zeroshard.init() has no data until zeroshard.initialize() (or "
                f"zeroshard.materialize(model)) gives it some")
        recording = next(a.recording for a in flat if isinstance(a, DeferredTensor))
        return recording.run(func, args, kwargs or {}, default_device=None)


@contextmanager
def _meta_kernels() -> Iterator[None]:
    """Run ops on DeferredTensors' meta selves: no Python dispatch, meta kernels selected."""
    previous = getattr(_in_meta_kernel, "on", False)
    with torch._C._DisableTorchDispatch(), torch._C._PreserveDispatchKeyGuard():
        torch._C._set_meta_in_tls_dispatch_include(True)
        _in_meta_kernel.on = True
        try:
            yield
        finally:
            _in_meta_kernel.on = previous


class Recording(TorchDispatchMode):
    """The ops that built a model's deferred tensors, in order; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[_Op] = []
        self._alive: list[torch.UntypedStorage] = []  # keeps storage identities from being reused
        self._replaying = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default or self._replaying:
            return func(*args, **kwargs)  # replaying (tolist() inside init()): real ops
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(a, DeferredTensor) for a in flat):
            return self.run(func, args, kwargs, default_device=None)
        if any(isinstance(a, torch.Tensor) for a in flat):
            return func(*args, **kwargs)  # real tensors only: an ordinary op
        return self.run(func, args, kwargs, default_device=self.device)  # a factory: defer it

    def nbytes(self) -> int:
        """Memory the recording itself holds: generator states and constants."""
        tensors = [op.rng[1] for op in self.ops if op.rng] + [
            x for op in self.ops for x in tree_flatten((op.args, op.kwargs))[0] if isinstance(x, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- recording ------------------------------------------------------------------------------
    def run(self, func, args: tuple, kwargs: dict, default_device: torch.device | None) -> Any:
        """Record one op and return its deferred result."""
        if func.overloadpacket in _UNSUPPORTED:
            raise DeferredValueError(f"{func} changes which memory a tensor uses; it is not supported "
                                     f"under zeroshard.init() (build the model without it)")
        if func in _READS_VALUES:
            return func(*self._materialized(args), **self._materialized(kwargs))
        device = kwargs.get("device") or default_device
        if device is not None:  # a factory: its output stands for a tensor on `device`
            device = torch.device(device)
        else:
            device = next(a.deferred_device for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, DeferredTensor))
        rng = self._advance_generator(func, args, kwargs, device) if self._is_random(func) else None
        meta_args, meta_kwargs = tree_map(_as_meta, (args, kwargs))
        if "device" in kwargs or default_device is not None:
            meta_kwargs["device"] = torch.device("meta")
        with _meta_kernels():
            out = func(*meta_args, **meta_kwargs)
        return self._record(func, args, kwargs, out, rng, device)

    def _record(self, func, args, kwargs, out, rng, device: torch.device) -> Any:
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DeferredTensor)]
        reads = {_key(a) for a in inputs}
        writes = {_key(a) for a in _mutated(func, args, kwargs) if isinstance(a, DeferredTensor)}
        outs, spec = tree_flatten(out)
        creates, wrapped = [], []
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and not isinstance(o, DeferredTensor):
                o = DeferredTensor(o, device, self)
            if isinstance(o, DeferredTensor):
                self._alive.append(o.untyped_storage())
                if _key(o) not in reads:  # a new storage: made by this op
                    creates.append((_ref(o), i))
                    writes.add(_key(o))
            wrapped.append(o)
        template = lambda x: _ref(x) if isinstance(x, DeferredTensor) else (
            x.detach().clone() if isinstance(x, torch.Tensor) else x)
        if writes:  # pure views and metadata queries need no replay
            self.ops.append(_Op(func, tree_map(template, args), tree_map(template, kwargs),
                                frozenset(reads), frozenset(writes), creates, rng))
        return spec.unflatten(wrapped)

    @staticmethod
    def _is_random(func) -> bool:
        return torch.Tag.nondeterministic_seeded in func.tags

    def _advance_generator(self, func, args, kwargs, device: torch.device) -> tuple[torch.Generator, torch.Tensor]:
        """Run a random op once on real tensors of the same layout, as the ordinary construction
        would have; return the generator and its state from before."""
        generator = kwargs.get("generator") or _default_generator(device)
        state = generator.get_state()
        overwritten = args[0] if func.overloadpacket.__name__ in _OVERWRITING_RANDOM else None
        scratch = lambda a: (torch.empty_strided(a.shape, a.stride(), dtype=a.dtype, device=a.deferred_device)
                             if a is overwritten else self.materialize([a])[0])
        real = lambda x: scratch(x) if isinstance(x, DeferredTensor) else x
        real_kwargs = {k: (device if k == "device" else real(v)) for k, v in kwargs.items()}
        if "device" not in kwargs and not any(isinstance(a, torch.Tensor) for a in tree_flatten(args)[0]):
            real_kwargs["device"] = device
        with torch.no_grad():
            func(*tree_map(real, args), **real_kwargs)
        return generator, state

    # ---- replay ---------------------------------------------------------------------------------
    def _materialized(self, tree: Any) -> Any:
        return tree_map(lambda x: self.materialize([x])[0] if isinstance(x, DeferredTensor) else x, tree)

    def materialize(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Real tensors (no autograd history) with the recorded values of `tensors`. Only the ops
        they depend on are replayed; real tensors pass through unchanged."""
        tensors = list(tensors)
        needed = {_key(t) for t in tensors if isinstance(t, DeferredTensor)}
        if not needed:
            return tensors
        plan = []
        for op in reversed(self.ops):  # backward slice: the ops that produce the needed storages
            if op.writes & needed:
                plan.append(op)
                needed |= op.reads
        storages: dict[int, torch.UntypedStorage] = {}
        replaying, self._replaying = self._replaying, True
        try:
            with torch.no_grad():
                for op in reversed(plan):
                    self._replay(op, storages)
                return [_view(storages, _ref(t)) if isinstance(t, DeferredTensor) else t for t in tensors]
        finally:
            self._replaying = replaying

    def _replay(self, op: _Op, storages: dict[int, torch.UntypedStorage]) -> None:
        real = lambda x: _view(storages, x) if isinstance(x, _Ref) else x
        args, kwargs = tree_map(real, op.args), tree_map(real, op.kwargs)
        if op.rng is None:
            out = op.func(*args, **kwargs)
        else:
            generator, state = op.rng
            current = generator.get_state()
            generator.set_state(state)
            try:
                out = op.func(*args, **kwargs)
            finally:
                generator.set_state(current)
        outs = tree_flatten(out)[0]
        for ref, i in op.creates:
            result = outs[i]
            if (tuple(result.stride()), result.storage_offset()) != (ref.stride, ref.offset):
                fixed = torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype, device=ref.device)
                result = fixed.copy_(result)  # rare: the real kernel chose another layout than meta's
            storages[ref.key] = result.untyped_storage()


def _view(storages: dict[int, torch.UntypedStorage], ref: _Ref) -> torch.Tensor:
    t = torch.empty(0, dtype=ref.dtype, device=ref.device)
    return t.set_(storages[ref.key], ref.offset, ref.size, ref.stride)
