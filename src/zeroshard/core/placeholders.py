"""What a parameter is while its buffer is not gathered (stage 3 at rest, stages 1-2 while a
deferred post-step all-gather is in flight): an empty tensor of its dtype, on its device.

A read of it fails loudly or reads nothing. A write into it (`p.zero_()`, `nn.init.normal_(p)`,
`model.apply(init_fn)` after initialize) would be lost without a word: the values live in the shard
and the master, which the write never reaches. So each placeholder's autograd version is noted when
the parameter is pointed at it, and the next gather refuses a parameter whose version moved, by
name, with the way to change weights that does reach them. (`p.data.zero_()` bypasses the version
counter, as it bypasses autograd: that one cannot be seen.) The versions stand while the buffer is
gathered, so a stage-3 reshard refuses a write made meanwhile (`refuse_lost`: a module writing its
own weight in forward), which the freed buffer would take with it.

The same counter watches the parameters of a buffer kept gathered (stages 0-2, stage 3's persistent
ones) whose values training keeps apart: a 16-bit compute copy of a fp32 master, a copy of an
offloaded master, or of a stage-3 shard. A write into such a parameter outside
gathered_parameters() would be written over by the next step; `InPlaceWrites` notes the versions
after each of the engine's own writes (which bump them too) and the step refuses a moved one.
Where the parameters are the values trained (fp32 at stages 0-2) a write trains on; the step only
makes sure every rank made one (engine.step's gate).

Nor does the counter see a parameter's tensor replaced (`p.data = t`, `model.half()` or `.to()` after
initialize): the parameter then computes with a tensor zeroshard never reads, trained apart from the
shards or not at all, and the next gather would silently undo it. So every gather and free first
checks that each parameter still holds what it was pointed at (`Placeholders.refuse_replaced`), and
that the model still holds each parameter where it did (its `Home`s): a new Parameter set in its
place (`module.weight = nn.Parameter(t)`, `load_state_dict(assign=True)`) would compute and take
gradients that zeroshard never sees, while it trains and saves the one it was given.
"""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.dtensor import TpSpec, local_of, point
from .partition import Slot

Home = tuple[nn.Module, str, str]  # (the module holding a parameter, its attribute, its full name)


def homes_of(root: nn.Module, names: tuple[str, ...]) -> list[Home]:
    """Where `root` holds a parameter under each of its names (several for a tied one)."""
    return [(root.get_submodule(prefix), attr, name) for name in names
            for prefix, _, attr in [name.rpartition(".")]]


def refuse_rehomed(params: list[nn.Parameter], homes: list[list[Home]]) -> None:
    """Each parameter is still the one its module holds; a new one set in its place is put back,
    then refused by name."""
    moved = [name for p, places in zip(params, homes) for m, attr, name in places
             if m._parameters.get(attr) is not p]
    if not moved:
        return
    for p, places in zip(params, homes):
        for m, attr, _ in places:
            m._parameters[attr] = p
    raise RuntimeError(
        f"{_names(moved)}: a new Parameter was set in the model after initialize() (`module.weight = "
        f"nn.Parameter(t)`, load_state_dict(assign=True)), so it would compute and take gradients that "
        f"zeroshard never sees, while it trains and saves the one it was given; the original is put "
        f"back. Write values in place instead, inside `with engine.gathered_parameters(modifier_rank=0):` "
        f"(p.copy_(new) under torch.no_grad(), or load_state_dict without assign), or change the model "
        f"before initialize()")


class Placeholders:
    """The empty tensor a buffer's parameters view while it is not gathered, and their versions."""

    def __init__(self, dtype: torch.dtype, device: torch.device) -> None:
        self.empty = torch.empty(0, dtype=dtype, device=device)
        self.versions: list[int] | None = None  # noted when pointed here, standing while gathered

    def point(self, params: list[nn.Parameter], specs: list[TpSpec | None]) -> None:
        for p, spec in zip(params, specs):
            point(p, self.empty, spec)
        self.note(params)

    def note(self, params: list[nn.Parameter]) -> None:
        """Take the versions as they are now (after zeroshard's own version bump at a step)."""
        self.versions = [p._version for p in params]

    def refuse_replaced(self, params: list[nn.Parameter], specs: list[TpSpec | None],
                        views: list[torch.Tensor] | None, slots: list[Slot], homes: list[list[Home]]) -> None:
        """Each parameter is still the model's (refuse_rehomed) and computes with what it was pointed
        at: its view of the flat buffer (`views`, while gathered), or else this placeholder, unwritten
        (check_untouched). A replaced one is pointed back before the refusal, so the engine stays
        whole for a retry."""
        refuse_rehomed(params, homes)
        expected = views or [self.empty] * len(params)
        # By memory and dtype (a replacement is new memory, but empty ones share address 0: an empty
        # placeholder cast by `model.half()` differs in dtype only). This runs at every gather and
        # free, so it must cost little (benchmarks/unit_overhead.py times the hooks around it).
        replaced = [slot.names[0] for p, e, slot in zip(params, expected, slots)
                    if (t := local_of(p)).data_ptr() != e.data_ptr() or t.dtype != e.dtype]
        if replaced:
            for p, e, spec in zip(params, expected, specs):
                point(p, e, spec)
            if views is None:
                self.note(params)
            raise RuntimeError(
                f"{', '.join(replaced)}: the parameter's tensor was replaced after initialize() (`p.data = "
                f"...`, model.half()/.to()/.cuda(), or transformers' tie_weights() padding a tied layer's "
                f"bias, on the engine's model), so its new values would be "
                f"neither trained nor kept; the replacement is undone. Write values in place instead, "
                f"inside `with engine.gathered_parameters(modifier_rank=0):` (p.copy_(new) under "
                f"torch.no_grad()), or change the model before initialize()")
        if views is None:
            self.check_untouched(params, slots)

    def refuse_lost(self, params: list[nn.Parameter], slots: list[Slot]) -> None:
        """Before a gathered buffer is freed: none of its parameters was written in place while
        gathered (the versions noted on the placeholder stand while gathered: check_untouched)."""
        written = [slot.names[0] for p, slot, v in zip(params, slots, self.versions or ()) if p._version != v]
        if written:
            self.note(params)  # refused once: the buffer stays gathered, whole, for a retry
            raise RuntimeError(
                f"{_names(written)} changed in place while gathered (in forward, a module writing "
                f"its own weight: nn.Embedding(max_norm=...) renormalizes the rows it reads; or a hook): "
                f"stage 3 frees the gathered parameters after use and keeps only this rank's shard, so "
                f"the change would be lost. Drop the write (for max_norm: renormalize the weight inside "
                f"`with engine.gathered_parameters(modifier_rank=0):` after engine.step())")

    def check_untouched(self, params: list[nn.Parameter], slots: list[Slot]) -> None:
        """Before the parameters view gathered values again: none was written meanwhile."""
        versions = self.versions  # (kept: only pointing at the placeholder again notes new ones)
        if versions is None:
            return
        written = [slot.names[0] for p, slot, v in zip(params, slots, versions) if p._version != v]
        if written:
            raise RuntimeError(
                f"{', '.join(written)} changed in place while this rank held only its shard (outside "
                f"forward at stage 3, or before the deferred all-gather landed): the parameter was an "
                f"empty placeholder, so the change was lost. Change weights inside `with "
                f"engine.gathered_parameters(modifier_rank=0):` (rank 0's values go to every rank and "
                f"into the fp32 masters), or before initialize()")


class InPlaceWrites:
    """The autograd versions of a buffer's parameters as the engine last wrote them. `watched`:
    training keeps their values apart, so a write would be lost (refused); `kept`: the buffer stays
    gathered, and a write elsewhere simply trains on, if every rank makes it."""

    def __init__(self, params: list[nn.Parameter], slots: list[Slot], watched: bool, kept: bool) -> None:
        self.params, self.slots, self.watched, self.kept = params, slots, watched, kept
        self.note()

    def note(self) -> None:
        """Take the versions as they are now: after one of the engine's own writes."""
        self.versions = [p._version for p in self.params]

    def refuse(self) -> bool:
        """Raise, naming them, if parameters were written in place since where the write would be
        lost; True if one was written where it trains on. Either is told once (noted again)."""
        written = [slot.names[0] for p, slot, v in zip(self.params, self.slots, self.versions)
                   if p._version != v]
        if not written:
            return False
        self.note()
        if self.watched:
            raise RuntimeError(
                f"{_names(written)} changed in place after zeroshard.initialize() (p.copy_(), "
                f"p.fill_(), nn.init on the engine's model): training keeps these values elsewhere (the "
                f"fp32 master, a host copy or a shard), so the next step would write over the change. "
                f"Change weights inside `with engine.gathered_parameters(modifier_rank=0):` (rank 0's "
                f"values go to every rank and into the masters), or before initialize()")
        return self.kept


def _names(names: list[str]) -> str:
    """The first three names, and how many more."""
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
