"""ZeRO-R activation checkpoints: per-unit recomputation whose saved inputs are partitioned over the
tensor-parallel ranks (P_a), optionally kept on the host (P_a+cpu), in one buffer (MD).

A checkpointed unit runs forward without saving anything but its inputs, and runs again inside
backward to rebuild what its gradient needs. Under tensor parallelism a block's input is replicated
on every tp rank, so keeping it whole keeps TP copies of it: with partition_activations each rank
keeps 1/TP (flattened, padded to TP equal chunks) and the copies are all-gathered over tp right
before the recompute: the paper's one extra all-gather per block. With cpu_checkpointing the
chunk lives in host memory (pinned on CUDA) and is copied back one block ahead of the recompute.
With contiguous_memory_optimization the chunks of one forward are written end to end into one
buffer allocated once (and grown only if a forward needs more), instead of one allocation each
interleaved with short-lived tensors (fragmentation).

The checkpoint is reentrant (an autograd.Function whose backward runs a nested forward and
backward), like torch.utils.checkpoint(use_reentrant=True), but a block whose inputs need no
gradient still trains (`_anchor`); RNG state is restored for the recompute, so dropout draws the
same mask, and so is autocast (backward usually runs outside the
forward's `torch.autocast` region: the recompute would otherwise run in another precision). Kept
chunks are saved with save_for_backward, so torch.autograd.graph.saved_tensors_hooks sees exactly
what is kept.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import weakref
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..comm.collectives import Comm
from ..config.sections import ActivationConfig

logger = logging.getLogger("zeroshard")


class CheckpointStore:
    """Keeps checkpointed inputs (partitioned, on the host, in one buffer) and gives them back whole.

    Invariants: every tp rank keeps the same number of chunks of the same sizes in the same order,
    so the all-gathers pair up; a chunk is alive exactly while autograd holds it (saved for a
    backward that has not run), which is what held() counts and what the MD buffer reuses after."""

    def __init__(self, cfg: ActivationConfig, comm: Comm) -> None:
        self.cfg, self.comm, self.device = cfg, comm, comm.device
        self.parts = comm.tp_size if cfg.partition_activations else 1
        self.index = comm.tp_rank if self.parts > 1 else 0  # which of the `parts` chunks this rank keeps
        self.where = "host" if cfg.cpu_checkpointing else "device"
        self.peak = {"device": 0, "host": 0}
        self.gathers = {"calls": 0, "bytes": 0}  # the all-gathers before recomputes (paper convention)
        self._chunks: list[tuple[weakref.ref, int]] = []  # (kept chunk, bytes), oldest first
        # P_a+cpu on CUDA: chunks already on their way back, by id with the chunk's weakref (an id is
        # reused once its chunk dies), and the chunks restored so far (never fetched again)
        self._ahead: dict[int, tuple[weakref.ref, torch.Tensor]] = {}
        self._restored: list[weakref.ref] = []
        self._buffer: torch.Tensor | None = None  # MD: one allocation for a forward's chunks
        self._used = 0

    @torch.compiler.disable
    def held(self) -> dict[str, int]:
        """Bytes of kept chunks alive now, by place."""
        self._chunks = [(ref, n) for ref, n in self._chunks if ref() is not None]
        total = sum(n for _, n in self._chunks)
        return {"device": 0, "host": 0, self.where: total}

    @torch.compiler.disable
    def keep(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's part of `x` (all of it without partitioning), where it is to be kept."""
        flat = x.detach().reshape(-1)
        chunk = math.ceil(flat.numel() / self.parts)
        lo, hi = min(self.index * chunk, flat.numel()), min((self.index + 1) * chunk, flat.numel())
        out = self._allocate(chunk, x.dtype)
        piece = flat[lo:hi]
        if out.is_pinned() and hi - lo < chunk:
            # The padding goes by the stream too: a host write into a pinned MD buffer now could land
            # before a copy from its region, queued by the last backward's restore, has read it.
            piece = torch.cat([piece, piece.new_zeros(chunk - (hi - lo))])
        out[:piece.numel()].copy_(piece, non_blocking=out.is_pinned())
        out[piece.numel():].zero_()
        self._chunks.append((weakref.ref(out), out.numel() * out.element_size()))
        now = self.held()[self.where]
        self.peak[self.where] = max(self.peak[self.where], now)
        return out

    @torch.compiler.disable
    def restore(self, part: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The whole input again, on the compute device (collective over tp when partitioned)."""
        ref, local = self._ahead.pop(id(part), (None, None))
        if ref is None or ref() is not part:
            local = part.to(self.device, non_blocking=True)
        self._send_next_back(part)
        if self.parts == 1:
            return local[:math.prod(shape)].view(shape).clone()
        whole = torch.empty(local.numel() * self.parts, dtype=local.dtype, device=self.device)
        self.comm.all_gather_tp(whole, local)
        self.gathers["calls"] += 1
        self.gathers["bytes"] += whole.numel() * whole.element_size()
        return whole[:math.prod(shape)].view(shape)

    def _send_next_back(self, part: torch.Tensor) -> None:
        """P_a+cpu on CUDA: start copying the nearest chunk kept before `part` and not yet restored
        (the next recompute's: backward runs the blocks in reverse, a block's inputs in order) to
        the device, so it arrives while this block recomputes. The chunk just before may be this
        block's own first input, restored already: a copy of it would never be taken."""
        if not (part.is_pinned() and self.device.type == "cuda"):
            return
        self._restored = [r for r in self._restored if r() is not None] + [weakref.ref(part)]
        self._ahead = {k: v for k, v in self._ahead.items() if v[0]() is not None}  # (a failed backward's)
        done = {id(r()) for r in self._restored}
        alive = [ref() for ref, _ in self._chunks]
        at = next((i for i, c in enumerate(alive) if c is part), 0)
        before = next((c for c in reversed(alive[:at]) if c is not None and id(c) not in done), None)
        if before is not None and id(before) not in self._ahead:
            self._ahead[id(before)] = (weakref.ref(before), before.to(self.device, non_blocking=True))

    def _allocate(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        pin = self.where == "host" and self.device.type == "cuda"  # (a CPU run on a GPU machine: no)
        place = torch.device("cpu") if self.where == "host" else self.device
        if not self.cfg.contiguous_memory_optimization:
            return torch.empty(numel, dtype=dtype, device=place, pin_memory=pin)
        live = self.held()[self.where] > 0
        if not live:
            self._used = 0  # every chunk of the last forward is gone: write over them
        end = self._used + numel
        if self._buffer is None or self._buffer.dtype != dtype or end > self._buffer.numel():
            # Sized for number_checkpoints chunks at first, doubled when a forward needs more; live
            # chunks keep the old buffer until their backward, only new ones go to the new one.
            size = numel * (self.cfg.number_checkpoints or 1) if self._buffer is None else \
                2 * self._buffer.numel()
            self._buffer = torch.empty(max(size, numel), dtype=dtype, device=place, pin_memory=pin)
            self._used, end = 0, numel
        # Aliasing by set_, not a view: a view would share the buffer's version counter, and writing
        # the next chunk would look to autograd like a change to this one.
        out = torch.empty(0, dtype=dtype, device=place).set_(self._buffer.untyped_storage(), self._used,
                                                            (numel,))
        self._used = end
        return out

    def reset_peak(self) -> None:
        self.peak = {"device": 0, "host": 0, **{self.where: self.held()[self.where]}}


class _Checkpoint(torch.autograd.Function):
    """forward(run, store, box, anchor, *tensors): run without saving; backward: restore, rerun,
    backprop. `anchor` (an empty tensor that requires grad, or None) only ties the outputs to the
    graph (checkpoint_module says when)."""

    @staticmethod
    def forward(ctx: Any, run: Callable, store: CheckpointStore, box: dict, anchor: torch.Tensor | None,
                *tensors: torch.Tensor) -> Any:
        ctx.run, ctx.store = run, store
        ctx.rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(store.device) if store.device.type == "cuda" else None
        ctx.autocast = [(kind, torch.get_autocast_dtype(kind), torch.is_autocast_enabled(kind))
                        for kind in dict.fromkeys([store.device.type, "cpu"])]
        ctx.autocast_cache = torch.is_autocast_cache_enabled()
        with torch.no_grad():
            outputs = run(*tensors)
        # Inputs that carry gradient are the activations flowing through the blocks: those are
        # partitioned; others (masks, rotary tables) are shared by every block and kept as they are.
        ctx.split = [t.requires_grad and t.is_floating_point() for t in tensors]
        ctx.shapes = [t.shape for t in tensors]
        ctx.save_for_backward(*(store.keep(t) if s else t for t, s in zip(tensors, ctx.split)))
        leaves, box["spec"] = tree_flatten(outputs)
        box["leaves"] = leaves
        out = tuple(t for t in leaves if isinstance(t, torch.Tensor))
        return out

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple:
        saved = ctx.saved_tensors
        inputs = [ctx.store.restore(t, shape) if s else t
                  for t, s, shape in zip(saved, ctx.split, ctx.shapes)]
        inputs = [t.detach().requires_grad_(s or t.requires_grad) if t.is_floating_point() else t
                  for t, s in zip(inputs, ctx.split)]
        devices = [ctx.store.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                contextlib.ExitStack() as regions:  # ([]: the CPU generator only)
            for kind, dtype, enabled in ctx.autocast:  # backward usually runs outside the forward's
                regions.enter_context(torch.autocast(kind, dtype, enabled, ctx.autocast_cache))
            torch.set_rng_state(ctx.rng)
            if ctx.cuda_rng is not None:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.store.device)
            outputs = [t for t in tree_flatten(ctx.run(*inputs))[0] if isinstance(t, torch.Tensor)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None,) * 4 + tuple(t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None
                                   for t in inputs)


def checkpoint_module(module: nn.Module, store: CheckpointStore) -> None:
    """Make `module`'s forward a ZeRO-R checkpoint (whenever gradients are on)."""
    original = module.forward

    # Under torch.compile the checkpoint's bookkeeping (the store's chunks, weakly referenced) runs at
    # a graph break: dynamo would trace it into stale tensors. What the block runs is left to dynamo.
    @functools.wraps(original)
    @torch.compiler.disable(recursive=False)
    def forward(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return original(*args, **kwargs)
        args, kwargs = _without_kv_cache(args, kwargs)
        leaves, spec = tree_flatten((args, kwargs))
        where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

        def run(*tensors: torch.Tensor) -> Any:
            filled = list(leaves)
            for i, t in zip(where, tensors):
                filled[i] = t
            a, k = tree_unflatten(filled, spec)
            return original(*a, **k)
        box: dict = {}
        tensors = [leaves[i] for i in where]
        out = iter(_Checkpoint.apply(run, store, box, _anchor(module, tensors), *tensors))
        filled = [next(out) if isinstance(x, torch.Tensor) else x for x in box["leaves"]]
        return tree_unflatten(filled, box["spec"])
    module.forward = forward


def _anchor(module: nn.Module, inputs: list[torch.Tensor]) -> torch.Tensor | None:
    """A reentrant checkpoint's outputs need a gradient only if one of its inputs does: blocks fed by
    a frozen embedding (a LoRA fine-tune's layout) would never run backward, so never train (torch's
    use_reentrant=True pitfall). Where no input requires grad but the block trains, an empty input
    that does ties its outputs to the graph. (Such a block's inputs, needing no gradient, are kept as
    they are: not partitioned nor offloaded, as masks and rotary tables are.)"""
    if any(t.requires_grad for t in inputs) or not any(p.requires_grad for p in module.parameters()):
        return None
    return torch.empty(0, requires_grad=True)


def _is_kv_cache(x: Any) -> bool:
    """A Hugging Face Cache (DynamicCache, ...), told by its interface: no import of transformers."""
    return callable(getattr(x, "get_seq_length", None)) and callable(getattr(x, "update", None))


def _without_kv_cache(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A block run again in backward would append its keys and values to a KV cache a second time:
    wrong attention, so wrong gradients (or a shape error). A checkpointed block therefore gets no
    cache while gradients are on, as transformers' own gradient checkpointing passes its layers
    none; nothing in training reads it. A cache that already holds tokens (a prefix) is refused:
    without it the block would attend to less than the model's mask and positions say."""
    caches = [x for x in (*args, *kwargs.values()) if _is_kv_cache(x)]
    if not caches:
        return args, kwargs
    if any(c.get_seq_length() > 0 for c in caches):
        raise RuntimeError("activation checkpointing with a KV cache that already holds tokens: a block "
                           "recomputed in backward cannot reuse it. Train without past_key_values, or "
                           "drop the \"activation_checkpointing\" section")
    global _warned_about_cache
    if not _warned_about_cache:
        _warned_about_cache = True
        logger.warning("activation checkpointing: blocks run without the KV cache while gradients are "
                       "on, since a block recomputed in backward would fill it twice")
    return (tuple(None if _is_kv_cache(a) else a for a in args),
            {k: None if _is_kv_cache(v) else v for k, v in kwargs.items()})


_warned_about_cache = False


def checkpoint_units(units: list, cfg: ActivationConfig, comm: Comm) -> CheckpointStore:
    """Checkpoint every unit but the root (the blocks), all keeping their inputs in one store."""
    store = CheckpointStore(cfg, comm)
    blocks = [unit.module for unit in units if not unit.is_root]
    for block in blocks:
        checkpoint_module(block, store)
    if not blocks:  # asked for, and silently nothing: say so
        logger.warning("activation_checkpointing: the model has no blocks to checkpoint, so nothing is "
                       "recomputed (blocks are the entries of its nn.ModuleLists, or the classes named "
                       "in zeroshard.unit_modules)")
    return store
