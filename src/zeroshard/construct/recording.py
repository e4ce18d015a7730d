"""The Recording: the ops that built a model's deferred tensors, and their replay.

Recording. Each op on a DeferredTensor runs on meta for its result's shape and is appended here. A
random op also runs once on a real scratch tensor of the same layout, which advances the generator
exactly as the ordinary construction would, and the generator state from before it is saved.

Replay. materialize() replays only the recorded ops the requested tensors depend on: a backward
slice over storages (an op is needed if it writes a needed storage; then what it reads is needed
too). Random ops are re-run from their saved generator state: the same op on the same layout from
the same state gives the same bits, whatever the world size. Views are not replayed: every recorded
tensor is rebuilt from (storage, offset, size, stride) of the storage it views.
An op that reads a value (`.item()`, `bool(t)`) materializes its inputs and runs for real.
"""
from __future__ import annotations

import mmap
from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

from .tensor import (DeferredTensor, DeferredValueError, as_meta, default_generator, storage_key,
                     meta_kernels,
                       mutated_args, recording_of, Ref, ref_of, same_size_resize, tls, aten)

# Ops that overwrite every element of `self` with random numbers: their scratch run needs only a
# tensor of the right layout, not the old values.
_OVERWRITING_RANDOM = {"uniform_", "normal_", "random_", "exponential_", "cauchy_", "log_normal_",
                       "geometric_", "bernoulli_"}
_READS_VALUES = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default,
                 aten.allclose.default}
_UNSUPPORTED = {aten.set_, aten.resize_, aten.resize_as_}  # change which memory a tensor uses
# A meta tensor has no initializer to replay: it is built to be filled by loading (from_pretrained
# builds on meta, then loads the checkpoint into it), which a deferred tensor cannot take.
_META_REFUSED = ("{func} asks for a tensor on the meta device under zeroshard.init() (a torch.device("
                 "'meta') context, accelerate's init_empty_weights, or transformers' from_pretrained, which "
                 "builds on meta and then loads the checkpoint). zeroshard.init() defers a model's own "
                 "initialization and cannot load pretrained weights: build this model without "
                 "zeroshard.init() (e.g. from_pretrained), then zeroshard.initialize() shards it")


@dataclass
class _Op:
    func: Any
    args: Any
    kwargs: dict
    reads: frozenset[int]
    writes: frozenset[int]
    creates: list[tuple[Ref, int]]   # (output ref, position in the flattened outputs)
    rng: tuple[torch.Generator, torch.Tensor] | None  # generator and its state before the op
    default_dtype: torch.dtype  # factories and scalar type promotion depend on it


class Recording(TorchDispatchMode):
    """The ops that built a model's deferred tensors, in order; see the module docstring."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.ops: list[_Op] = []
        self._alive: list[torch.UntypedStorage] = []  # keeps storage identities from being reused
        self._scratch_memory: mmap.mmap | None = None  # (see scratch())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.prim.device.default or tls.replaying:
            return func(*args, **kwargs)  # replaying (tolist() inside init()): real ops
        flat = tree_flatten((args, kwargs))[0]
        if any(isinstance(a, DeferredTensor) for a in flat):
            return recording_of(flat).run(func, args, kwargs, default_device=None)
        if any(isinstance(a, torch.Tensor) for a in flat):
            return func(*args, **kwargs)  # real tensors only: an ordinary op
        return self.run(func, args, kwargs, default_device=self.device)  # a factory: defer it

    def nbytes(self) -> int:
        """Memory the recording itself holds: generator states and constants."""
        tensors = [op.rng[1] for op in self.ops if op.rng] + [
            x for op in self.ops for x in tree_flatten((op.args, op.kwargs))[0]
            if isinstance(x, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)

    # ---- recording ------------------------------------------------------------------------------
    def run(self, func, args: tuple, kwargs: dict, default_device: torch.device | None) -> Any:
        """Record one op and return its deferred result."""
        if func.overloadpacket in _UNSUPPORTED and not _aliases_deferred(func, args):
            if same_size_resize(func, args):
                return args[0]  # out= ops resize their output first, to the size it has
            raise DeferredValueError(f"{func} changes which memory a tensor uses; it is not supported "
                                     f"under zeroshard.init() (build the model without it)")
        if func in _READS_VALUES or torch.Tag.dynamic_output_shape in func.tags:
            # The answer (or the result's shape) depends on values: compute it for real.
            return func(*self._materialized(args), **self._materialized(kwargs))
        device = kwargs.get("device") or default_device
        if device is not None:  # a factory: its output stands for a tensor on `device`
            device = torch.device(device)
            if device.type == "meta":
                raise DeferredValueError(_META_REFUSED.format(func=func))
        else:
            device = next(a.deferred_device for a in tree_flatten((args, kwargs))[0]
                          if isinstance(a, DeferredTensor))
        rng = self._advance_generator(func, args, kwargs, device) if self._is_random(func) else None
        meta_args, meta_kwargs = tree_map(as_meta, (args, kwargs))
        if "device" in kwargs or default_device is not None:
            meta_kwargs["device"] = torch.device("meta")
        try:
            with meta_kernels():
                out = func(*meta_args, **meta_kwargs)
        except NotImplementedError:  # no meta kernel (e.g. geqrf): never let init code swallow it
            out = self._shapes_the_hard_way(func, args, kwargs)
        return self._record(func, args, kwargs, out, rng, device)

    def _shapes_the_hard_way(self, func, args: tuple, kwargs: dict) -> Any:
        """Result layouts of an op that has no meta kernel, from running it for real on its
        materialized inputs (with the generator put back: it was advanced once already)."""
        if mutated_args(func, args, kwargs):
            raise DeferredValueError(f"{func} has no meta kernel and writes in place; it can not be "
                                     f"recorded under zeroshard.init() (build the model without it)")
        generator = default_generator(next(a.deferred_device for a in tree_flatten(args)[0]
                                           if isinstance(a, DeferredTensor)))
        saved = generator.get_state()
        try:
            out = func(*self._materialized(args), **self._materialized(kwargs))
        finally:
            generator.set_state(saved)
        return tree_map(as_meta, out)

    def _record(self, func, args, kwargs, out, rng, device: torch.device) -> Any:
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, DeferredTensor)]
        reads = {storage_key(a) for a in inputs}
        writes = {storage_key(a) for a in mutated_args(func, args, kwargs) if isinstance(a, DeferredTensor)}
        outs, spec = tree_flatten(out)
        creates, wrapped = [], []
        for i, o in enumerate(outs):
            if isinstance(o, torch.Tensor) and not isinstance(o, DeferredTensor):
                o = DeferredTensor(o, device, self)
            if isinstance(o, DeferredTensor):
                if storage_key(o) not in reads:  # a new storage: made by this op
                    self._alive.append(o.untyped_storage())
                    creates.append((ref_of(o), i))
                    writes.add(storage_key(o))
            wrapped.append(o)
        template = lambda x: ref_of(x) if isinstance(x, DeferredTensor) else (
            x.detach().clone() if isinstance(x, torch.Tensor) else x)
        if writes:  # pure views and metadata queries need no replay
            self.ops.append(_Op(func, tree_map(template, args), tree_map(template, kwargs),
                                frozenset(reads), frozenset(writes), creates, rng, torch.get_default_dtype()))
        return spec.unflatten(wrapped)

    @staticmethod
    def _is_random(func) -> bool:
        return torch.Tag.nondeterministic_seeded in func.tags

    def _advance_generator(self, func, args, kwargs,
                           device: torch.device) -> tuple[torch.Generator, torch.Tensor]:
        """Run a random op once on real tensors of the same layout, as the ordinary construction
        would have; return the generator and its state from before."""
        generator = kwargs.get("generator") or default_generator(device)
        state = generator.get_state()
        overwritten = args[0] if func.overloadpacket.__name__ in _OVERWRITING_RANDOM else None
        scratch = lambda a: self.scratch(a.shape, a.stride(), a.dtype, a.deferred_device) \
            if a is overwritten else self.materialize([a])[0]
        real = lambda x: scratch(x) if isinstance(x, DeferredTensor) else x
        factory = not any(isinstance(a, torch.Tensor) for a in tree_flatten((args, kwargs))[0])
        with torch.no_grad():
            into_scratch = factory and device.type == "cpu"
            if not (into_scratch and self._factory_into_scratch(func, args, kwargs, device)):
                real_kwargs = {k: (device if k == "device" else real(v)) for k, v in kwargs.items()}
                if factory:
                    real_kwargs["device"] = device
                func(*tree_map(real, args), **real_kwargs)
        return generator, state

    def _factory_into_scratch(self, func, args: tuple, kwargs: dict, device: torch.device) -> bool:
        """A random factory (torch.randn(...)) run as its out= form into the scratch: the same
        kernel on the same layout, so the generator advances alike, and no allocation of its own.
        False, having run nothing, where it has no out= form or its layout is not found on meta."""
        out_form = _out_overload(func)
        if out_form is None:
            return False
        try:
            with meta_kernels():
                layout = func(*args, **{**kwargs, "device": torch.device("meta")})
        except (RuntimeError, TypeError, NotImplementedError):
            return False
        if not isinstance(layout, torch.Tensor):
            return False
        out = self.scratch(layout.shape, layout.stride(), layout.dtype, device)
        out_form(*args, **{k: v for k, v in kwargs.items() if k not in _FACTORY_ONLY}, out=out)
        return True

    def scratch(self, shape: torch.Size, stride: tuple[int, ...], dtype: torch.dtype,
                device: torch.device) -> torch.Tensor:
        """A real tensor of this layout, for a random op to overwrite (its values are never read).
        On a CPU it lies in one anonymous mapping, reused by every random op of the recording and
        unmapped by release_scratch() (init()'s end): from malloc, each freed scratch stayed in
        glibc's heap, pinned by the generator state saved just before it, and a construction left
        about the model's size resident as holes; a mapping per op would fault its pages in afresh."""
        span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
        nbytes = span * dtype.itemsize
        if device.type != "cpu" or nbytes == 0:
            return torch.empty_strided(shape, stride, dtype=dtype, device=device)
        if self._scratch_memory is None or len(self._scratch_memory) < nbytes:
            self._scratch_memory = mmap.mmap(-1, nbytes)  # the smaller one is unmapped once unused
        flat = torch.frombuffer(self._scratch_memory, dtype=torch.uint8, count=nbytes)
        return flat.view(dtype).as_strided(shape, stride)

    def release_scratch(self) -> None:
        """Unmap the random ops' scratch (once the last tensor over it is gone)."""
        self._scratch_memory = None

    # ---- replay ---------------------------------------------------------------------------------
    def _materialized(self, tree: Any) -> Any:
        return tree_map(lambda x: self.materialize([x])[0] if isinstance(x, DeferredTensor) else x, tree)

    def materialize(self, tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
        """Real tensors (no autograd history) with the recorded values of `tensors`. Only the ops
        they depend on are replayed; real tensors pass through unchanged."""
        tensors = list(tensors)
        needed = {storage_key(t) for t in tensors if isinstance(t, DeferredTensor)}
        if not needed:
            return tensors
        plan = []
        for op in reversed(self.ops):  # backward slice: the ops that produce the needed storages
            if op.writes & needed:
                plan.append(op)
                needed |= op.reads
        storages: dict[int, torch.UntypedStorage] = {}
        replaying, default_dtype = tls.replaying, torch.get_default_dtype()
        tls.replaying = True
        try:
            with torch.no_grad():
                for op in reversed(plan):
                    torch.set_default_dtype(op.default_dtype)
                    self._replay(op, storages)
                return [_view(storages, ref_of(t)) if isinstance(t, DeferredTensor) else t for t in tensors]
        finally:
            tls.replaying = replaying
            torch.set_default_dtype(default_dtype)

    def _replay(self, op: _Op, storages: dict[int, torch.UntypedStorage]) -> None:
        real = lambda x: _view(storages, x) if isinstance(x, Ref) else x
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
            if (result.dtype, tuple(result.shape)) != (ref.dtype, ref.size):  # never silently reinterpret
                raise DeferredValueError(f"replaying {op.func} gave {result.dtype} {tuple(result.shape)}, "
                                         f"recorded {ref.dtype} {ref.size}; please report this model")
            if (tuple(result.stride()), result.storage_offset()) != (ref.stride, ref.offset):
                fixed = torch.empty_strided(ref.size, ref.stride, dtype=ref.dtype, device=ref.device)
                result = fixed.copy_(result)  # rare: the real kernel chose another layout than meta's
            storages[ref.key] = result.untyped_storage()


_FACTORY_ONLY = ("dtype", "layout", "device", "pin_memory", "requires_grad", "memory_format")


def _out_overload(func) -> Any:
    """A factory overload's out= form (randn.default: randn.out, randn.generator:
    randn.generator_out), or None."""
    name = func._overloadname
    return getattr(func.overloadpacket, "out" if name == "default" else f"{name}_out", None)


def _aliases_deferred(func, args: tuple) -> bool:
    """`t.set_(other)` with a deferred `other` (torch.nn.utils.parametrize does it): `t` becomes a
    view of other's storage on meta too, and every later record refers to that storage."""
    return func is aten.set_.source_Tensor and isinstance(args[1], DeferredTensor)


def _view(storages: dict[int, torch.UntypedStorage], ref: Ref) -> torch.Tensor:
    t = torch.empty(0, dtype=ref.dtype, device=ref.device)
    return t.set_(storages[ref.key], ref.offset, ref.size, ref.stride)
