"""ZeRO over dp × torch tensor parallelism over tp (4 gloo ranks: dp 2 × tp 2) trains like one process.

Every parameter a tp plan splits is a DTensor whose local shard lives in zeroshard's flat buffers;
the reference is single-process training on the whole global batch. SGD: Adam turns the ~1e-9
gradient differences of tp's summation order into whole learning-rate steps where the gradient is
nearly zero (the attention's key bias), so it would measure Adam, not the composition.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

import zeroshard
from helpers.margins import SIXTEEN_BIT_ATOL, SIXTEEN_BIT_LOSS_RTOL, SIXTEEN_BIT_RTOL, close
from helpers.models import TinyGPT, VOCAB, assert_matches_reference, batches, loss_fn, reference_run
from helpers.spawn import spawn

STEPS, GLOBAL_BATCH = 3, 8
TINY_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise", "twice.up": "colwise",
             "twice.down": "rowwise"}


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.01)


def tiny(seed: int = 0) -> TinyGPT:
    torch.manual_seed(seed)
    return TinyGPT()


class Llama(nn.Module):
    """An HF Llama called like TinyGPT (x, use_sometimes) -> logits, split by its own plan."""

    def __init__(self, seed: int = 0, heads: int = 4, lm: nn.Module | None = None) -> None:
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=VOCAB, hidden_size=8 * heads, intermediate_size=64,
                             num_hidden_layers=2, num_attention_heads=heads,
                             num_key_value_heads=heads if heads % 2 else 2, max_position_embeddings=16)
        self.lm = lm or LlamaForCausalLM(config)

    def forward(self, x: torch.Tensor, use_sometimes: bool = True) -> torch.Tensor:
        return self.lm(input_ids=x).logits


def mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def train(engine, dp_rank: int, dp: int, steps: range, dtype=torch.float32) -> list[float]:
    """Steps `steps` of the shared batch sequence on this dp rank's slice; the global mean losses."""
    local = GLOBAL_BATCH // dp
    losses = []
    for step, (x, y) in list(enumerate(batches(max(steps) + 1, GLOBAL_BATCH)))[steps.start:]:
        mine = slice(dp_rank * local, (dp_rank + 1) * local)
        loss = loss_fn(engine(x[mine], use_sometimes=step % 2 == 0).float(), y[mine])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    dist.all_reduce(stacked)  # tp ranks hold the same loss: the world mean is the dp mean
    return (stacked / dist.get_world_size()).tolist()


def _replicated_agree_over_tp(engine, mesh) -> None:
    """Parameters not split over tp hold bit-identical values on every tp rank."""
    for name, p in engine.module.named_parameters():
        if isinstance(p, DTensor) and any(isinstance(pl, Shard) for pl in p.placements):
            continue
        local = (p._local_tensor if isinstance(p, DTensor) else p).detach().clone()
        if local.numel() == 0:
            continue  # stage 3: freed between steps
        theirs = [torch.empty_like(local) for _ in range(2)]
        dist.all_gather(theirs, local, group=mesh["tp"].get_group())
        assert torch.equal(theirs[0], theirs[1]), f"{name} differs across tp ranks"


def _parity(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    dp_rank = mesh["dp"].get_local_rank()
    ref_model, ref_losses = reference_run(tiny, sgd, STEPS, GLOBAL_BATCH, clip=0.5)
    for stage in range(4):  # each rank builds its model from its own seed: the values are broadcast
        model = zeroshard.tensor_parallel(tiny(seed=rank), mesh["tp"], TINY_PLAN)
        engine = zeroshard.initialize(model, sgd, {"zero_optimization": {"stage": stage},
                                                   "gradient_clipping": 0.5}, mesh=mesh)
        losses = train(engine, dp_rank, 2, range(STEPS))
        assert_matches_reference(engine, losses, ref_model, ref_losses, f"dp2 x tp2 stage {stage}")
        _replicated_agree_over_tp(engine, mesh)
    ref_model, ref_losses = reference_run(Llama, sgd, STEPS, GLOBAL_BATCH, clip=0.5)
    for stage in (1, 3):
        model = Llama(seed=rank)
        zeroshard.tensor_parallel(model.lm, mesh["tp"])  # the model's own base_model_tp_plan
        engine = zeroshard.initialize(model, sgd, {"zero_optimization": {"stage": stage},
                                                   "gradient_clipping": 0.5}, mesh=mesh)
        losses = train(engine, dp_rank, 2, range(STEPS))
        assert_matches_reference(engine, losses, ref_model, ref_losses, f"llama dp2 x tp2 stage {stage}")
    ref_model, ref_losses = reference_run(tiny, sgd, STEPS, GLOBAL_BATCH, dtype=torch.bfloat16)
    engine = zeroshard.initialize(zeroshard.tensor_parallel(tiny(), mesh["tp"], TINY_PLAN), sgd,
                                  {"zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}, mesh=mesh)
    losses = train(engine, dp_rank, 2, range(STEPS))
    close(losses, ref_losses, rtol=SIXTEEN_BIT_LOSS_RTOL, atol=0, what="bf16 dp2 x tp2 losses")
    full = engine.full_state_dict()
    for name, value in ref_model.state_dict().items():
        close(full[name], value, rtol=SIXTEEN_BIT_RTOL, atol=SIXTEEN_BIT_ATOL, what=f"bf16 dp2 x tp2 {name}")


def test_dp2_tp2_matches_single_process_at_every_stage():
    spawn(_parity, 4)
