"""torch.compile and Hugging Face's activation checkpointing on a Hugging Face GPT-2, at every stage,
2 gloo ranks, against single-process eager training of the same model on the whole batch.

Compile: `model.compile()` before `initialize` and per-block compilation (FSDP2's pattern) train like
eager (inductor fuses, so the sums run in another order: tolerance as the other fp32 parity tests),
and nothing recompiles after the first step (dynamo's counters). Stage 3's hooks swap parameter
storage in and out, which dynamo cannot trace: they run eagerly at a graph break on unit boundaries.
Compiled blocks also run as zeroshard's own checkpoints (the checkpoint's bookkeeping runs at a graph
break). Checkpointing: `gradient_checkpointing_enable`, reentrant and not, recomputes each block inside
backward, where stage 3 must keep the unit it gathered for backward."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from helpers.margins import close
from helpers.spawn import spawn

transformers = pytest.importorskip("transformers")
VOCAB, SEQ, STEPS, PER_RANK = 64, 16, 3, 2


def gpt2(checkpointing: str | None = None) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)  # tied embedding and head
    if checkpointing:  # the name users know (transformers 5 also has activation_checkpointing_...)
        reentrant = checkpointing == "reentrant"
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    return model


def sgd(params):
    """Not Adam: GPT-2's key bias has a gradient that is zero up to rounding (softmax ignores a
    shift), and Adam's normalisation turns that rounding noise into full-size steps."""
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)


def data(world_size: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (PER_RANK * world_size, SEQ), generator=g) for _ in range(STEPS)]


def reference(world_size: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    """Eager, one process, the global batch (every rank holds as many tokens, so the mean of the
    ranks' mean losses is the global mean)."""
    model = gpt2()
    opt, losses = sgd(model.parameters()), []
    for x in data(world_size):
        loss = model(x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model.state_dict(), losses


def train(model: torch.nn.Module, stage: int, rank: int, world_size: int) -> tuple[object, list[float]]:
    engine = zeroshard.initialize(model, sgd, {"zero_optimization": {"stage": stage}})
    return engine, run_steps(engine, data(world_size), rank)


def run_steps(engine, batches: list[torch.Tensor], rank: int) -> list[float]:
    """One step per global batch, on this rank's slice; the mean loss over ranks of each."""
    losses = []
    for x in batches:
        mine = x[PER_RANK * rank:PER_RANK * (rank + 1)]
        loss = engine(mine, labels=mine).loss
        engine.backward(loss)
        engine.step()
        losses.append(zeroshard.mean_over_ranks(loss))
    return losses


def check(engine, losses, expected, what: str) -> None:
    weights, expected_losses = expected
    close(losses, expected_losses, rtol=1e-5, atol=2e-6, what=f"{what}: losses")
    full = engine.full_state_dict()
    for name, value in weights.items():
        if name in full:  # (HF's state_dict keeps non-persistent attention masks out alike)
            close(full[name], value, rtol=1e-5, atol=2e-6, what=f"{what}: {name}")


def _compiled(rank: int, world_size: int) -> None:
    import torch._dynamo as dynamo
    expected = reference(world_size)
    for how in ("model", "blocks"):
        for stage in (0, 1, 2, 3):
            dynamo.reset()  # each run counts its own compilations
            model = gpt2()
            if how == "model":
                model.compile()
            else:
                for block in model.transformer.h:
                    block.compile()
            engine, losses = train(model, stage, rank, world_size)
            graphs = dynamo.utils.counters["stats"]["unique_graphs"]
            what = f"compiled {how}, stage {stage}"
            assert graphs > 0, f"{what}: nothing was compiled"
            check(engine, losses, expected, what)
            more_losses = run_steps(engine, data(world_size)[:2], rank)  # after these: no recompiling
            assert dynamo.utils.counters["stats"]["unique_graphs"] == graphs, f"{what}: recompiled"
            assert all(torch.isfinite(torch.tensor(more_losses))), what
    for how, stage in (("model", 1), ("blocks", 3)):  # with zeroshard's own checkpoints (ZeRO-R)
        model = gpt2()
        for part in [model] if how == "model" else model.transformer.h:
            part.compile()
        config = {"zero_optimization": {"stage": stage}, "activation_checkpointing": {}}
        engine = zeroshard.initialize(model, sgd, config)
        check(engine, run_steps(engine, data(world_size), rank), expected,
              f"compiled {how} with ZeRO-R checkpoints, stage {stage}")


def _checkpointed(rank: int, world_size: int) -> None:
    expected = reference(world_size)
    for flavour in ("reentrant", "non-reentrant"):
        for stage in (0, 1, 2, 3):
            model, runs = gpt2(flavour), []
            # (the recomputation calls the block's submodules, not the block: count its attention)
            model.transformer.h[0].attn.register_forward_hook(lambda *_: runs.append(1))
            engine, losses = train(model, stage, rank, world_size)
            what = f"HF gradient checkpointing ({flavour}), stage {stage}"
            assert len(runs) == 2 * STEPS, f"{what}: attention ran {len(runs)} times, not recomputed"
            check(engine, losses, expected, what)


def test_compiled_model_and_blocks_at_every_stage():
    spawn(_compiled, 2)


def test_hf_gradient_checkpointing_at_every_stage():
    spawn(_checkpointed, 2)
