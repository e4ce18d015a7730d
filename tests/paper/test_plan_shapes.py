"""The planner's model shapes from what a user gives: a Hugging Face config's units are the flat
buffers the engine would build for that model (its own unit rule, counted on the model
transformers builds), a mixture of experts counts the matmuls a token passes through rather than
every expert, and a config the planner cannot weigh is refused by name."""

from __future__ import annotations

import pytest
from torch import nn

from zeroshard.core.units import assign_params, find_units
from zeroshard.paper.estimate import hf_config_params, hf_meta_model
from zeroshard.paper.plan_memory import Setup
from zeroshard.paper.plan_shapes import model_units, shape_from_hf
from zeroshard.paper.plan_time import step_flops

LLAMA = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 96, "vocab_size": 300, "max_position_embeddings": 64,
         "tie_word_embeddings": False}
MIXTRAL = {**LLAMA, "model_type": "mixtral", "num_local_experts": 4, "num_experts_per_tok": 1}
QWEN_MOE = {**LLAMA, "model_type": "qwen2_moe", "num_experts": 6, "num_experts_per_tok": 2,
            "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 300, "n_positions": 64}


def _engine_units(model: nn.Module) -> tuple[int, ...]:
    """The elements of each unit's flat buffer, by the engine's own code (core/units.py)."""
    units = find_units(model, None)
    assigned = assign_params(model, units)
    return tuple(sum(p.numel() for _, p in assigned[u]) for u in units)


class _Shared(nn.Module):
    """A ModuleList inside a block (not units of their own), a weight two blocks share and one a
    block shares with the root: those two belong to the root."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        shared = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.ModuleList([nn.Linear(8, 4)]))
                                    for _ in range(3))
        self.blocks[0].add_module("twice", shared)
        self.blocks[2].add_module("twice", shared)
        self.blocks[1].add_module("tied", self.embed)


@pytest.mark.parametrize("config", [LLAMA, MIXTRAL, QWEN_MOE, GPT2, None])
def test_a_models_units_are_the_engines(config):
    pytest.importorskip("transformers")
    model = hf_meta_model(config, causal_lm=True) if config else _Shared()
    units = model_units(model)
    assert units == _engine_units(model)
    assert sum(units) == sum(p.numel() for p in model.parameters())
    if config:
        shape = shape_from_hf(config)
        assert shape.units == units and shape.psi == sum(units) == hf_config_params(config)
    else:  # the shared Linear (72) and the tied embedding (80) stay in the root
        assert units == (80 + 72, 72 + 36, 72 + 36, 72 + 36)


def test_a_mixture_of_experts_counts_the_experts_a_token_passes_through():
    """Mixtral with one of four experts per token: a token's matmuls are the dense LLaMA's of the
    same sizes and the router's alone, while Ψ holds every expert."""
    pytest.importorskip("transformers")
    dense, moe = shape_from_hf(LLAMA), shape_from_hf(MIXTRAL)
    layers, d, f, experts = 3, 64, 96, 4
    router = layers * d * experts
    assert moe.psi == dense.psi + (experts - 1) * layers * 3 * d * f + router
    assert moe.experts == (4, 1) and moe.idle == (experts - 1) * layers * 3 * d * f and moe.ffn == f
    setup = Setup(3, "bf16", micro_batch=2, seq=32)
    # forward and backward (3), 2 flops a multiply-add, 64 tokens
    assert step_flops(moe, setup) - step_flops(dense, setup) == pytest.approx(3 * 2 * 64 * router)
    # two of six experts and a shared expert: a token passes through both routed ones and the shared one
    qwen = shape_from_hf(QWEN_MOE)
    assert qwen.experts == (6, 2) and qwen.ffn == 2 * 32 + 48
    routed = layers * 6 * 3 * d * 32
    assert qwen.idle == routed - routed * 2 // 6


@pytest.mark.parametrize("config, words", [
    ({"model_type": "t5", "d_model": 64, "d_ff": 128, "num_layers": 2, "num_heads": 4, "vocab_size": 300},
     "no causal-LM class"),
    ({**MIXTRAL, "num_experts_per_tok": 5}, "num_experts_per_tok between 1 and 4"),
    ({"model_type": "llama", "hidden_size": 64}, "model_type 'llama': the planner reads"),
    ({"train_batch_size": 8}, "not a model config"),
    ({**LLAMA, "num_attention_heads": 5}, "transformers refuses this llama config: .*not a multiple"),
])
def test_a_config_the_planner_cannot_weigh_is_refused_by_name(config, words):
    if config.get("model_type"):
        pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=words):
        shape_from_hf(config)



def test_mp_is_weighed_only_where_the_models_own_plan_can_split_it(tmp_path):
    """A Hugging Face model is split by its own tensor-parallel plan: the planner weighs no MP above
    1 where that plan has a style zeroshard does not take (Mixtral's packed experts), saying so, and
    none that does not divide the key/value heads."""
    import argparse
    import json
    from types import SimpleNamespace

    from zeroshard.app.plan import _mp_degrees
    from zeroshard.paper.plan import setups

    pytest.importorskip("transformers")
    hw = SimpleNamespace(device="cuda", per_node=8, ranks=8, nodes=1, nvme=False)
    for config, degrees, words in [(LLAMA, [1, 2], ""), (MIXTRAL, [1], "'packed_colwise' is not supported")]:
        path = tmp_path / f"{config['model_type']}.json"
        path.write_text(json.dumps(config))
        args = argparse.Namespace(hf_config=str(path), mp=None)
        mps, why = _mp_degrees(args, hw)
        weighed = sorted({s.mp for s in setups(shape_from_hf(config), hw, 64, 32, "bf16", mps)})
        assert weighed == degrees and words in why, (config["model_type"], weighed, why)


def test_a_head_tied_by_its_class_default_is_counted_once():
    """Gemma ties its head to the embedding by its config class's default, unwritten in config.json:
    the head's matmul is then the embedding's one matrix, not left out of the flops."""
    pytest.importorskip("transformers")
    gemma = {**LLAMA, "model_type": "gemma", "head_dim": 16}
    gemma.pop("tie_word_embeddings")
    shape = shape_from_hf(gemma)
    assert shape.tied and shape.psi == hf_config_params(gemma)
    untied = shape_from_hf({**gemma, "tie_word_embeddings": False})
    assert not untied.tied and untied.psi == shape.psi + 300 * 64
