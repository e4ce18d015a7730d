"""Stage 3: a module the root unit holds, called on its own rather than through the model's forward,
gathers the root first (T5's generate() runs its encoder itself; `get_input_embeddings()(ids)` for
inputs_embeds; the base model called directly), and under no_grad frees it again."""
from __future__ import annotations

import pytest
import torch

import zeroshard
from helpers.spawn import spawn

pytest.importorskip("transformers")


def _t5():
    import transformers
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1))


def _llama():
    import transformers
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def _direct_calls(rank: int, world_size: int) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    reference, model = _t5(), _t5()
    zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, synced_gpus=True)
    assert torch.equal(out, expected), (out, expected)

    reference, model = _llama(), _llama()
    engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    root = engine.units[0]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        assert torch.equal(hidden, reference.model(input_ids=ids).last_hidden_state)
    assert not root.gathered  # what the call gathered, it freed: no backward follows
    # inputs_embeds from the embedding called on its own, then a training step through the engine.
    loss = engine(inputs_embeds=model.get_input_embeddings()(ids), labels=ids).loss
    expected = reference(inputs_embeds=reference.get_input_embeddings()(ids), labels=ids).loss
    assert torch.equal(loss, expected), (loss, expected)
    engine.backward(loss)
    engine.step()
    expected.backward()  # every rank trains on the same ids: the mean gradient is this one
    _sgd(reference.parameters()).step()
    full = engine.full_state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(full[name], value, rtol=1e-5, atol=1e-6, msg=name)


def test_root_modules_called_on_their_own_at_stage_3():
    spawn(_direct_calls, 2)
