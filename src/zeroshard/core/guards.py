"""What a unit's parameters do outside the unit's own forward: hooks on the user's modules.

- Stage 3: the root unit is gathered by the model's forward only; a module holding root parameters
  that is called on its own gathers it first (`gather_root_for_its_parts`).
- Stage 3: a module's state_dict() outside forward would save empty placeholders: refused.
- Any stage: a module's load_state_dict() that would not reach what training keeps (the fp32 master,
  a shard, a host copy) would be undone by the next step: refused, unless inside
  `engine.gathered_parameters(modifier_rank=...)`, which takes the changes into the training state.
- What a library's own model classes need beyond these (Hugging Face's save_pretrained,
  num_parameters, resize_token_embeddings, layerdrop) is patched by the integration, registered
  here with `register_model_patch` (integrations/hf/patches.py); the core names no library.

The hooks hold weak references, so a dropped engine is freed.
"""
from __future__ import annotations

import weakref
from enum import Enum
from typing import Callable, Protocol

import torch
from torch import nn

from .flat_param import FlatParam, ParamState

class Edits(Enum):
    """A unit inside engine.gathered_parameters() or not, and whether changes made there are kept."""

    NONE = "outside gathered_parameters()"
    READ_ONLY = "read only"  # inside, without modifier_rank: every change is undone on exit
    TAKEN = "taken"          # inside, with modifier_rank: that rank's changes go into the training state


EDITS_MOVES = {Edits.NONE: {Edits.READ_ONLY, Edits.TAKEN}, Edits.READ_ONLY: {Edits.NONE},
               Edits.TAKEN: {Edits.NONE}}


class Unit(Protocol):
    """What the hooks need of a unit (units.Unit; stated here so this module does not import it)."""

    module: nn.Module
    flats: list[FlatParam]
    edits: Edits  # inside engine.gathered_parameters(), and whether edits are taken

    @property
    def fully_unsharded(self) -> bool: ...

    def unshard(self) -> None: ...

    def reshard(self) -> None: ...


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
        gathered_here.append(not unit().fully_unsharded)
        unit().unshard()

    def post(module: nn.Module, args: object, output: object) -> None:
        if unit() is not None and gathered_here.pop() and not torch.is_grad_enabled():
            unit().reshard()
    for m in _modules_holding(root, only_sharded=True):
        if m is not root.module:
            m.register_forward_pre_hook(_eager(pre))
            m.register_forward_hook(_eager(post), always_call=True)


def _sharded_now(unit: Unit | None) -> bool:
    """Does (live) `unit` hold placeholders now: a sharded buffer not gathered?"""
    return unit is not None and any(f.state is not ParamState.UNSHARDED
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


def _lost_load(unit: Unit) -> str | None:
    """Why a load_state_dict() into this unit's modules now would not last, or None."""
    if unit.edits is not Edits.NONE:
        return None if unit.edits is Edits.TAKEN else \
            "inside gathered_parameters() without modifier_rank, every change is undone on exit"
    for f in unit.flats:
        if f.state is not ParamState.UNSHARDED:
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
                               f"every rank and into the training state; in 16-bit precision rounded to "
                               f"the compute dtype)")
    for m in _modules_holding(unit, only_sharded=False):
        m.register_load_state_dict_pre_hook(refuse)


class ModelPatch(Protocol):
    """A change an integration makes to the user's model once its units are built: `root` is the
    model, `shard_params` whether parameters are sharded at rest (stage 3)."""

    def __call__(self, root: nn.Module, units: list[Unit], shard_params: bool, rank: int,
                 world_size: int) -> None: ...


# Registered by integrations when they are imported (zeroshard's __init__ imports them), applied by
# units.install_hooks to every model, in registration order.
MODEL_PATCHES: list[ModelPatch] = []


def register_model_patch(patch: ModelPatch) -> ModelPatch:
    """Apply `patch` to every model initialize() wraps from now on (a decorator)."""
    MODEL_PATCHES.append(patch)
    return patch
