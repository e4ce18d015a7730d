"""Hugging Face's model classes, patched where stage 3's sharding would break their own methods,
registered with the core (`register_model_patch`) when zeroshard is imported.

- Stage 3: `save_pretrained()` outside gathered_parameters() is refused before it writes anything
  (its state_dict() would be refused after config.json).
- Stage 3: `num_parameters()` counts the parameters' full shapes, not the empty placeholders.
- Stage 3 over several ranks: layerdrop that draws per rank is turned off (`keep_every_layer`), and
  `generate()` is collective: it opens with the ranks' gate, and syncs ranks token by token
  (`collective_generate`); inside gathered_parameters() it runs on its own, as a forward there does.
- Any stage: `resize_token_embeddings(n)` is refused: the flat layout (and the optimizer's state)
  was fixed at initialize, so a new shape could only break or go untrained.

Each patch looks for the method it changes and leaves a model without it alone: nothing here
imports transformers.
"""
from __future__ import annotations

import logging
import types
import weakref
from typing import Any

from torch import nn

from ...core.guards import Edits, Unit, _sharded_now, register_model_patch

logger = logging.getLogger("zeroshard")


@register_model_patch
def patch_transformers_model(root: nn.Module, units: list[Unit], shard_params: bool, rank: int,
                             world_size: int) -> None:
    """The patches below that apply to this model and stage."""
    if shard_params:
        count_full_shapes(root, units)
        guard_save_pretrained(root, units)
        if world_size > 1:
            keep_every_layer(root, warn=rank == 0)
            collective_generate(root, units)
    refuse_resize(root)


def guard_save_pretrained(root: nn.Module, units: list[Unit]) -> None:
    """Stage 3: `root.save_pretrained(dir)` (transformers) outside gathered_parameters() would fail
    at its state_dict() after writing config.json: refused before anything is written. Given a
    `state_dict` (ZeroTrainer.save_model passes the gathered one), it saves that, as before."""
    save = getattr(root, "save_pretrained", None)
    if not callable(save):
        return
    live = [weakref.ref(u) for u in units]

    def save_pretrained(self: nn.Module, *args, **kwargs) -> Any:
        given = kwargs.get("state_dict", args[2] if len(args) > 2 else None)  # (dir, is_main, state_dict)
        if given is None and any(_sharded_now(ref()) for ref in live):
            raise RuntimeError("save_pretrained() at stage 3: the parameters are sharded (empty here). "
                               "Save on every rank with trainer.save_model(dir) (ZeroTrainer) or "
                               "engine.save_16bit_model(dir) (rank 0 writes), or inside `with "
                               "engine.gathered_parameters():`. Nothing was written.")
        return save(*args, **kwargs)
    root.save_pretrained = types.MethodType(save_pretrained, root)


def collective_generate(root: nn.Module, units: list[Unit]) -> None:
    """Stage 3 over several ranks: each forward of `root.generate()` (transformers) gathers units, so
    every rank must run it, token for token, until every rank is done (`synced_gpus`, transformers'
    own answer under ZeRO-3 and FSDP; its default here too, made explicit). Its first collective
    is transformers' own all-reduce, which zeroshard does not watch: a generate() on some ranks only
    would wait out the timeout there. So it opens with the ranks' gate (comm/watch.py), which names
    it in seconds. Inside gathered_parameters() nothing is gathered: it runs on its own, unsynced
    (DeepSpeed's "gather, then generate on rank 0")."""
    generate = getattr(root, "generate", None)
    if not callable(generate):
        return
    live = [weakref.ref(u) for u in units]
    watch = units[0].flats[0].comm.watch

    def collective(self: nn.Module, *args, **kwargs) -> Any:
        if any(ref() is not None and ref().edits is not Edits.NONE for ref in live):
            kwargs.setdefault("synced_gpus", False)  # gathered: each rank generates on its own
        else:
            watch.gate("generate()")
            kwargs.setdefault("synced_gpus", True)
        return generate(*args, **kwargs)
    root.generate = types.MethodType(collective, root)


def count_full_shapes(root: nn.Module, units: list[Unit]) -> None:
    """Stage 3: `root.num_parameters()` (transformers' PreTrainedModel; the same arguments) counts
    each parameter by its full shape from the layout, where the parameter itself is a placeholder."""
    if not callable(getattr(root, "num_parameters", None)):
        return
    numel = {id(p): slot.numel for u in units for f in u.flats for p, slot in zip(f.params, f.layout.slots)}

    def num_parameters(self: nn.Module, only_trainable: bool = False,
                       exclude_embeddings: bool = False) -> int:
        embeddings = {f"{name}.weight" for name, m in self.named_modules() if isinstance(m, nn.Embedding)} \
            if exclude_embeddings else set()
        return sum(numel.get(id(p), p.numel()) for name, p in self.named_parameters()
                   if name not in embeddings and (p.requires_grad or not only_trainable))
    root.num_parameters = types.MethodType(num_parameters, root)


def refuse_resize(root: nn.Module) -> None:
    """`root.resize_token_embeddings(n)` (transformers) raises a clear error naming the fix; with no
    size, or the size it has, it only returns the input embeddings, as before."""
    resize = getattr(root, "resize_token_embeddings", None)
    if not callable(resize):
        return

    def resize_token_embeddings(self: nn.Module, new_num_tokens: int | None = None,
                                pad_to_multiple_of: int | None = None, *args, **kwargs) -> nn.Module:
        embeddings = self.get_input_embeddings()
        if pad_to_multiple_of is None and new_num_tokens in (None, getattr(embeddings, "num_embeddings", -1)):
            return embeddings  # (the size it has: nothing to change)
        raise RuntimeError("resize_token_embeddings() after zeroshard.initialize(): the parameters were "
                           "flattened (and sharded) with their shapes at initialize, and the optimizer's "
                           "state with them. Resize before initialize (with ZeroTrainer: before creating "
                           "the trainer), as with DeepSpeed.")
    root.resize_token_embeddings = types.MethodType(resize_token_embeddings, root)


def keep_every_layer(root: nn.Module, warn: bool) -> None:
    """Stage 3 over several ranks: a module's `layerdrop` (transformers' BART family: each training
    forward skips a layer when its own torch.rand draw says so) is set to 0. Each rank draws from its
    own generator, so ranks would skip different layers and gather different units: the collectives no
    longer match (gloo aborts, NCCL hangs or mixes up shards). transformers' own ZeRO-3/FSDP answer for
    the models that read `_is_fsdp_managed_module` (wav2vec2) is the same: every rank runs every layer."""
    dropping = [(name or "<root>", m.layerdrop) for name, m in root.named_modules()
                if isinstance(getattr(m, "layerdrop", None), (int, float)) and m.layerdrop > 0]
    for name, _ in dropping:
        root.get_submodule("" if name == "<root>" else name).layerdrop = 0.0
    if dropping and warn:
        logger.warning("stage 3: layerdrop turned off on %s: ranks would skip different layers by their "
                       "own random draws, and stage 3 gathers a layer's parameters on every rank together; "
                       "every rank now runs every layer (as transformers does under DeepSpeed ZeRO-3 and "
                       "FSDP). For layerdrop, use stage 1 or 2.",
                       ", ".join(f"{n} ({p:g})" for n, p in dropping))
