"""A unit used twice in one forward (a shared block: blocks 0, 1, 2, then 1 again) at stage 3: the
exact sequence of all-gathers and reduce-scatters each step, seen at torch.distributed's Python API,
and training equal to single-process torch.

The expected sequences are derived from the model's call order alone. Without prefetch (the paper's
profile) a unit is gathered right before each use in forward and freed right after; backward gathers
a unit when it first reaches it (the second use of block 1) and keeps it until backward has passed
its first use; the root (the tied embedding) stays from its forward to the end of backward. Each
trainable buffer is reduced once per backward, in reverse registration order, the last two (block 0
and the root) as one collective. With gloo's default prefetch window every unit of this small model
stays gathered from its first use to the end of backward: each is gathered once a step."""
from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist
from torch import nn

import zeroshard
from helpers.margins import close
from helpers.models import VOCAB, Block, batches, loss_fn
from helpers.spawn import spawn

ORDER = (0, 1, 2, 1)
STEPS, GLOBAL_BATCH = 3, 12


class SharedBlock(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, d)
        self.blocks = nn.ModuleList(Block(d, m) for m in (1, 2, 3))  # distinct sizes: told apart by numel
        self.head = nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for i in ORDER:
            x = self.blocks[i](x)
        return self.head(x)


def _model() -> SharedBlock:
    torch.manual_seed(0)
    return SharedBlock()


@contextmanager
def _record():
    """Every all-gather (output elements) and reduce-scatter (input elements; on gloo zeroshard
    issues it as all_to_all_single) issued inside, in order."""
    calls: list[tuple[str, int]] = []
    names = {"all_gather_single": ("AG", 0), "all_gather_into_tensor": ("AG", 0),
             "all_to_all_single": ("RS", 1), "reduce_scatter_single": ("RS", 1),
             "reduce_scatter_tensor": ("RS", 1)}
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}

    def tapped(name, fn):
        kind, argument = names[name]

        def call(*args, **kwargs):
            calls.append((kind, args[argument].numel()))
            return fn(*args, **kwargs)
        return call
    for name, fn in saved.items():
        setattr(dist, name, tapped(name, fn))
    try:
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def _reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for x, y in batches(STEPS, GLOBAL_BATCH):
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def _shared(rank: int, world_size: int) -> None:
    ref_state, ref_losses = _reference()
    pad = lambda n: -(-n // world_size) * world_size  # noqa: E731
    sizes = {"root": pad(VOCAB * 16)}
    sizes.update({i: pad(sum(p.numel() for p in b.parameters())) for i, b in enumerate(_model().blocks)})
    forward = ["root"] + list(ORDER)
    expected = {"paper": [("AG", sizes[u]) for u in forward + [1, 2, 0]],  # backward: 1 (used last), 2, 0
                "window": None}  # every unit once, however the prefetch groups the collectives
    reduce_scatters = [("RS", sizes[2]), ("RS", sizes[1]), ("RS", sizes[0] + sizes["root"])]
    local = GLOBAL_BATCH // world_size
    for name, zero in [("paper", {"stage": 3, "overlap_comm": False}), ("window", {"stage": 3})]:
        engine = zeroshard.initialize(_model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                                      {"zero_optimization": zero})
        losses = []
        for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
            with _record() as calls:
                loss = loss_fn(engine(x[rank * local:(rank + 1) * local]), y[rank * local:(rank + 1) * local])
                engine.backward(loss)
                engine.step()
            gathers = [c for c in calls if c[0] == "AG"]
            what = (name, step, calls)
            if expected[name] is not None:
                assert gathers == expected[name], what
            elif step > 0:  # (the first forward has no record to prefetch along)
                assert sum(n for _, n in gathers) == sum(sizes.values()), what
            reductions = [c for c in calls if c[0] == "RS"]
            assert reductions == reduce_scatters, what  # each buffer once, block 1 after both its uses
            assert engine.memory_stats()["temporary"] == 0, what  # every unit freed after the step
            losses.append(zeroshard.mean_over_ranks(loss))
        close(losses, ref_losses, rtol=1e-5, atol=2e-6, what=f"{name} losses")
        state = engine.full_state_dict()
        for key, value in ref_state.items():
            close(state[key], value, rtol=1e-5, atol=2e-6, what=f"{name} {key}")


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_block_used_twice_is_gathered_and_reduced_as_derived(world_size):
    spawn(_shared, world_size)
