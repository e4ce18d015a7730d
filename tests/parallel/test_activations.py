"""ZeRO-R activation checkpoints (P_a, P_a+cpu, MD) on dp 2 × tp 2: parity with one process in every
combination, and the saved block inputs measured from outside the library."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import zeroshard
from helpers.models import SEQ, assert_matches_reference, reference_run
from helpers.spawn import spawn
from test_tensor_parallel import GLOBAL_BATCH, STEPS, TINY_PLAN, mesh_2x2, sgd, tiny, train

WIDTH, BLOCKS = 16, 2  # TinyGPT(): two checkpointed blocks of width 16


def _saved_bytes(engine, x) -> int:
    """Bytes autograd saves for one forward (every tensor its pack hook sees, each storage once)."""
    seen: dict[tuple, int] = {}

    def pack(saved: torch.Tensor):
        t = saved._local_tensor if isinstance(saved, DTensor) else saved
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), t.numel())
        seen[key] = t.numel() * t.element_size()
        return saved
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = engine(x).float().sum()
    engine.backward(loss * 0)  # completes the cycle (nothing changes: the gradients are zero)
    engine.module.zero_grad(set_to_none=True)
    engine.step()
    return sum(seen.values())


def _combinations(rank: int, world_size: int) -> None:
    mesh = mesh_2x2()
    dp_rank = mesh["dp"].get_local_rank()
    ref_model, ref_losses = reference_run(tiny, sgd, STEPS, GLOBAL_BATCH, clip=0.5)
    local = GLOBAL_BATCH // 2
    input_bytes = local * SEQ * WIDTH * 4  # one block input, fp32
    saved = {}
    for stage, (part, cpu, md) in [(3, c) for c in itertools.product([False, True], repeat=3)] + \
            [(1, (True, True, True))]:
        section = {"partition_activations": part, "cpu_checkpointing": cpu,
                   "contiguous_memory_optimization": md, "number_checkpoints": BLOCKS}
        model = zeroshard.tensor_parallel(tiny(), mesh["tp"], TINY_PLAN)
        config = {"zero_optimization": {"stage": stage}, "gradient_clipping": 0.5,
                  "activation_checkpointing": section}
        engine = zeroshard.initialize(model, sgd, config, mesh=mesh)
        what = f"stage {stage} P_a={part} cpu={cpu} MD={md}"
        losses = train(engine, dp_rank, 2, range(STEPS))
        assert_matches_reference(engine, losses, ref_model, ref_losses, what)
        kept = BLOCKS * input_bytes // (2 if part else 1)
        stats = engine.memory_stats()
        assert stats["checkpointed_activations_host" if cpu else "checkpointed_activations"] == kept, what
        assert stats["checkpointed_activations" if cpu else "checkpointed_activations_host"] == 0, what
        gathers = engine.comm_stats()["activation_all_gather"]
        assert gathers["calls"] == (STEPS * BLOCKS if part else 0), what
        x = torch.randint(0, 37, (local, SEQ))
        saved[(stage, part, cpu, md)] = _saved_bytes(engine, x)
    # Measured from autograd's side: P_a keeps 1/TP of each block input, the rest is unchanged.
    for cpu, md in itertools.product([False, True], repeat=2):
        whole, split = saved[(3, False, cpu, md)], saved[(3, True, cpu, md)]
        assert whole - split == BLOCKS * input_bytes // 2, (cpu, md, whole, split)
    dist.barrier()


def test_partitioned_offloaded_contiguous_checkpoints_match_single_process():
    spawn(_combinations, 4)


class _DropoutStack(torch.nn.Module):
    """Blocks with dropout (each a unit, so each is checkpointed): the recompute must draw the
    masks the forward drew."""

    def __init__(self, d: int = 16, blocks: int = 3) -> None:
        super().__init__()
        self.tok = torch.nn.Embedding(37, d)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(d, 2 * d), torch.nn.Dropout(0.5), torch.nn.GELU(),
                                torch.nn.Linear(2 * d, d)) for _ in range(blocks))
        self.head = torch.nn.Linear(d, 37)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _dropout_recompute(rank: int, world_size: int, autocast: bool) -> None:
    """Dropout draws the same masks, and (forward under torch.autocast, backward outside it, as
    usual) the recompute runs in the forward's precision. With the embedding frozen (a LoRA
    fine-tune's layout) no block's input needs a gradient: the blocks train all the same."""
    for frozen in (False, True):
        _recompute_against_plain(rank, autocast, frozen)


def _recompute_against_plain(rank: int, autocast: bool, frozen: bool) -> None:
    results = {}
    for checkpointed in (False, True):
        torch.manual_seed(0)
        config = {"zero_optimization": {"stage": 3}}
        if checkpointed:
            config["activation_checkpointing"] = {"number_checkpoints": 3}
        model = _DropoutStack()
        model.tok.requires_grad_(not frozen)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        engine = zeroshard.initialize(model, sgd, config)
        torch.manual_seed(rank)  # once: the recompute must neither change nor advance the stream
        for step in range(3):
            x = torch.randint(0, 37, (4, SEQ), generator=torch.Generator().manual_seed(step + 10 * rank))
            with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
                logits = engine(x)
            engine.backward(torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten()))
            engine.step()
        results[checkpointed] = engine.full_state_dict()
        if checkpointed:
            assert engine.memory_stats()["checkpointed_activations"] > 0  # it did checkpoint
    plain, recomputed = results[False], results[True]
    assert all(torch.equal(plain[k], recomputed[k]) for k in plain), \
        f"activation checkpointing (autocast {autocast}, frozen {frozen}) trained differently from without it"
    assert not torch.equal(recomputed["blocks.0.0.weight"], initial["blocks.0.0.weight"])  # (it trained)


@pytest.mark.parametrize("autocast", [False, True])
def test_the_recompute_draws_the_same_masks_in_the_same_precision(autocast):
    spawn(_dropout_recompute, 2, autocast)


def _hf_model(arch: str) -> torch.nn.Module:
    """A tiny Hugging Face model as its config builds it (use_cache on, as by default)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=37, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=32))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(  # its blocks take the cache positionally
        vocab_size=37, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_hf_blocks_recompute_without_their_kv_cache(one_process_group, arch):
    """A block recomputed in backward must not append to the KV cache a second time (HF models
    pass one while use_cache is on): checkpointed training equals training without checkpoints."""
    runs = {}
    for checkpointed in (False, True):
        config = {"zero_optimization": {"stage": 3}}
        if checkpointed:
            config["activation_checkpointing"] = {"number_checkpoints": 2}
        engine = zeroshard.initialize(_hf_model(arch), sgd, config)
        x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(1))
        for _ in range(2):
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        runs[checkpointed] = engine.get_global_grad_norm(), engine.full_state_dict()
        if checkpointed:
            assert engine.memory_stats()["checkpointed_activations"] > 0  # it did checkpoint
    (norm, plain), (norm_ckpt, recomputed) = runs[False], runs[True]
    assert norm_ckpt == pytest.approx(norm, rel=1e-6)
    for name, value in plain.items():
        torch.testing.assert_close(recomputed[name], value, rtol=1e-6, atol=1e-7, msg=name)


def test_a_model_with_no_block_to_checkpoint_is_told(one_process_group, caplog):
    """The section asked for checkpoints; a model with no ModuleList has no unit to checkpoint."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    engine = zeroshard.initialize(model, sgd, {"activation_checkpointing": {}})
    assert "the model has no blocks to checkpoint" in caplog.text
    engine.backward(engine(torch.ones(2, 4)).sum())
    assert engine.memory_stats()["checkpointed_activations"] == 0


def test_host_checkpoints_prefetch_only_chunks_not_yet_restored(monkeypatch):
    """P_a+cpu on CUDA copies the next recompute's chunk back while a block recomputes. With blocks
    that keep two inputs each, the chunk just before a block's second input is its own first one,
    restored already: it was copied again and never taken, one device copy leaked per block and
    step, and keyed by an id that a later chunk reuses, it could come back as that chunk's values.
    Here the CUDA branch runs on the CPU (a device that says it is cuda, chunks that say they are
    pinned): every restore returns its own values and nothing is left on the way back."""
    from types import SimpleNamespace

    from zeroshard.parallel.activations import CheckpointStore

    class Cuda:
        type = "cuda"

    cfg = SimpleNamespace(partition_activations=False, cpu_checkpointing=True,
                          contiguous_memory_optimization=False, number_checkpoints=None)
    store = CheckpointStore(cfg, SimpleNamespace(tp_size=1, tp_rank=0, device=torch.device("cpu")))
    store.device = Cuda()
    store._allocate = lambda numel, dtype: torch.empty(numel, dtype=dtype)
    copies = []
    to = torch.Tensor.to
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: True)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, *a, **k: copies.append(self) or self.clone()
                        if a and isinstance(a[0], Cuda) else to(self, *a, **k))
    for step in range(3):
        kept = [store.keep(torch.full((4,), 10.0 * step + i)) for i in range(4)]  # 2 blocks x 2 inputs
        copies.clear()
        for block in (1, 0):  # backward: the blocks in reverse, each block's inputs in order
            for chunk in kept[2 * block:2 * block + 2]:
                assert torch.equal(store.restore(chunk, torch.Size([4])), chunk), step
        assert len(copies) == 4 and not store._ahead, (step, len(copies), store._ahead)  # each once
        del kept, chunk
