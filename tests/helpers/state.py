"""An engine's optimizer state per parameter name, assembled from every rank's flat shards by the
layout alone (slots, shard size, stage), not through zeroshard's checkpoint code: so a resumed
engine's state can be compared, exactly and by name, with the state of the engine that saved it,
at any world size and stage."""
from __future__ import annotations

import torch

import zeroshard


def _owned(engine, flat) -> tuple[int, int]:
    """Elements of the padded buffer whose optimizer state this rank holds."""
    layout = flat.layout
    if engine.zero_optimization_stage() == 0:
        return 0, layout.padded_numel
    rank = zeroshard.rank_and_world_size()[0]
    return rank * layout.shard_numel, (rank + 1) * layout.shard_numel


def optimizer_state_by_name(engine) -> tuple[dict[tuple[str, str], torch.Tensor], list[list[float]]]:
    """({(parameter name, state key): the state over the whole parameter}, [the step counts of each
    parameter group]). Collective: every rank gets the whole."""
    pieces: list[tuple[str, str, int, torch.Tensor]] = []
    steps: dict[int, list[float]] = {}
    for flat in engine.flats:
        if not flat.trainable:
            continue
        state = engine.optimizer.state.get(flat.opt_param, {})
        lo, hi = _owned(engine, flat)
        group = next(i for i, g in enumerate(engine.optimizer.param_groups)
                     if any(p is flat.opt_param for p in g["params"]))
        for key, value in state.items():
            if key == "step":
                steps.setdefault(group, []).append(float(value))
                continue
            for slot in flat.layout.slots:
                a, b = max(lo, slot.offset), min(hi, slot.offset + slot.numel)
                if a < b:
                    pieces.append((slot.names[0], key, a - slot.offset, value[a - lo:b - lo].clone()))
    whole: dict[tuple[str, str], torch.Tensor] = {}
    everyone = zeroshard.gather_objects((pieces, steps))
    numel = {slot.names[0]: slot.numel for f in engine.flats for slot in f.layout.slots}
    for rank_pieces, _ in everyone:
        for name, key, start, piece in rank_pieces:
            out = whole.setdefault((name, key), torch.full((numel[name],), float("nan")))
            out[start:start + piece.numel()] = piece
    group_steps: dict[int, set[float]] = {}
    for _, rank_steps in everyone:
        for group, values in rank_steps.items():
            group_steps.setdefault(group, set()).update(values)
    assert all(not v.isnan().any() for v in whole.values()), "some state element is held by no rank"
    return whole, [sorted(group_steps.get(i, set())) for i in range(len(engine.optimizer.param_groups))]
