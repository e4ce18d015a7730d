"""Stage 3: a module the root unit holds, called on its own rather than through the model's forward,
gathers the root first (T5's generate() runs its encoder itself; `get_input_embeddings()(ids)` for
inputs_embeds; the base model called directly), and under no_grad frees it again."""
from __future__ import annotations

import gc
import os

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


def _direct_calls(rank: int, world_size: int, directory: str) -> None:
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    reference, model = _t5(), _t5()
    # Kept: the hooks hold the engine weakly, and a dropped engine leaves the model's placeholders
    # (its garbage collection, at a moment that depends on allocations, made this test flaky).
    t5_engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    expected = reference.generate(ids, max_new_tokens=4, do_sample=False)
    out = model.generate(ids, max_new_tokens=4, do_sample=False, synced_gpus=True)
    assert torch.equal(out, expected), (out, expected)
    del t5_engine
    gc.collect()  # the engine is gone: its placeholders are named as such, not met as a shape error
    with pytest.raises(RuntimeError, match="sharded by a zeroshard engine .* garbage-collected"):
        model.generate(ids, max_new_tokens=4, do_sample=False, synced_gpus=True)

    reference, model = _llama(), _llama()
    engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    root = engine.units[0]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state
        assert torch.equal(hidden, reference.model(input_ids=ids).last_hidden_state)
    assert not root.unsharded  # what the call gathered, it freed: no backward follows
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
    # DeepSpeed's "gather, then generate on rank 0": unsynced inside, where nothing is gathered
    # (transformers' default for a stage-3 model, synced_gpus, would wait for rank 1 forever)
    with torch.no_grad(), engine.gathered_parameters():
        if rank == 0:
            out = model.generate(ids, max_new_tokens=3, do_sample=False)
            assert torch.equal(out, reference.generate(ids, max_new_tokens=3, do_sample=False)), out
    _save_pretrained(engine, rank, directory, full)


def _save_pretrained(engine, rank: int, directory: str, full: dict) -> None:
    """save_pretrained() outside gathered_parameters() is refused before it writes config.json;
    inside, it saves the full weights."""
    import transformers
    refused, saved = os.path.join(directory, "refused"), os.path.join(directory, "saved")
    with pytest.raises(RuntimeError, match="Nothing was written"):
        engine.module.save_pretrained(refused)
    assert not os.path.exists(refused)
    with engine.gathered_parameters():
        engine.module.save_pretrained(saved, is_main_process=rank == 0)
    engine.comm.barrier()
    reloaded = transformers.LlamaForCausalLM.from_pretrained(saved).state_dict()
    for name, value in full.items():
        assert torch.equal(reloaded[name], value), name


def test_root_modules_called_on_their_own_at_stage_3(tmp_path):
    spawn(_direct_calls, 2, str(tmp_path))


def _layerdrop(rank: int, world_size: int) -> None:
    """wav2vec2 skips each layer with probability `layerdrop`, unless transformers sees the model
    sharded (is_deepspeed_zero3_enabled() or is_fsdp_managed_module()): ranks that drew differently
    would pair one layer's all-gather with another's (wrong weights, silently, for equal sizes)."""
    import transformers
    torch.manual_seed(0)
    config = transformers.Wav2Vec2Config(
        vocab_size=20, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, intermediate_size=64,
        conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
        num_conv_pos_embedding_groups=4, layerdrop=0.5, mask_time_prob=0.0, do_stable_layer_norm=True,
        pad_token_id=0, ctc_loss_reduction="mean")
    model = transformers.Wav2Vec2ForCTC(config)
    ran: list[int] = []
    for i, layer in enumerate(model.wav2vec2.encoder.layers):
        layer.register_forward_pre_hook(lambda module, args, i=i: ran.append(i))
    engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    for step in range(3):
        torch.manual_seed(100 * rank + step)  # each rank draws its own layers to drop
        x, labels = torch.randn(2, 1600), torch.randint(1, 20, (2, 5))
        engine.backward(engine(input_values=x, labels=labels).loss)
        engine.step()
    assert ran == list(range(4)) * 3, ran  # every layer, every step, on every rank
    from transformers.integrations import is_fsdp_managed_module  # what generate() asks for synced_gpus
    assert is_fsdp_managed_module(model) and is_fsdp_managed_module(model.wav2vec2.encoder.layers[0])


def test_transformers_sees_a_stage_3_model_as_sharded(tmp_path):
    spawn(_layerdrop, 2)


def _bart(layerdrop: float):
    import transformers
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=32, encoder_layers=3, decoder_layers=3, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, encoder_layerdrop=layerdrop, decoder_layerdrop=layerdrop))


def _bart_layerdrop(rank: int, world_size: int) -> None:
    """BART draws its layerdrop from the global generator and ignores is_fsdp_managed_module: ranks
    drawing differently would gather different layers (unmatched all-gathers: gloo aborts the
    process). Stage 3 turns layerdrop off; every rank then runs the model a layerdrop-free one is."""
    model, reference = _bart(0.5), _bart(0.0)
    ran: list[str] = []
    for name, layer in model.named_modules():
        if name.endswith(tuple(f"layers.{i}" for i in range(3))):
            layer.register_forward_pre_hook(lambda module, args, name=name: ran.append(name))
    engine = zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
    assert model.model.encoder.layerdrop == model.model.decoder.layerdrop == 0
    for step in range(3):
        torch.manual_seed(100 * rank + step)  # each rank draws its own layers to drop
        ids = torch.randint(3, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        loss = engine(input_ids=ids, labels=ids).loss
        expected = reference(input_ids=ids, labels=ids).loss
        torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
        engine.backward(loss)
        engine.step()
        expected.backward()
        _sgd(reference.parameters()).step()
        reference.zero_grad()
    assert len(ran) == 6 * 3, ran  # every layer, every step, on every rank
    model = _bart(0.5)  # stages 1-2 gather nothing per layer: layerdrop stays
    zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 2}})
    assert model.model.encoder.layerdrop == 0.5
    _resize_refused(model)


def test_bart_layerdrop_is_turned_off_at_stage_3():
    spawn(_bart_layerdrop, 2)


def _counts(model) -> list[int]:
    return [model.num_parameters(only_trainable=t, exclude_embeddings=e) for t in (False, True)
            for e in (False, True)]


def _parameter_counts(rank: int, world_size: int) -> None:
    """num_parameters() (every argument) reads the full shapes at stage 3, not the empty
    placeholders; a tied head counts once, a frozen parameter only without only_trainable."""
    for make in (_t5, _llama):
        model = make()
        next(p for name, p in model.named_parameters() if "norm" in name).requires_grad_(False)
        expected = _counts(model)
        assert len(set(expected)) == 4, expected  # each argument makes a difference here
        zeroshard.initialize(model, _sgd, {"zero_optimization": {"stage": 3}})
        assert all(p.numel() == 0 for p in model.parameters())  # (placeholders: what HF would count)
        assert _counts(model) == expected, (make.__name__, _counts(model), expected)
        _resize_refused(model)


def _resize_refused(model) -> None:
    """resize_token_embeddings(n) after initialize would change a flattened parameter's shape."""
    assert model.resize_token_embeddings() is model.get_input_embeddings()
    same = model.get_input_embeddings().num_embeddings  # len(tokenizer) that changes nothing
    assert model.resize_token_embeddings(same) is model.get_input_embeddings()
    with pytest.raises(RuntimeError, match="Resize before initialize"):
        model.resize_token_embeddings(80)


def test_num_parameters_counts_full_shapes_at_stage_3():
    spawn(_parameter_counts, 3)
