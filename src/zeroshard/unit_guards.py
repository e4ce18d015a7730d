"""What a unit's parameters do outside the unit's own forward: hooks on the user's modules.

- Stage 3: the root unit is gathered by the model's forward only; a module holding root parameters
  that is called on its own gathers it first (`gather_root_for_its_parts`).
- Stage 3: a module's state_dict() outside forward would save empty placeholders: refused.
- Stage 3: a Hugging Face model's save_pretrained() outside gathered_parameters() is refused
  before it writes anything (its state_dict() would be refused after config.json).
- Stage 3: a Hugging Face model's num_parameters() counts the parameters' full shapes, not the
  empty placeholders (which read 0).
- Any stage: a Hugging Face model's resize_token_embeddings(n) is refused: the flat layout (and the
  optimizer's state) was fixed at initialize, so a new shape could only break or go untrained.
- Stage 3 over several ranks: layerdrop that draws per rank is turned off (`keep_every_layer`).
- Any stage: a module's load_state_dict() that would not reach what training keeps (the fp32 master,
  a shard, a host copy) would be undone by the next step: refused, unless inside
  `engine.gathered_parameters(modifier_rank=...)`, which takes the changes into the training state.

The hooks hold weak references, so a dropped engine is freed.
"""
from __future__ import annotations

import logging
import types
import weakref
from typing import Any, Callable, Protocol

import torch
from torch import nn

from .flat_param import FlatParam, ParamState

logger = logging.getLogger("zeroshard")


class Unit(Protocol):
    """What the hooks need of a unit (units.Unit; stated here so this module does not import it)."""

    module: nn.Module
    flats: list[FlatParam]
    edits_taken: bool | None  # inside engine.gathered_parameters(): whether edits are taken

    @property
    def complete(self) -> bool: ...

    def gather(self) -> None: ...

    def free(self) -> None: ...


def _eager(hook: Callable) -> Callable:
    """A hook dynamo runs eagerly at a graph break rather than tracing: the unit hooks swap
    parameters' storage in and out, which dynamo cannot trace, so a compiled module (compiled
    before or after initialize) only ever sees gathered parameters."""
    return torch._dynamo.disable(hook)


def _modules_holding(unit: Unit, only_sharded: bool) -> list[nn.Module]:
    """The modules that register one of `unit`'s parameters themselves (of its sharded buffers)."""
    mine = {id(p) for f in unit.flats if not (only_sharded and f.persistent) for p in f.params}
    return [m for m in unit.module.modules()
            if any(id(p) in mine for p in m._parameters.values() if p is not None)]


def refuse_if_engine_dropped(module: nn.Module) -> None:
    """A unit hook whose engine was garbage-collected: the module holds empty placeholders, which
    would fail somewhere inside the forward ('weight' must be 2-D); say what happened instead."""
    if any(p.numel() == 0 for p in module.parameters()):
        raise RuntimeError("this model was sharded by a zeroshard engine (stage 3) that has since been "
                           "garbage-collected, so its parameters are empty placeholders: keep the engine "
                           "that initialize() returns (engine = zeroshard.initialize(model, ...)) for as "
                           "long as the model is used; engine.module then stays usable")


def gather_root_for_its_parts(root: Unit) -> None:
    """Stage 3: a module registering root parameters, called on its own rather than inside the
    model's forward (T5's generate() runs its encoder itself; `model.get_input_embeddings()(ids)`;
    `model.model(...)`), gathers the root first. After it, under no_grad, it frees what it gathered
    (no backward follows, as after the root's own forward); with grad the root stays gathered until
    that backward ends."""
    unit = weakref.ref(root)
    gathered_here: list[bool] = []  # per call in progress (calls nest)

    def pre(module: nn.Module, args: object) -> None:
        if unit() is None:
            refuse_if_engine_dropped(module)
            gathered_here.append(False)  # (the post hook pops one per call)
            return
        gathered_here.append(not unit().complete)
        unit().gather()

    def post(module: nn.Module, args: object, output: object) -> None:
        if unit() is not None and gathered_here.pop() and not torch.is_grad_enabled():
            unit().free()
    for m in _modules_holding(root, only_sharded=True):
        if m is not root.module:
            m.register_forward_pre_hook(_eager(pre))
            m.register_forward_hook(_eager(post), always_call=True)


def _sharded_now(unit: Unit | None) -> bool:
    """Does (live) `unit` hold placeholders now: a sharded buffer not gathered?"""
    return unit is not None and any(f.state is not ParamState.GATHERED
                                    for f in unit.flats if not f.persistent)


def guard_state_dict(unit: Unit) -> None:
    """Stage 3: outside forward this unit's parameters are empty placeholders, and a module's
    state_dict() (torch.save, save_pretrained) would hold them as empty tensors, silently. Each
    module registering one refuses it by name instead, unless the unit is gathered."""
    live = weakref.ref(unit)

    def refuse(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
        if _sharded_now(live()):
            raise RuntimeError(f"state_dict() of '{prefix.rstrip('.') or 'the model'}' at stage 3 "
                               f"outside forward: its parameters are sharded (empty here) and would be "
                               f"saved as empty tensors. Use engine.full_state_dict(), "
                               f"engine.save_checkpoint() (ZeroTrainer: trainer.save_model()), or call "
                               f"it inside `with engine.gathered_parameters():`")
    for m in _modules_holding(unit, only_sharded=True):
        m.register_state_dict_post_hook(refuse)


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


def _lost_load(unit: Unit) -> str | None:
    """Why a load_state_dict() into this unit's modules now would not last, or None."""
    if unit.edits_taken is not None:
        return None if unit.edits_taken else \
            "inside gathered_parameters() without modifier_rank, every change is undone on exit"
    for f in unit.flats:
        if f.state is not ParamState.GATHERED:
            return "its parameters are sharded (empty here)"
        if f.owned_values().untyped_storage().data_ptr() != f.full.untyped_storage().data_ptr():
            return ("training keeps them elsewhere (the fp32 master, a shard or a host copy), which it "
                    "would not reach: the next step would put the old values back")
    return None


def guard_load_state_dict(unit: Unit) -> None:
    """A module's load_state_dict() after initialize writes the parameters the forward reads; at
    16-bit precision, with offload or at stage 3 training keeps the values elsewhere, so the next
    step would silently undo it. Refused by name there (fp32 in place at stages 0-2 it just works)."""
    live = weakref.ref(unit)

    def refuse(module: nn.Module, state_dict: dict, prefix: str, *args: object) -> None:
        why = _lost_load(live()) if live() is not None else None
        if why is not None:
            raise RuntimeError(f"load_state_dict() into '{prefix.rstrip('.') or 'the model'}' after "
                               f"zeroshard.initialize: {why}. Load the weights before initialize(), use "
                               f"engine.load_checkpoint(), or load inside `with "
                               f"engine.gathered_parameters(modifier_rank=0):` (rank 0's values go to "
                               f"every rank and into the training state)")
    for m in _modules_holding(unit, only_sharded=False):
        m.register_load_state_dict_pre_hook(refuse)
