"""Hugging Face integration: `ZeroTrainer` (transformers.Trainer on zeroshard, trainer.py), and
any causal-LM architecture built from a local config.json with fresh weights.

Nothing is downloaded: the config is read from disk and the model is initialised from scratch, so
`zeroshard train --hf-config config.json` trains, say, a small LLaMA or GPT-2 on the byte corpus.
transformers is an optional dependency (pip install 'zeroshard[hf]'): importing this module does not
import it; `zeroshard.hf.ZeroTrainer` does, on first use.
"""
from __future__ import annotations

import contextlib
import json
import os
from typing import Any

import torch
from torch import nn


def __getattr__(name: str) -> Any:
    if name == "ZeroTrainer":  # lazily: transformers is imported only when it is asked for
        from .trainer import ZeroTrainer
        return ZeroTrainer
    raise AttributeError(f"module 'zeroshard.hf' has no attribute {name!r}")


def causal_lm_from_config(path: str, seq_len: int, device: str | torch.device | None = None) -> nn.Module:
    """The causal LM a config.json (or the model folder holding one) describes, with fresh fp32
    weights: what `zeroshard train --hf-config` trains. ValueError naming what it refuses: a
    sequence beyond the model's context, a vocabulary too small for byte-level data, a model_type
    transformers does not know, an encoder-decoder, or an encoder whose causal-LM class attends to
    later tokens. `device="meta"` checks all of that without allocating (`zeroshard plan`)."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        raise RuntimeError("--hf-config needs the transformers package: "
                           "pip install 'zeroshard[hf]'") from None
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"--hf-config: '{file}' does not exist")
    with open(file) as f:
        raw = json.load(f)
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"--hf-config: '{file}' has no \"model_type\" (e.g. \"gpt2\", \"llama\")")
    config = _config_of(raw, file)
    config.use_cache = False  # training: no key/value cache in the outputs
    context = context_of(config)
    if context is not None and context < seq_len:
        raise ValueError(f"--seq-len {seq_len} exceeds the model's context ({context}) in '{file}'")
    if getattr(config, "vocab_size", 256) < 256:
        raise ValueError(f"'{file}' has vocab_size {config.vocab_size}; byte-level data needs >= 256")
    # fp32 weights whatever the file's dtype (real configs say "bfloat16"): --precision decides what
    # the model computes in, and the masters start from full-precision initial values.
    try:
        with torch.device(device) if device is not None else contextlib.nullcontext():
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        raise ValueError(f"--hf-config: '{file}' is a {config.model_type}, which has no causal-LM class in "
                         f"transformers (an encoder-decoder): train a decoder-only model") from None
    _refuse_bidirectional(model, file)
    return model


def _refuse_bidirectional(model: nn.Module, file: str) -> None:
    """An encoder's causal-LM class (BERT's BertLMHeadModel, RoBERTa's, XLM's) attends to later
    tokens unless its config says it is a decoder: next-token training would then see its targets.
    Whether a family is an encoder: it has a masked-LM class. A seq2seq family's causal-LM class is
    its decoder, which sets is_decoder itself (BART's)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_MASKED_LM_MAPPING_NAMES

    config = model.config
    if config.model_type in MODEL_FOR_MASKED_LM_MAPPING_NAMES and not (
            getattr(config, "is_decoder", False) or getattr(config, "causal", False)):
        raise ValueError(f"--hf-config: '{file}' is a {config.model_type}, an encoder: its causal-LM class "
                         f"({type(model).__name__}) lets each token attend to the tokens after it, so "
                         f"next-token training would see its targets. Set \"is_decoder\": true in the "
                         f"config (causal attention), or train a decoder-only model")


def context_of(config) -> int | None:
    """The longest sequence a transformers config's model takes (None: no such limit)."""
    return getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)


def context_of_file(raw: dict, file: str) -> int | None:
    """context_of() for a config.json's keys, class defaults included, as --hf-config builds it (the
    keys as they are where transformers is missing or refuses them)."""
    try:
        return context_of(_config_of(dict(raw), file))
    except (ImportError, ValueError):
        return raw.get("n_positions") or raw.get("max_position_embeddings")


def _config_of(raw: dict, file: str):
    """transformers' config from a config.json's keys; ValueError naming a model_type transformers
    does not know or a value it refuses (its validation errors are not ValueErrors)."""
    import transformers

    kind = raw.pop("model_type")
    if kind not in transformers.CONFIG_MAPPING:
        raise ValueError(f"--hf-config: '{file}' has model_type {kind!r}, which transformers "
                         f"{transformers.__version__} does not know (check the spelling, or a newer "
                         f"transformers may)")
    try:
        return transformers.AutoConfig.for_model(kind, **raw)
    except Exception as e:
        raise ValueError(f"--hf-config: transformers refuses '{file}': {' '.join(str(e).split())}") from None
