"""The planner's model shapes: what it needs of a decoder (Shape), the GPT-2 and LLaMA families'
(gpt2_shape, llama_shape), and a shape from what a user gives: a Hugging Face config.json, or Ψ
with layers and width. Ψ is counted as `zeroshard estimate` counts it (estimate.hf_config_params); the unit
split (a buffer per block, the rest in the root) is the model's own where transformers builds it
(model_units), else the GPT-2 or LLaMA family's block."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping

from .estimate import gpt2_params, hf_config_params, hf_meta_model, llama_params


@dataclass(frozen=True)
class Shape:
    """What the planner needs of a decoder-only transformer. `units` holds the elements of each flat
    buffer the engine builds (root first, then one per block); `positions` are learned position
    embeddings (GPT-2 family; 0 with rotary positions)."""

    name: str
    family: str  # "gpt2" or "llama"
    layers: int
    width: int
    heads: int
    vocab: int
    ffn: int
    positions: int
    psi: int
    units: tuple[int, ...]
    tied: bool = True  # the output head shares the token embedding
    kv_heads: int = 0  # grouped-query attention's key/value heads (0: one per head)
    # Mixture of experts: (E, k), a token routed to k of E experts; `idle`, the routed experts'
    # parameters its matmuls skip (all but k/E of them); `ffn` is then the MLP width a token passes
    # through (k experts' and any shared expert's)
    experts: tuple[int, int] = (0, 0)
    idle: int = 0
    # What a block saves beyond the family's plain block (a Hugging Face model's code; measured with
    # saved-tensor hooks, tests/paper/test_plan_model.py): MLP-wide tensors saved per token (0: the
    # family's: 2 for GELU, 3 for SwiGLU; GPT-2's "gelu_new", a formula of torch ops, saves 4);
    # norms that compute in fp32 and save that copy (HF's RMSNorm); dropout on the residual stream
    # (its output saved, 2 a block and the embeddings'); dropout on attention probabilities (torch's
    # math attention then keeps the scores, six fp32 copies of heads x s^2 per sequence and block,
    # instead of flash attention's q, k and v).
    mlp_saved: int = 0
    norm_fp32: bool = False
    dropout: bool = False
    attention_dropout: bool = False

    @property
    def mp_divides(self) -> tuple[int, int]:
        """What an MP degree must divide: each rank holds whole heads and key/value heads."""
        return self.heads, self.kv_heads or self.heads

    @property
    def mlp_wide(self) -> int:
        """MLP-wide (ffn) tensors a block saves per token."""
        return self.mlp_saved or (3 if self.family == "llama" else 2)


def gpt2_shape(
    name: str,
    layers: int,
    width: int,
    heads: int,
    vocab: int,
    positions: int,
    ffn: int | None = None,
    tied: bool = True,
    psi: int | None = None,
) -> Shape:
    """A GPT-2-style decoder (the built-in GPT is one: vocab 256, positions = its sequence length)."""
    ffn = ffn or 4 * width
    block = gpt2_params(1, width, 0, 0, ffn) - 2 * width  # (less the final LayerNorm)
    total = gpt2_params(layers, width, vocab, positions, ffn, tied) if psi is None else psi
    return Shape(
        name,
        "gpt2",
        layers,
        width,
        heads,
        vocab,
        ffn,
        positions,
        total,
        (total - layers * block,) + (block,) * layers,
        tied,
    )


def llama_shape(
    name: str,
    layers: int,
    width: int,
    heads: int,
    vocab: int,
    ffn: int,
    kv_heads: int | None = None,
    head_dim: int | None = None,
    tied: bool = False,
    psi: int | None = None,
) -> Shape:
    """A LLaMA-style decoder (rotary positions, RMSNorm, SwiGLU, grouped-query attention)."""
    block = llama_params(1, width, 0, ffn, heads, kv_heads, head_dim, True) - width
    total = llama_params(layers, width, vocab, ffn, heads, kv_heads, head_dim, tied) if psi is None else psi
    return Shape(
        name,
        "llama",
        layers,
        width,
        heads,
        vocab,
        ffn,
        0,
        total,
        (total - layers * block,) + (block,) * layers,
        tied,
        kv_heads or heads,
    )


def _key(config: Mapping, *names: str, default: int | None = None) -> int:
    name = next((n for n in names if config.get(n) is not None), None)
    if name is None:
        if default is not None:
            return default
        kind = config.get("model_type")
        if kind:  # a model, but not one whose sizes are named as a GPT-2- or LLaMA-style decoder's
            raise ValueError(f"model_type {kind!r}: the planner reads a GPT-2- or LLaMA-style decoder's "
                             f"sizes and the config has none of {', '.join(names)}")
        raise ValueError(f"not a model config: it has none of {', '.join(names)}")
    value = config[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def shape_from_hf(config: Mapping, name: str = "hf") -> Shape:
    """A decoder's Shape from its config.json; ValueError naming what is missing or wrong. Where
    transformers knows the model_type, Ψ and the units are counted on its causal-LM class itself
    (model_units), experts included; a model_type with no causal-LM class (an encoder-decoder) is
    refused, as `zeroshard train --hf-config` could not build it."""
    if not isinstance(config, Mapping):
        raise ValueError("not a model config: config.json must hold a JSON object")
    model = hf_meta_model(config, causal_lm=True)
    if model is None and hf_meta_model(config) is not None:
        raise ValueError(f"model_type {config['model_type']!r} has no causal-LM class in transformers (an "
                         f"encoder-decoder): the planner weighs decoder-only models; `zeroshard estimate "
                         f"--hf-config` gives its model states, or plan a decoder of its size with --params")
    layers, width = _key(config, "n_layer", "num_hidden_layers"), _key(config, "n_embd", "hidden_size")
    heads, vocab = _key(config, "n_head", "num_attention_heads"), _key(config, "vocab_size")
    units = model_units(model) if model is not None else None
    psi = sum(units) if units else hf_config_params(config)  # (the causal LM's: `architectures` may
    # name another head, which estimate counts)
    family = "gpt2" if "n_embd" in config or config.get("model_type") == "gpt2" else "llama"
    if family == "gpt2":
        shape = gpt2_shape(
            name,
            layers,
            width,
            heads,
            vocab,
            _key(config, "n_positions", "max_position_embeddings"),
            _key(config, "n_inner", default=4 * width),
            bool(config.get("tie_word_embeddings", True)),
            psi,
        )
    else:
        shape = llama_shape(
            name,
            layers,
            width,
            heads,
            vocab,
            _key(config, *_FFN, default=4 * width if model is not None else None),
            _key(config, "num_key_value_heads", default=heads),
            _key(config, "head_dim", default=width // heads),
            bool(config.get("tie_word_embeddings", False)),
            psi,
        )
    if model is not None:
        shape = replace(shape, units=units, tied=_tied(model), **_experts(config, model))
    return replace(shape, **_hf_block(config, family, model))


def model_units(model) -> tuple[int, ...]:
    """Elements of each flat buffer the engine builds for `model`, root first: every child of an
    nn.ModuleList is a unit (the outermost where lists nest), and a parameter belongs to the one
    unit holding every module that registers it, else to the root (a tied weight). This is
    core/units.py's rule, which the paper floor does not import (a test holds the two together)."""
    from torch import nn

    blocks: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            for child, _ in module.named_children():
                full = f"{name}.{child}" if name else child
                if not any(full.startswith(b + ".") for b in blocks):
                    blocks.append(full)
    registered: dict[int, tuple[int, list[str]]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        registered.setdefault(id(param), (param.numel(), []))[1].append(name)
    sizes = dict.fromkeys(["", *blocks], 0)
    for numel, names in registered.values():
        home = [b for b in blocks if all(n.startswith(b + ".") for n in names)]
        sizes[home[0] if home else ""] += numel
    return tuple(sizes.values())


def _tied(model) -> bool:
    """Whether the output head is the token embedding (a config may leave it to its class's default)."""
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    return head is not None and embedding is not None and head.weight is embedding.weight


_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")
_PER_TOKEN = ("num_experts_per_tok", "experts_per_token", "moe_topk")


def _experts(config: Mapping, model) -> dict:
    """A mixture of experts' Shape fields (Shape.idle, and `ffn` as a token's MLP width), from the
    routed experts' parameters (named `experts`) of the built model; none for a dense model."""
    experts, per_token = (next((config[k] for k in keys if config.get(k)), 0)
                          for keys in (_EXPERTS, _PER_TOKEN))
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in f".{n}")
    if not routed or not experts:
        return {}
    if not 0 < per_token <= experts:
        raise ValueError(f"a mixture of {experts} experts needs num_experts_per_tok between 1 and "
                         f"{experts}, got {per_token!r}")
    expert_ffn = _key(config, "moe_intermediate_size", "intermediate_size")
    shared = config.get("shared_expert_intermediate_size") or config.get("n_shared_experts", 0) * expert_ffn
    return {"experts": (experts, per_token), "idle": routed - routed * per_token // experts,
            "ffn": per_token * expert_ffn + shared}


# f-wide tensors an MLP saves per token with Hugging Face's activation functions, where they differ
# from torch's own kernels (2: the input, and the output the next matmul keeps): "gelu_new", GPT-2's
# default, is a formula of torch ops, each keeping its operands (measured: test_plan_model.py)
_MLP_SAVED = {"gelu_new": 4}


# the MLP's inner width under the names decoders give it (Falcon's default: 4 x width)
_FFN = ("intermediate_size", "ffn_dim", "ffn_hidden_size", "n_inner", "d_ff")


def _hf_block(config: Mapping, family: str, model=None) -> dict:
    """What a Hugging Face block of this family saves beyond the planner's plain block (Shape).
    Beyond GPT-2, read off the built model where there is one: a gated MLP (a `gate_proj` or
    `gate_up_proj`) keeps three f-wide tensors, a plain one (GPT-NeoX, Falcon) two, one with ReLU
    (OPT); RMSNorm keeps an fp32 copy of its input, LayerNorm does not."""
    if family == "gpt2":
        act = config.get("activation_function", "gelu_new")
        dropout = any(config.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop"))
        return {"mlp_saved": _MLP_SAVED.get(act, 2), "dropout": dropout,
                "attention_dropout": bool(config.get("attn_pdrop", 0.1))}
    block = {"norm_fp32": True, "attention_dropout": bool(config.get("attention_dropout", 0.0))}
    if model is not None:
        names = [name for name, _ in model.named_parameters()]
        gated = any(part in name for name in names for part in ("gate_proj", "gate_up_proj"))
        norms = {type(m).__name__ for m in model.modules() if "norm" in type(m).__name__.lower()}
        built = model.config  # (the class's defaults filled in)
        act = getattr(built, "hidden_act", None) or getattr(built, "activation_function", None)
        plain = 1 if act == "relu" else _MLP_SAVED.get(act, 2)  # (ReLU's backward needs its output alone)
        block.update(mlp_saved=3 if gated else plain, norm_fp32=any("RMSNorm" in n for n in norms))
    return block


def shape_from_params(psi: float, layers: int, width: int, heads: int, vocab: int, seq: int) -> Shape:
    """A GPT-2-style decoder of Ψ parameters: the root holds the embeddings (tied head) and the final
    norm; the rest is shared evenly by the blocks (whatever their inner widths)."""
    shape = gpt2_shape(f"{psi:.3g}", layers, width, heads, vocab, seq)
    root = shape.units[0]
    if psi < root + layers * 4 * width:
        raise ValueError(
            f"--params {psi:.4g} is fewer than the embeddings of width {width} hold with "
            f"{layers} layers ({root + layers * 4 * width:.4g}): give more parameters, or less width"
        )
    block = (int(psi) - root) // layers
    ffn = max(1, (block - 4 * width * width - 13 * width) // (2 * width + 1))  # the MLP's hidden width
    return replace(shape, ffn=ffn, psi=int(psi), units=(int(psi) - layers * block,) + (block,) * layers)
