"""A config "optimizer" section combined with the user's param_groups that set some of its keys
(a no-decay group beside the section's weight decay, a group with its own lr and betas): each group
trains as torch's optimizer built over the same groups with the section's params as defaults, at
every stage, against single-process torch."""
from __future__ import annotations

import torch

import zeroshard
from helpers.models import TinyGPT, assert_matches_reference, batches, loss_fn, reference_run
from helpers.spawn import spawn

STEPS, GLOBAL_BATCH = 3, 12
SECTION = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.2, "betas": [0.9, 0.99]}}


def _groups(model: TinyGPT) -> list[dict]:
    """Decay on matrices (the section's), none on vectors, and the blocks' biases with their own
    lr and betas (and the section's decay, which they do not override)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    special = [p for n, p in named if n.startswith("blocks.") and n.endswith(".bias")]
    ids = {id(p) for p in special}
    return [{"params": [p for _, p in named if p.dim() >= 2]},
            {"params": [p for _, p in named if p.dim() < 2 and id(p) not in ids], "weight_decay": 0.0},
            {"params": special, "lr": 3e-3, "betas": (0.5, 0.9)}]


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT()


def _reference():
    return reference_run(_model, lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.2,
                                                                   betas=(0.9, 0.99)),
                         STEPS, GLOBAL_BATCH, groups=_groups)


def _section_with_groups(rank: int, world_size: int) -> None:
    ref_model, ref_losses = _reference()
    local = GLOBAL_BATCH // world_size
    # The section alone (optimizer=None), and the section's params given to a class.
    for stage, optimizer in [(0, None), (1, torch.optim.AdamW), (2, None), (3, None), (3, torch.optim.AdamW)]:
        model = _model()
        engine = zeroshard.initialize(model, optimizer, {"optimizer": SECTION,
                                                         "zero_optimization": {"stage": stage}},
                                      param_groups=_groups(model))
        groups = engine.optimizer.param_groups
        assert [(g["lr"], g["weight_decay"], tuple(g["betas"])) for g in groups] == \
            [(1e-2, 0.2, (0.9, 0.99)), (1e-2, 0.0, (0.9, 0.99)), (3e-3, 0.2, (0.5, 0.9))], stage
        losses = []
        for step, (x, y) in enumerate(batches(STEPS, GLOBAL_BATCH)):
            mine = slice(rank * local, (rank + 1) * local)
            loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0), y[mine])
            engine.backward(loss)
            engine.step()
            losses.append(zeroshard.mean_over_ranks(loss))
        assert_matches_reference(engine, losses, ref_model, ref_losses, f"stage {stage} {optimizer}")


def test_config_section_with_param_groups_matches_torch():
    spawn(_section_with_groups, 3)
