"""`zeroshard estimate` against the ZeRO paper's own numbers (Figure 1, Table 1, Table 2).

The paper's values are written out here as literals, cell by cell; the library computes them from
the formulas alone.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers.cli import Done, zeroshard_here
from torch import nn

from zeroshard.app.gpt import GPT, SIZES, GPTConfig, gpt_params
from zeroshard.paper.estimate import (GB, hf_config_params, load_hf_config, max_params, model_states, table1,
                                      table2)

# Table 1, per-device model-state memory in GB: N -> (Ψ = 7.5B, Ψ = 128B, Ψ = 1T), each as
# (P_os, P_os+g, P_os+g+p), exactly as printed in the paper.
TABLE1 = {
    1: (("120", "120", "120"), ("2048", "2048", "2048"), ("16000", "16000", "16000")),
    4: (("52.5", "41.3", "30"), ("896", "704", "512"), ("7000", "5500", "4000")),
    16: (("35.6", "21.6", "7.5"), ("608", "368", "128"), ("4750", "2875", "1000")),
    64: (("31.4", "16.6", "1.88"), ("536", "284", "32"), ("4187", "2218", "250")),
    256: (("30.4", "15.4", "0.47"), ("518", "263", "8"), ("4046", "2054", "62.5")),
    1024: (("30.1", "15.1", "0.12"), ("513", "257", "2"), ("4011", "2013", "15.6")),
}
TABLE1_PSI = (7.5e9, 128e9, 1e12)

# Table 2, theoretical largest model on 32 GB GPUs: MP -> (baseline, P_os, P_os+g, P_os+g+p).
TABLE2 = {
    1: ("2B", "7.6B", "14.4B", "128B"),
    2: ("4B", "15.2B", "28.8B", "256B"),
    4: ("8B", "30.4B", "57.6B", "0.5T"),
    8: ("16B", "60.8B", "115.2B", "1T"),
    16: ("32B", "121.6B", "230.4B", "2T"),
}


def test_table1_every_cell():
    expected = {(psi, n, stage): TABLE1[n][i][stage - 1]
                for n in TABLE1 for i, psi in enumerate(TABLE1_PSI) for stage in (1, 2, 3)}
    assert len(expected) == 54
    assert table1() == expected


def test_table2_every_theoretical_cell():
    expected = {(mp, stage): TABLE2[mp][stage] for mp in TABLE2 for stage in range(4)}
    assert len(expected) == 20
    assert table2() == expected


@pytest.mark.parametrize("mp", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_table2_capacity_exactly_fills_32gb(mp, stage):
    psi = max_params(32 * GB, 64 * mp, mp, stage)
    assert model_states(psi, 64 * mp, stage, mp=mp).total == pytest.approx(32 * GB, rel=1e-12)


def test_figure1_example():
    gb = [model_states(7.5e9, 64, stage).total / GB for stage in range(4)]
    assert gb == pytest.approx([120, 31.4, 16.6, 1.9], abs=0.05)


@pytest.mark.parametrize("n", [1, 3, 64])
def test_fp32_formula(n):
    psi = 1e9  # fp32 Adam: 4 bytes of params, 4 of grads, 8 of optimizer state (momentum, variance)
    expected = [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    got = [model_states(psi, n, stage, "fp32") for stage in range(4)]
    assert [s.total for s in got] == pytest.approx(expected)
    assert got[3].params == pytest.approx(4 * psi / n) and got[1].optimizer == pytest.approx(8 * psi / n)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_only_optimizer_state_to_host(stage):
    on_device = model_states(7.5e9, 64, stage, "bf16")
    offloaded = model_states(7.5e9, 64, stage, "bf16", offload_optimizer=True)
    assert on_device.host == 0 and on_device.device == on_device.total
    # The host adds the transfer buffers: a bf16 gradient and a bf16 update per owned parameter.
    assert offloaded.transfer == pytest.approx(4 * 7.5e9 / 64)
    assert offloaded.host == pytest.approx(on_device.optimizer + offloaded.transfer)
    assert offloaded.device == pytest.approx(on_device.params + on_device.grads)
    assert offloaded.device + offloaded.host == pytest.approx(on_device.total + offloaded.transfer)
    if stage == 3:  # sharded on host as on device: 12 + 4 bytes per owned parameter
        assert offloaded.host == pytest.approx(16 * 7.5e9 / 64)
        both = model_states(7.5e9, 64, 3, "bf16", offload_optimizer=True, offload_param=True)
        assert both.device == pytest.approx(2 * 7.5e9 / 64)  # the gradient shard alone
        assert both.host == pytest.approx((12 + 2 + 2) * 7.5e9 / 64)  # no update copy: shards are host
    else:  # parameter offload is a stage-3 matter
        assert model_states(7.5e9, 64, stage, "bf16", offload_param=True).host == 0


def test_model_parallelism_splits_states_and_keeps_dp_degree():
    for stage in range(4):
        assert (model_states(1e9, 128, stage, mp=2).total
                == pytest.approx(model_states(0.5e9, 64, stage).total))
    with pytest.raises(ValueError):
        model_states(1e9, 6, 3, mp=4)


def count_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are yielded once


@pytest.mark.parametrize("name", sorted(SIZES))
def test_builtin_gpt_count_matches_the_module(name):
    layers, width, heads = SIZES[name]
    assert gpt_params(layers, width) == count_params(GPT(GPTConfig(layers=layers, width=width, heads=heads)))


def test_hf_gpt2_config_matches_the_equivalent_zeroshard_gpt(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 3, "n_embd": 48, "n_head": 4,
                                "vocab_size": 300, "n_positions": 96}))
    model = GPT(GPTConfig(vocab_size=300, seq_len=96, layers=3, width=48, heads=4))
    assert load_hf_config(path) == count_params(model)


def llama_reference(cfg: dict) -> int:
    """Build a LLaMA-shaped stack of plain modules on the meta device and count its parameters."""
    d, f, v, h = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_attention_heads"]
    kv, hd = cfg.get("num_key_value_heads", h), d // h
    with torch.device("meta"):
        block = [nn.Linear(d, h * hd, bias=False), nn.Linear(d, kv * hd, bias=False),
                 nn.Linear(d, kv * hd, bias=False), nn.Linear(h * hd, d, bias=False),
                 nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False), nn.Linear(f, d, bias=False),
                 nn.RMSNorm(d), nn.RMSNorm(d)]
        ends = [nn.Embedding(v, d), nn.RMSNorm(d), nn.Linear(d, v, bias=False)]
    return cfg["num_hidden_layers"] * sum(map(count_params, block)) + sum(map(count_params, ends))


def test_hf_llama_config_matches_a_built_reference(tmp_path):
    cfg = {"model_type": "llama", "num_hidden_layers": 3, "hidden_size": 64, "intermediate_size": 176,
           "vocab_size": 500, "num_attention_heads": 8, "num_key_value_heads": 2,
           "tie_word_embeddings": False}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    assert load_hf_config(path) == llama_reference(cfg)


@pytest.mark.parametrize("config, count", [  # published parameter counts
    ({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "vocab_size": 50257, "n_positions": 1024},
     124_439_808),
    ({"num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 11008, "vocab_size": 32000,
      "num_attention_heads": 32}, 6_738_415_616),  # Llama-2-7B
    ({"num_hidden_layers": 22, "hidden_size": 2048, "intermediate_size": 5632, "vocab_size": 32000,
      "num_attention_heads": 32, "num_key_value_heads": 4}, 1_100_048_384),  # TinyLlama-1.1B
])
def test_hf_config_known_models(config, count):
    assert hf_config_params(config) == count


@pytest.mark.parametrize("config, count", [  # published counts, of families the formulas do not describe
    ({"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
      "vocab_size": 32000, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8},
     46_702_792_704),  # Mixtral-8x7B: 8 experts per layer, not a dense 7B
    ({"model_type": "t5", "d_model": 512, "d_ff": 2048, "num_layers": 6, "num_heads": 8, "vocab_size": 32128},
     60_506_624),  # t5-small: an encoder-decoder
])
def test_hf_config_counts_the_architecture_transformers_builds(config, count):
    pytest.importorskip("transformers")
    assert hf_config_params(config) == count


def test_hf_config_with_experts_is_never_counted_as_dense():
    config = {"num_hidden_layers": 2, "hidden_size": 8, "intermediate_size": 16, "vocab_size": 10,
              "num_attention_heads": 2, "num_local_experts": 8}  # no model_type: no model to build
    with pytest.raises(ValueError, match="experts \\(num_local_experts\\).*--params"):
        hf_config_params(config)


@pytest.mark.parametrize("config, message", [
    ({"n_embd": 8, "vocab_size": 10, "n_positions": 4}, "n_layer"),
    ({"num_hidden_layers": 2, "hidden_size": 8, "vocab_size": 10, "num_attention_heads": 2},
     "intermediate_size"),
    ({"n_layer": -1, "n_embd": 8, "vocab_size": 10, "n_positions": 4}, "n_layer must be a positive integer"),
])
def test_hf_config_errors_name_the_key(config, message):
    with pytest.raises(ValueError, match=message):
        hf_config_params(config)


def zeroshard(*args: str) -> Done:
    """`zeroshard estimate ...`, in this process (it launches nothing)."""
    return zeroshard_here("estimate", *args)


def test_cli_reports_categories_and_all_stages():
    done = zeroshard("--params", "7.5e9", "--nproc", "64", "--stage", "3")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    for word in ("params", "grads", "optimizer", "device total", "host total", "GB", "GiB"):
        assert word in out
    assert "1,875,000,000 B" in out  # stage 3 total: 16 x 7.5e9 / 64
    rows = [line.replace("*", " ").split() for line in out.split("device GiB")[1].strip().splitlines()]
    assert [row[0] for row in rows] == ["0", "1", "2", "3"]
    devices = [float(row[4].replace(",", "")) for row in rows]  # stage, params, grads, optimizer, device
    assert devices == pytest.approx([120.0, 31.406, 16.641, 1.875], abs=1e-3)


def test_cli_offload_mp_and_models(tmp_path):
    out = zeroshard("--params", "1e9", "--nproc", "8", "--mp", "2", "--stage", "2", "--precision", "fp32",
                    "--offload-optimizer").stdout
    assert "DP 4 x MP 2" in out and "host (offloaded)" in out
    assert f"{int(model_states(1e9, 8, 2, 'fp32', True, mp=2).device):,} B" in out
    assert f"Ψ = {gpt_params(*SIZES['medium'][:2]):,} parameters" in zeroshard("--model", "medium").stdout
    assert f"Ψ = {gpt_params(3, 32):,} parameters" in zeroshard("--layers", "3", "--width", "32").stdout
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "vocab_size": 50257,
                                "n_positions": 1024}))
    assert "Ψ = 124,439,808 parameters" in zeroshard("--hf-config", str(path)).stdout


def test_cli_tables():
    out = zeroshard("--table1", "--table2").stdout
    assert "4187 / 2218 / 250" in out and "52.5 / 41.3 / 30" in out
    assert "121.6B" in out and "230.4B" in out and "0.5T" in out


def test_cli_help_documents_every_option():
    out = zeroshard("--help").stdout
    for flag in ("--params", "--model", "--layers", "--width", "--hf-config", "--nproc", "--mp", "--stage",
                 "--precision", "--offload-optimizer", "--offload-param", "--table1", "--table2"):
        assert flag in out


@pytest.mark.parametrize("args, message", [
    (["--params", "-5"], "--params must be a finite number > 0"),
    (["--params", "1e9", "--nproc", "0"], "--nproc must be >= 1"),
    (["--params", "1e9", "--nproc", "6", "--mp", "4"], "--nproc (6) must be a multiple of --mp (4)"),
    ([], "give one of --params"),
    (["--params", "1e9", "--model", "small"], "not --params and --model"),
    (["--hf-config", "/nonexistent/config.json"], "--hf-config /nonexistent/config.json"),
    (["--layers", "0"], "--layers must be >= 1"),
    (["--params", "1e9", "--stage", "4"], "invalid choice"),
])
def test_cli_bad_input(args, message):
    done = zeroshard(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


def test_zero_r_checkpoints_match_the_papers_100b_example():
    """paper-figures.md, ZeRO-R: a 100B model at MP 16 keeps ~33 GB of activation checkpoints per GPU,
    ~2 GB with P_a and ~0 on the device with P_a+cpu (125 layers, hidden 8192, 16 x 1024 tokens)."""
    from zeroshard.paper.zero_r import CONFIGURATIONS, checkpoint_bytes
    whole = checkpoint_bytes(125, 8192, 16, 1024, "bf16", 16, partition=False, cpu=False)
    split = checkpoint_bytes(125, 8192, 16, 1024, "bf16", 16, partition=True, cpu=False)
    host = checkpoint_bytes(125, 8192, 16, 1024, "bf16", 16, partition=True, cpu=True)
    assert round(whole[0] / GB) == 34 and whole[1] == 0  # "~33 GB" (33.55)
    assert round(split[0] / GB) == 2 and split[0] * 16 == whole[0]
    assert host == (0.0, split[0])
    assert [(c.name, c.stage, c.partition, c.cpu) for c in CONFIGURATIONS] == [
        ("C1", 1, False, False), ("C2", 1, True, False), ("C3", 2, False, False), ("C4", 2, True, False),
        ("C5", 2, True, True)]
    command = [sys.executable, "-m", "zeroshard", "estimate", "--layers", "125", "--width", "8192",
               "--nproc", "400", "--mp", "16", "--configs"]
    out = subprocess.run(command, capture_output=True, text=True, check=True)  # the real command, once
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[2:]}
    assert rows["C1"][3] == "33.55" and rows["C2"][3] == "2.10" and rows["C5"][3:5] == ["0.00", "2.10"]
