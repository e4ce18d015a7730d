"""The paper's analytic memory model: per-rank model-state bytes, and its Tables 1 and 2 recomputed.

Ψ parameters, `nproc` GPUs split into MP-way model parallelism and DP = nproc / MP data-parallel
ranks. Model parallelism splits every model state MP ways; ZeRO then shards what its stage covers
DP ways (formulas.paper_model_state_bytes holds that formula; everything here goes through it).
Precision sets bytes per parameter: fp32 Adam p = g = 4, k = 8; bf16/fp16 mixed-precision Adam
p = g = 2, k = 12 (fp32 master weights, momentum, variance). GB = 1e9 bytes, GiB = 2**30.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from decimal import ROUND_DOWN, ROUND_HALF_UP, Decimal
from typing import Mapping

from .formulas import BYTES_PER_PARAM, paper_model_state_bytes

GB, GIB = 10**9, 2**30


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds. Invariant: device + host + disk == total + transfer."""

    params: float
    grads: float
    optimizer: float
    offload_optimizer: bool = False
    offload_param: bool = False   # stage 3 only: the parameter shards rest on the host
    transfer: float = 0.0         # offload's host buffers: the gradient's and the update's copies
    disk_optimizer: bool = False  # ZeRO-Infinity: the offloaded optimizer state rests on disk
    disk_param: bool = False      # ... and the offloaded parameter shards

    @property
    def disk(self) -> float:
        return (self.optimizer if self.offload_optimizer and self.disk_optimizer else 0.0) + \
            (self.params if self.offload_param and self.disk_param else 0.0)

    @property
    def host(self) -> float:
        return (self.optimizer if self.offload_optimizer else 0.0) + \
            (self.params if self.offload_param else 0.0) + self.transfer - self.disk

    @property
    def device(self) -> float:
        return self.total + self.transfer - self.host - self.disk

    @property
    def total(self) -> float:
        return self.params + self.grads + self.optimizer


def model_states(psi: float, nproc: int, stage: int, precision: str = "bf16",
                 offload_optimizer: bool = False, mp: int = 1, offload_param: bool = False,
                 disk: bool = False) -> ModelStates:
    """Per-rank model states for Ψ = `psi` parameters on `nproc` GPUs with MP-way model parallelism.

    Each category is the paper's formula with the other two byte counts set to zero, so the sum is
    exactly paper_model_state_bytes(psi / mp, nproc / mp, stage, p, g, k). Offload (ZeRO-Offload
    style) moves the optimizer state, fp32 master weights included, to host memory; what is sharded
    stays sharded, so the host holds the same kΨ/N per rank the device would have, plus zeroshard's
    transfer buffers: the reduced gradient's copy (g bytes per owned parameter) and the update's on
    its way up (p bytes; none where the parameter shards themselves are on the host). Parameter
    offload applies at stage 3, the one stage that shards parameters. With `disk` (ZeRO-Infinity's
    NVMe offload) what is offloaded rests on disk instead; the host keeps the transfer buffers (and
    the step's few streaming buffers, a constant that is not modelled here).
    """
    if psi < 0:
        raise ValueError(f"parameter count must be >= 0, got {psi}")
    if nproc < 1 or mp < 1 or nproc % mp:
        raise ValueError(f"nproc ({nproc}) must be a positive multiple of mp ({mp})")
    p, g, k = BYTES_PER_PARAM[precision]
    slice_psi, dp = psi / mp, nproc // mp
    params_on_host = offload_param and stage == 3
    owned = slice_psi / dp if stage >= 1 else slice_psi
    transfer = owned * (g + (0 if params_on_host else p)) if offload_optimizer and stage >= 1 else 0.0
    return ModelStates(paper_model_state_bytes(slice_psi, dp, stage, p, 0, 0),
                       paper_model_state_bytes(slice_psi, dp, stage, 0, g, 0),
                       paper_model_state_bytes(slice_psi, dp, stage, 0, 0, k), offload_optimizer,
                       params_on_host, transfer, disk, disk)


def max_params(device_bytes: float, gpus: int, mp: int, stage: int, precision: str = "bf16") -> float:
    """Largest Ψ whose per-GPU model states fit in `device_bytes` (Table 2): states are linear in Ψ."""
    return device_bytes / model_states(1.0, gpus, stage, precision, mp=mp).total


# ---- parameter counts ---------------------------------------------------------------------------
# Analytic, so a 70B config costs nothing to count. Two decoder families cover the common configs:
# GPT-2 (learned positions, LayerNorm and biases everywhere, 4d GELU MLP) and LLaMA (rotary
# positions, RMSNorm, no biases, gated SwiGLU MLP, grouped-query attention).

def gpt2_params(layers: int, width: int, vocab_size: int, positions: int, ffn: int | None = None,
                tied: bool = True) -> int:
    """Parameters of a GPT-2-style decoder; zeroshard.app.gpt.GPT has exactly this shape (ffn = 4d)."""
    d, f = width, ffn or 4 * width
    attention = 3 * d * d + 3 * d + d * d + d  # q, k, v and output projections, with biases
    mlp = d * f + f + f * d + d
    block = attention + mlp + 2 * 2 * d  # two LayerNorms, weight and bias
    embeddings = (vocab_size + positions) * d + (0 if tied else vocab_size * d)
    return layers * block + embeddings + 2 * d  # + final LayerNorm


def llama_params(layers: int, width: int, vocab_size: int, ffn: int, heads: int,
                 kv_heads: int | None = None, head_dim: int | None = None, tied: bool = False) -> int:
    """Parameters of a LLaMA-style decoder (no biases; k and v shrink with grouped-query attention)."""
    d = width
    hd = head_dim or d // heads
    attention = 2 * d * heads * hd + 2 * d * (kv_heads or heads) * hd  # q, o and k, v
    block = attention + 3 * d * ffn + 2 * d  # gate, up, down; two RMSNorm weights
    return layers * block + vocab_size * d * (1 if tied else 2) + d  # + final RMSNorm


_EXPERT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def hf_model_params(config: Mapping) -> int | None:
    """Ψ counted on the architecture itself (hf_meta_model), tied weights counted once. Exact for any
    family transformers knows (MoE experts, encoders, encoder-decoders); None without transformers or
    a model_type it knows."""
    model = hf_meta_model(config)
    return None if model is None else sum(p.numel() for p in model.parameters())


def hf_meta_model(config: Mapping, causal_lm: bool = False):
    """The model transformers builds from `config` on the meta device (shapes, no memory): the class
    its `architectures` names, else its causal-LM class, else its base model; with `causal_lm`, its
    causal-LM class alone (what `zeroshard train --hf-config` builds). None without transformers, a
    model_type it knows, or (with `causal_lm`) a causal-LM class for it."""
    kind = config.get("model_type")
    if not kind:  # (before importing transformers, which takes seconds)
        return None
    try:
        import torch
        import transformers
    except ImportError:
        return None
    if kind not in transformers.CONFIG_MAPPING:  # a family this transformers does not know
        return None
    try:
        hf = transformers.AutoConfig.for_model(kind, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as e:  # (its validation errors are not ValueErrors) a value it refuses, by name
        raise ValueError(f"transformers refuses this {kind} config: {_first_line(e)}") from None
    named = [] if causal_lm else [getattr(transformers, name, None) for name in (hf.architectures or [])]
    bases = [transformers.AutoModelForCausalLM] + ([] if causal_lm else [transformers.AutoModel])
    with torch.device("meta"):
        for cls in [*filter(None, named), *bases]:
            try:
                return cls.from_config(hf) if cls.__name__.startswith("Auto") else cls(hf)
            except Exception as e:
                if isinstance(e, ValueError) and "Unrecognized configuration class" in str(e):
                    continue  # no such class for it (an encoder-decoder has no causal-LM class)
                raise ValueError(f"transformers cannot build this {kind} config: {_first_line(e)}") from None
    return None


def _first_line(error: Exception) -> str:
    """An exception's message on one line (validation errors wrap theirs over several)."""
    return " ".join(str(error).split())


def hf_config_params(config: Mapping) -> int:
    """Ψ of a Hugging Face `config.json`: counted on the model transformers builds from it (see
    hf_model_params), else by formula: GPT-2 family when it has `n_embd` (or model_type gpt2), else
    LLaMA family. A missing or non-positive size raises ValueError naming the key; a config the
    formulas do not describe (experts) raises rather than be counted as a dense model."""
    counted = hf_model_params(config)
    if counted is not None:
        return counted
    experts = [k for k in _EXPERT_KEYS if config.get(k)]
    if experts:
        raise ValueError(f"the config has experts ({experts[0]}): counting them needs its model_type "
                         f"known to transformers (pip install transformers), or give --params")
    def key(*names: str, default: int | None = None) -> int:
        name = next((n for n in names if config.get(n) is not None), None)
        if name is None and default is not None:
            return default
        if name is None:
            raise ValueError(f"config has none of: {', '.join(names)}")
        value = config[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
        return value

    layers, width = key("n_layer", "num_hidden_layers"), key("n_embd", "hidden_size")
    vocab = key("vocab_size")
    if "n_embd" in config or config.get("model_type") == "gpt2":
        return gpt2_params(layers, width, vocab, key("n_positions", "max_position_embeddings"),
                           key("n_inner", default=4 * width), bool(config.get("tie_word_embeddings", True)))
    heads = key("num_attention_heads")
    return llama_params(layers, width, vocab, key("intermediate_size"), heads,
                        key("num_key_value_heads", default=heads), key("head_dim", default=width // heads),
                        bool(config.get("tie_word_embeddings", False)))


def hf_config_file(path: str | os.PathLike) -> str:
    """A Hugging Face config's file: `path` itself, or the config.json of the model folder it names."""
    return os.path.join(path, "config.json") if os.path.isdir(path) else os.fspath(path)


def load_hf_config(path: str | os.PathLike) -> int:
    """Ψ of the config at `path` (a config.json, or the model folder holding one); OSError /
    ValueError when it cannot be read or understood."""
    with open(hf_config_file(path), encoding="utf-8") as f:
        config = json.load(f)  # json.JSONDecodeError is a ValueError
    if not isinstance(config, dict):
        raise ValueError("config.json must hold a JSON object")
    return hf_config_params(config)


# ---- the paper's tables ---------------------------------------------------------------------------
# Printing conventions read off the paper (every cell is checked in tests/paper/test_estimate.py):
# Table 1 truncates values >= 100 to integers (4187.5 -> 4187) and rounds the rest half-up, to one
# decimal from 10 up (41.25 -> 41.3, not Python's round-half-even 41.2) and to two below (1.875 -> 1.88,
# 0.46875 -> 0.47); trailing zeros are dropped (30, 7.5).
# Table 2 rounds one model-parallel slice's capacity (N = 64) to 0.1B and multiplies the printed
# figure by MP (7.6B -> 15.2B, though 2 x 7.64B = 15.28B); from 0.5T up it prints T to one decimal.

TABLE1_PSI = (7.5e9, 128e9, 1e12)
TABLE1_N = (1, 4, 16, 64, 256, 1024)
TABLE2_MP = (1, 2, 4, 8, 16)
TABLE2_DP, TABLE2_DEVICE_BYTES = 64, 32 * GB


def _plain(value: Decimal) -> str:
    """A Decimal without exponent or trailing zeros: 30.0 -> '30', 7.50 -> '7.5'."""
    text = format(value, "f")
    return text.rstrip("0").rstrip(".") if "." in text else text


def paper_gb(gb: float) -> str:
    """Format GB as Table 1 prints it."""
    value = Decimal(repr(gb))  # the shortest repr, so 41.25 stays a tie and rounds half-up
    if value >= 100:
        return _plain(value.to_integral_value(ROUND_DOWN))
    step = Decimal("0.1") if value >= 10 else Decimal("0.01")
    return _plain(value.quantize(step, ROUND_HALF_UP))


def table1() -> dict[tuple[float, int, int], str]:
    """Table 1: {(Ψ, N, stage 1-3): GB per device}, mixed precision (K = 12), as the paper prints."""
    return {(psi, n, stage): paper_gb(model_states(psi, n, stage).total / GB)
            for psi in TABLE1_PSI for n in TABLE1_N for stage in (1, 2, 3)}


def paper_params(psi: float, mp: int = 1) -> str:
    """Format a Table 2 capacity: the MP = 1 slice (Ψ / mp) rounded to 0.1B, times mp."""
    slice_b = Decimal(repr(psi / mp / 1e9)).quantize(Decimal("0.1"), ROUND_HALF_UP)
    billions = slice_b * mp
    if billions >= 500:
        return _plain((billions / 1000).quantize(Decimal("0.1"), ROUND_HALF_UP)) + "T"
    return _plain(billions) + "B"


def table2() -> dict[tuple[int, int], str]:
    """Table 2 (theoretical): {(MP, stage 0-3): largest model on 32 GB GPUs}, GPUs = 64 x MP."""
    return {(mp, stage): paper_params(max_params(TABLE2_DEVICE_BYTES, TABLE2_DP * mp, mp, stage), mp)
            for mp in TABLE2_MP for stage in (0, 1, 2, 3)}


def table1_text() -> str:
    """Table 1 laid out as in the paper: a row per N, P_os / P_os+g / P_os+g+p per Ψ."""
    cells = table1()
    head = "N".rjust(5) + "".join(f"{'Ψ = ' + paper_params(psi):>24}" for psi in TABLE1_PSI)
    rows = ["Per-device model-state memory (GB), P_os / P_os+g / P_os+g+p, K = 12", head]
    for n in TABLE1_N:
        rows.append(f"{n:>5}" + "".join(f"{' / '.join(cells[psi, n, s] for s in (1, 2, 3)):>24}"
                                        for psi in TABLE1_PSI))
    return "\n".join(rows)


def table2_text() -> str:
    """Table 2's theoretical columns: a row per MP degree."""
    cells = table2()
    rows = ["Largest model on 32 GB GPUs (theoretical), K = 12, DP degree = GPUs / MP = 64",
            f"{'MP':>3} {'GPUs':>5} {'baseline':>9} {'P_os':>8} {'P_os+g':>8} {'P_os+g+p':>9}"]
    for mp in TABLE2_MP:
        c = [cells[mp, s] for s in (0, 1, 2, 3)]
        rows.append(f"{mp:>3} {TABLE2_DP * mp:>5} {c[0]:>9} {c[1]:>8} {c[2]:>8} {c[3]:>9}")
    return "\n".join(rows)


def _units(nbytes: float) -> tuple[str, float, str, float]:
    """Decimal and binary units that keep `nbytes` readable in a table: GB/GiB down to kB/KiB."""
    exp = 3 if nbytes >= 1e9 else 2 if nbytes >= 1e6 else 1
    return "kMG"[exp - 1] + "B", 1000.0**exp, "KMG"[exp - 1] + "iB", 1024.0**exp


def report(psi: float, nproc: int, stage: int, precision: str = "bf16", offload_optimizer: bool = False,
           mp: int = 1, offload_param: bool = False, disk: bool = False) -> str:
    """What `zeroshard estimate` prints: the chosen stage by category, then stages 0-3 side by side.
    With `disk`, the offloaded states rest on disk (ZeRO-Infinity)."""
    p, g, k = BYTES_PER_PARAM[precision]
    place = "disk (offloaded, ZeRO-Infinity)" if disk else "host (offloaded)"
    where = place if offload_optimizer else "device"
    if offload_param:
        where += f"; parameters on {place.split(' ')[0]} at stage 3 (offloaded)"
    unit, scale, bunit, bscale = _units(model_states(psi, nproc, 0, precision, mp=mp).total)
    lines = [f"Ψ = {psi:,.0f} parameters on {nproc} GPUs (DP {nproc // mp} x MP {mp}), {precision}: "
             f"p = {p}, g = {g}, k = {k} bytes per parameter; optimizer state on {where}",
             f"stage {stage}, model states per rank:"]
    s = model_states(psi, nproc, stage, precision, offload_optimizer, mp, offload_param, disk)
    rows = [("params", s.params), ("grads", s.grads), ("optimizer", s.optimizer), ("transfer", s.transfer),
            ("device total", s.device), ("host total", s.host)] + ([("disk total", s.disk)] if disk else [])
    for name, value in rows + [("total", s.total + s.transfer)]:
        lines.append(f"  {name:<13}{value:>20,.0f} B {value / GB:>12,.3f} GB {value / GIB:>12,.3f} GiB")
    lines += [f"all stages, per rank ({unit}, and {bunit} for the device total):",
              f"{'stage':>5} {'params':>11} {'grads':>11} {'optimizer':>11} {'device':>11} {'host':>11}"
              + (f" {'disk':>11}" if disk else "") + f" {'device ' + bunit:>11}"]
    for st in (0, 1, 2, 3):
        s = model_states(psi, nproc, st, precision, offload_optimizer, mp, offload_param, disk)
        cells = [s.params, s.grads, s.optimizer, s.device, s.host] + ([s.disk] if disk else [])
        mark = "*" if st == stage else " "
        lines.append(f"{mark}{st:>4} " + " ".join(f"{v / scale:>11,.3f}" for v in cells)
                     + f" {s.device / bscale:>11,.3f}")
    return "\n".join(lines)
