"""Units: the modules whose parameters are gathered, freed and reduced together.

Policy: with `unit_modules=None`, every child of an nn.ModuleList (the repeated blocks of almost every
network) becomes a unit; otherwise every module whose class name is listed does. Units never nest
(the outermost match wins). The root unit holds every other parameter.

A parameter belongs to exactly one unit: the lowest unit containing every module that registers it.
A weight tied across units (an embedding shared with the output layer) therefore lands in the root,
which stays gathered for the whole forward and backward.
"""
from __future__ import annotations

import logging
import weakref
from enum import Enum
from typing import Callable, Protocol

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from ..common.states import move
from ..config import ConfigError
from ..construct import materialize_
from ..parallel.dtensor import split_over_tp
from .flat_param import FlatParam, ParamState
from .guards import (EDITS_MOVES, MODEL_PATCHES, Edits, _eager, gather_root_for_its_parts,
                     guard_load_state_dict, guard_state_dict, refuse_if_engine_dropped)
from .placeholders import homes_of
from .policy import StagePolicy

logger = logging.getLogger("zeroshard")

ROOT = ""


def find_units(model: nn.Module, unit_modules: list[str] | None) -> list[str]:
    """Qualified names of unit modules in registration order, root ("") first."""
    if unit_modules is None:
        candidates = {f"{name}.{child}" if name else child
                      for name, m in model.named_modules() if isinstance(m, nn.ModuleList)
                      for child, _ in m.named_children()}
    else:
        wanted = set(unit_modules)
        candidates = {name for name, m in model.named_modules() if name and type(m).__name__ in wanted}
        found = {type(m).__name__ for name, m in model.named_modules() if name in candidates}
        classes = sorted({type(m).__name__ for m in model.modules()} - {type(model).__name__})
        if wanted - found:
            raise ConfigError(f"config key 'zeroshard.unit_modules' names {sorted(wanted - found)}, but no "
                              f"submodule has that class (the model itself is always the root unit); its "
                              f"submodules' classes are {classes}")
        containers = sorted({type(m).__name__ for name, m in model.named_modules()
                             if name in candidates and type(m).forward is nn.Module.forward})
        if containers:  # a unit is gathered by its forward hooks: a container never runs forward
            raise ConfigError(f"config key 'zeroshard.unit_modules' names {containers}, which has no forward "
                              f"of its own (a container): name the class of the blocks inside it")
    units = [ROOT]
    for name, _ in model.named_modules():
        if name in candidates and not any(_is_within(name, u) for u in units[1:]):
            units.append(name)
    return units


def _is_within(name: str, ancestor: str) -> bool:
    return ancestor == ROOT or name == ancestor or name.startswith(ancestor + ".")


def _owning_unit(module_name: str, units: list[str]) -> str:
    inside = [u for u in units if _is_within(module_name, u)]
    return max(inside, key=len)  # the deepest one; units never nest, so this is unique


NamedParams = list[tuple[tuple[str, ...], nn.Parameter]]  # (every name of a parameter, the parameter)


def assign_params(model: nn.Module, units: list[str]) -> dict[str, NamedParams]:
    """unit name -> [(all names of a parameter, parameter)] in registration order, each once."""
    names: dict[int, list[str]] = {}
    owners: dict[int, set[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for full_name, p in model.named_parameters(remove_duplicate=False):
        module_name = full_name.rpartition(".")[0]
        names.setdefault(id(p), []).append(full_name)
        owners.setdefault(id(p), set()).add(_owning_unit(module_name, units))
        params[id(p)] = p
    assigned: dict[str, NamedParams] = {u: [] for u in units}
    for key, p in params.items():
        homes = owners[key]
        assigned[homes.pop() if len(homes) == 1 else ROOT].append((tuple(names[key]), p))
    return assigned


def build_units(module: nn.Module, unit_modules: list[str] | None, group_of: dict[int, int],
                new_flat: Callable[[NamedParams, int], FlatParam]) -> list["Unit"]:
    """The units, each with one flat buffer per parameter group of its parameters (frozen ones in a
    group of their own, -1; parameters split over tp apart from the others), made by
    new_flat(members, group). A model built under zeroshard.init()
    is materialized here one unit at a time, so at stage 3 a rank never holds more than its shards
    and one unit in full. `group_of` follows parameters that materializing replaced."""
    units = []
    for name, named_params in assign_params(module, find_units(module, unit_modules)).items():
        replaced = materialize_((p for _, p in named_params), module)
        named_params = [(n, replaced.get(id(p), p)) for n, p in named_params]
        group_of.update({id(replaced[old]): group_of[old] for old in replaced if old in group_of})
        by_group: dict[tuple[int, bool], NamedParams] = {}  # (group, split over tp) -> its parameters
        for names, p in named_params:
            # Split parameters get buffers of their own: the norm counts them on every tp rank,
            # replicated ones on one.
            key = (group_of.get(id(p), -1), split_over_tp(p))
            by_group.setdefault(key, []).append((names, p))
        groups = sorted(by_group.items())
        flats = [new_flat(members, group) for (group, _), members in groups]
        for flat, (_, members) in zip(flats, groups):  # where the model holds them: kept there
            flat.homes = [homes_of(module, names) for names, _ in members]
        if flats:
            units.append(Unit(name, module.get_submodule(name), flats))
    for u, unit in enumerate(units):  # what fingerprints and error messages call each buffer
        for flat in unit.flats:
            group = f", group {flat.group}" if len(unit.flats) > 1 else ""
            group += ", tp-split" if flat.tp_sharded else ""
            flat.label = f"unit {u} ({unit.name or 'root'}{group})"
    return units


def persistent_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """The buffers module.state_dict() holds, by qualified name."""
    out = {}
    for prefix, m in module.named_modules():
        for name, b in m.named_buffers(recurse=False):
            if b is not None and name not in m._non_persistent_buffers_set:
                out[f"{prefix}.{name}" if prefix else name] = b
    return out


class UnitProgress(Enum):
    """How far the current forward and backward have come with a unit."""

    RAN_FORWARD = "ran forward"  # in the current forward; backward has not moved past it
    PASSED = "passed"            # backward has moved on to units that ran before this one


_PROGRESS_MOVES = {UnitProgress.RAN_FORWARD: {UnitProgress.PASSED},
                   UnitProgress.PASSED: {UnitProgress.RAN_FORWARD}}


class UnitVisitor(Protocol):
    """What a unit's hooks report to (prefetch.UnitOrder): the unit about to run forward, or
    backward. The hooks know only this interface, so units.py does not import prefetch.py."""

    def before_forward(self, unit: "Unit") -> None: ...

    def before_backward(self, unit: "Unit") -> None: ...

    def keeps_for_backward(self, unit: "Unit") -> bool: ...


class Unit:
    """A module and its flat parameters; at stage 3 it is gathered before use and freed after."""

    def __init__(self, name: str, module: nn.Module, flats: list[FlatParam]) -> None:
        self.name, self.module, self.flats = name, module, flats
        self.is_root = name == ROOT
        # Freeing during backward is only safe when no frozen buffer may still be needed later.
        self.free_when_reduced = not self.is_root and all(f.trainable for f in flats)
        self.progress = UnitProgress.RAN_FORWARD
        self.edits = Edits.NONE  # inside engine.gathered_parameters(): whether edits are kept
        # Elements this unit gathers (buffers kept gathered do not count): fixed at initialize.
        self.numel = sum(f.layout.padded_numel for f in flats if not f.persistent)

    def set_progress(self, new: UnitProgress) -> None:
        self.progress = move(self.progress, new, _PROGRESS_MOVES, f"unit '{self.name}'")

    def set_edits(self, new: Edits) -> None:
        self.edits = move(self.edits, new, EDITS_MOVES, f"unit '{self.name}'")

    def unshard(self) -> None:
        for f in self.flats:
            f.unshard()

    @property
    def unsharded(self) -> bool:
        """Gathered, or an all-gather in flight."""
        return any(f.state is not ParamState.SHARDED for f in self.flats if not f.persistent)

    def start_unshard(self) -> None:
        for f in self.flats:
            f.start_unshard()

    def reshard(self, keep_secondary: bool = False) -> None:
        if self.edits is not Edits.NONE:  # inside gathered_parameters(): a forward there (rank 0
            return                        # generating alone, say) gathers and frees nothing
        for f in self.flats:
            f.reshard(keep_secondary)

    def maybe_reshard(self) -> None:
        """Free during backward once every gradient is reduced *and* backward has moved past this
        unit: its gradients can be complete while its weights are still needed (a detached use)."""
        if self.free_when_reduced and self.progress is UnitProgress.PASSED and \
                all(f.reduced for f in self.flats if f.trainable):
            self.reshard()

    def install_gather_hooks(self, units: list["Unit"]) -> None:
        """Stages 1-2 with defer_param_gather: every module owned by this unit (not by a unit inside
        it) waits for the unit's post-step all-gather before its forward, ahead of any user hook, and
        before its state_dict() or load_state_dict()."""
        unit = weakref.ref(self)
        wait = _eager(lambda *_: unit() and unit().unshard())  # (returns None: changes nothing)
        inner = {m for u in units if u is not self and not u.is_root for m in u.module.modules()}
        for m in self.module.modules():
            if m not in inner:
                m.register_forward_pre_hook(wait, prepend=True)
                m.register_state_dict_pre_hook(wait)
                m.register_load_state_dict_pre_hook(wait)

    def install_stage3_hooks(self, order: UnitVisitor) -> None:
        """Gather before forward and before backward; free after forward (the root stays). The
        hooks live on the user's module: they hold weak references, so a dropped engine is freed."""
        unit, units = weakref.ref(self), weakref.ref(order)

        def pre_forward(module: nn.Module, args: object) -> None:
            # Inside gathered_parameters() a forward (perhaps on one rank alone) is not recorded:
            # the record steers every rank's prefetching, which must stay alike.
            if unit() is None or units() is None:
                refuse_if_engine_dropped(module)
            elif unit().edits is Edits.NONE:
                units().before_forward(unit())

        def post_forward(module: nn.Module, args: object, output: object) -> None:
            if unit() is not None and units() is not None:
                unit()._post_forward(output, units())
        self.module.register_forward_pre_hook(_eager(pre_forward))
        self.module.register_forward_hook(_eager(post_forward))

    @property
    def fully_unsharded(self) -> bool:
        """Every buffer gathered (none sharded, none in flight)."""
        return all(f.state is ParamState.UNSHARDED for f in self.flats)

    def _post_forward(self, output: object, order: UnitVisitor) -> None:
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation inside backward (activation checkpointing): keep parameters
        if not torch.is_grad_enabled():
            self.reshard()  # no backward follows this forward (an earlier one re-gathers on its own)
            return
        if not self.is_root and not order.keeps_for_backward(self):
            self.reshard(keep_secondary=True)  # (a unit backward needs first, or soon, stays: it would be
            # gathered right back; hpZ keeps a secondary shard for backward's gather inside the node)
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
        if tensors:  # the root too: a no_grad forward in between may have freed it
            torch.autograd.graph.register_multi_grad_hook(
                tensors, lambda grad: order.before_backward(self), mode="any")


def install_hooks(units: list[Unit], order: UnitVisitor, policy: StagePolicy, defer_gather: bool,
                  rank: int, world_size: int) -> bool:
    """Stage 3: gather/free hooks on every unit. Stages 1-2 with zeroshard.defer_param_gather: the
    post-step all-gather is issued, not waited for, and each module waits for its unit's right
    before its forward, so the gather hides behind the forward's compute. Every stage: a module's
    load_state_dict() that the next step would undo is refused, and the integrations' model patches
    are applied (guards.MODEL_PATCHES). Returns whether the deferred gather was set up."""
    deferred = False
    if policy.shard_params:
        if len(units) == 1 and rank == 0:
            logger.warning("stage 3 found no unit besides the root (no nn.ModuleList, no "
                           "zeroshard.unit_modules match): every parameter stays gathered from "
                           "forward to backward; name your block classes in zeroshard.unit_modules")
        for unit in units:
            unit.install_stage3_hooks(order)
            guard_state_dict(unit)
        gather_root_for_its_parts(units[0])
        for module in units[0].module.modules():  # as fully_shard marks what it manages, for the same
            module._is_fsdp_managed_module = True  # readers: transformers then runs every layer on every
            module._fsdp_use_orig_params = True    # rank (layerdrop off) and generates with synced_gpus;
            # dynamo treats the parameters as inputs, whose storage the unit hooks swap in and out
    elif defer_gather:
        deferred = True
        for unit in units:
            unit.install_gather_hooks(units)
            for flat in unit.flats:
                flat.gather_behind_forward = True
    for unit in units:  # after the deferred gather's wait: a load judges the gathered parameters
        guard_load_state_dict(unit)
    for patch in MODEL_PATCHES:
        patch(units[0].module, units, policy.shard_params, rank, world_size)
    return deferred
