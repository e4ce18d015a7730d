"""`zeroshard plan`: its model-state bytes equal the engine's memory_stats() exactly (every stage and
offload mode, with padding), its peaks hold within 20% of measured runs, a model that fits nowhere
names the change that would fit, bad input is refused by name, --write trains as it is, and the
paper's projection states its error."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers import ROOT
from helpers.cli import zeroshard_here
from helpers.spawn import spawn
from zeroshard.paper.plan import paper_projection
from zeroshard.paper.plan_memory import Setup, shards, states
from zeroshard.paper.plan_shapes import gpt2_shape

MODES = [
    (0, "none", "none"),
    (1, "none", "none"),
    (1, "cpu", "none"),
    (1, "nvme", "none"),
    (2, "none", "none"),
    (2, "cpu", "none"),
    (2, "nvme", "none"),
    (3, "none", "none"),
    (3, "cpu", "none"),
    (3, "nvme", "none"),
    (3, "none", "cpu"),
    (3, "cpu", "cpu"),
    (3, "nvme", "nvme"),
]
ACCUMULATED = [(2, "none", "none"), (3, "none", "none"), (3, "cpu", "none")]  # bf16, 2 micro-batches a step
CASES = [(precision, *mode, 1) for precision in ("fp32", "bf16") for mode in MODES] + \
    [("bf16", *mode, 2) for mode in ACCUMULATED]
WIDTH, LAYERS, SEQ = 40, 2, 24  # element counts that do not divide by 3 ranks: padding shows


def _measure_states(rank: int, world_size: int, folder: str, out: str) -> None:
    from zeroshard.app.gpt import GPT, config_for, lm_loss

    x = torch.randint(0, 256, (2, SEQ), generator=torch.Generator().manual_seed(rank))
    found = []
    for precision, stage, opt, par, accumulation in CASES:
        torch.manual_seed(0)
        with zeroshard.init():
            model = GPT(config_for("tiny", LAYERS, WIDTH, SEQ))
        zero = {"stage": stage}
        for key, where in (("offload_optimizer", opt), ("offload_param", par)):
            if where != "none":
                zero[key] = {"device": where, **({"nvme_path": folder} if where == "nvme" else {})}
        config = {"zero_optimization": zero, "bf16": {"enabled": precision == "bf16"},
                  "gradient_accumulation_steps": accumulation}
        engine = zeroshard.initialize(
            model, lambda p: torch.optim.AdamW(p, lr=1e-3, fused=opt != "none" or None), config
        )
        for step in range(3):  # the third backward: Adam's state exists (a step was taken), rests where it
            # lives, and with accumulation the reduced shard is held across micro-batches
            engine.backward(lm_loss(engine(x), x))
            if step < 2:
                engine.step()
        s = engine.memory_stats()
        found.append(
            [
                precision,
                stage,
                opt,
                par,
                accumulation,
                {
                    k: s[k]
                    for k in (
                        "params",
                        "grads_in_step",
                        "optimizer",
                        "device",
                        "host",
                        "disk",
                        "transfer",
                    )
                },
                [f.layout.numel for f in engine.flats],
            ]
        )
        engine.step()
        del engine, model
    if rank == 0:
        with open(out, "w") as f:
            json.dump(found, f)


def test_model_states_equal_memory_stats_exactly(tmp_path):
    out = str(tmp_path / "found.json")
    spawn(_measure_states, 3, str(tmp_path), out)
    shape = gpt2_shape("t", LAYERS, WIDTH, 2, 256, SEQ)
    assert any(
        padded != sh * 3 or padded != n for (padded, sh), n in zip(shards(shape, 1, 3), shape.units)
    ), "no buffer is padded: the test would not see padding"
    with open(out) as f:
        found = json.load(f)
    assert len(found) == len(CASES)
    for precision, stage, opt, par, accumulation, measured, numels in found:
        assert tuple(numels) == shape.units  # the units the planner assumes are the engine's
        p = states(shape, Setup(stage, precision, opt, par, accumulation=accumulation), 3, one_memory=True)
        predicted = {
            "params": p.params,
            "grads_in_step": p.grads,
            "optimizer": p.optimizer,
            "device": p.device,
            "host": p.host,
            "disk": p.disk,
            "transfer": p.transfer,
        }
        assert predicted == measured, (precision, stage, opt, par, accumulation)
        # and the paper's formula, up to padding and Adam's step counters
        pb = 4 if precision == "fp32" else 2
        k = 8 if precision == "fp32" and opt == par == "none" else 12
        psi, n = shape.psi, 3
        paper = {
            0: (pb + pb + k) * psi,
            1: (2 * pb) * psi + k * psi / n,
            2: pb * psi + (pb + k) * psi / n,
            3: (2 * pb + k) * psi / n,
        }[stage]
        if stage == 3 and pb == 2 and opt == par == "none":
            paper -= pb * psi / n  # no 16-bit shard beside the master
        if stage >= 2 and accumulation > 1:
            paper += (4 - pb) * psi / n  # the reduced shard accumulates in fp32
        assert abs(p.model_states - paper) <= 16 * 3 * len(shape.units) + 4 * len(shape.units), (
            stage,
            opt,
            par,
        )


@pytest.fixture(scope="module")
def plan_cache(tmp_path_factory) -> str:
    """One cache of this machine's calibration and engine reference for this module's CPU runs
    (both fp32 on 2 ranks): the first run measures them, the next reads them, as a user's second
    `zeroshard plan` would."""
    return str(tmp_path_factory.mktemp("plan-cache"))


def _plan(*args: str, cache: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XDG_CACHE_HOME": cache}
    return subprocess.run(
        [sys.executable, "-m", "zeroshard", "plan", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )


def test_verified_peaks_within_20_percent(plan_cache):
    """Three small configurations run here: the predicted total peak (host: one memory on a CPU
    group) within 20% of the measured peak RSS above the baseline."""
    done = _plan(
        "--model",
        "medium",
        "--seq-len",
        "64",
        "--global-batch",
        "4",
        "--precision",
        "fp32",
        "--verify-top",
        "3",
        "--verify-steps",
        "2",
        "--json",
        cache=plan_cache,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout)
    assert len(result["verified"]) == 3
    for v in result["verified"]:
        assert set(v["predicted"]) == set(v["measured"]) == {"device_peak_bytes", "device_reserved_bytes",
                                                             "host_peak_bytes", "step_s"}
        assert v["predicted"]["device_peak_bytes"] is None and v["measured"]["device_peak_bytes"] is None
        ratio = v["predicted"]["host_peak_bytes"] / v["measured"]["host_peak_bytes"]
        assert 0.8 <= ratio <= 1.2, (v["config"]["name"], v["predicted"], v["measured"])


def test_fits_nowhere_names_the_smallest_change():
    done = zeroshard_here(
        "plan",
        "--params",
        "1.2e12",
        "--layers",
        "128",
        "--width",
        "25600",
        "--seq-len",
        "2048",
        "--nodes",
        "1",
        "--gpus-per-node",
        "8",
        "--gpu-mem",
        "80",
        "--host-mem",
        "1000",
        "--disk",
        "100",
    )
    assert done.returncode == 0, done.stderr
    assert "Nothing fits" in done.stdout
    assert "more nodes: --nodes" in done.stdout, done.stdout
    # a sequence too long for one GPU, where a shorter one fits
    done = zeroshard_here(
        "plan",
        "--params",
        "1.3e9",
        "--layers",
        "24",
        "--width",
        "2048",
        "--seq-len",
        "65536",
        "--global-batch",
        "1",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "--gpu-mem",
        "24",
        "--host-mem",
        "64",
        "--disk",
        "1",
    )
    assert "Nothing fits" in done.stdout and "a shorter sequence: --seq-len" in done.stdout, done.stdout


def test_the_table_columns_stay_aligned():
    """Names of offload + MP rows run past the usual width: the column widens for every row."""
    done = zeroshard_here("plan", "--params", "7e9", "--layers", "32", "--width", "4096", "--seq-len", "2048",
                          "--global-batch", "64", "--nodes", "1", "--gpus-per-node", "8", "--top", "200")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.lstrip().startswith("# configuration"))
    start = lines.index(next(line for line in lines if "do not fit" in line))
    rows = [line for line in lines[header + 1:start] if line[:3].strip().isdigit()]
    assert any(len(line.split(",")) >= 5 for line in rows)  # a long name is among them
    assert {len(line) for line in rows} == {len(lines[header])}, "\n".join(rows)
    misfits = [line for line in lines[start + 1:] if line.startswith("    ") and ">" in line]
    assert misfits and len({line.index(" device ") for line in misfits}) == 1, "\n".join(misfits)


def test_bad_input_refused_by_name(tmp_path):
    not_model = tmp_path / "config.json"
    not_model.write_text(json.dumps({"train_batch_size": 8}))
    short = tmp_path / "short.json"  # a context `zeroshard train` would refuse --seq-len 128 for
    short.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 2,
                                 "vocab_size": 256, "n_positions": 64}))
    bert = tmp_path / "bert.json"  # its causal-LM class attends to later tokens: not a decoder
    bert.write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 2, "hidden_size": 64,
                                "num_attention_heads": 2, "intermediate_size": 128, "vocab_size": 300}))
    for args, words in [
        (["--hf-config", str(short), "--seq-len", "128"], "--seq-len 128 exceeds the model's context (64)"),
        (["--hf-config", str(not_model)], "not a model config"),
        (["--hf-config", str(tmp_path / "missing.json")], "--hf-config"),
        (["--model", "tiny", "--nodes", "2", "--gpu-mem", "0"], "--gpu-mem must be"),
        (["--model", "tiny", "--nodes", "-1"], "--nodes must be"),
        (["--model", "tiny", "--nodes", "1", "--link-gbps", "nan"], "--link-gbps must be"),
        (["--model", "tiny", "--nvme-path", str(tmp_path / "nowhere")], "not a writable directory"),
        (["--model", "tiny", "--nvme-path", "/proc"], "not a writable directory"),  # (os.access: yes to root)
        (
            ["--model", "tiny", "--nodes", "1", "--write", str(tmp_path / "no" / "ds.json")],
            "not a writable directory",
        ),
        (["--params", "1e9"], "--params needs --layers and --width"),
        (["--params", "1e9", "--layers", "8", "--width", "2048", "--heads", "5"],
         "--heads 5 must divide --width"),
        (["--params", "8e6", "--layers", "2", "--width", "128", "--verify"], "give --model or --hf-config"),
        (["--model", "tiny", "--heads", "3"], "--heads describe a model with --params"),
        (["--hf-config", str(short), "--seq-len", "32", "--layers", "2"], "--layers describe a model with"),
        (["--model", "tiny", "--nodes", "1", "--nproc", "3"], "--nproc counts this machine's ranks"),
        (["--model", "tiny", "--h2d-gbps", "5", "--recalibrate"], "--recalibrate measures this machine"),
        (["--model", "tiny", "--nodes", "1", "--write", str(tmp_path)], "is a directory; give a file name"),
        (["--hf-config", str(bert), "--nodes", "1", "--seq-len", "32"], "is a bert, an encoder"),
    ]:
        done = zeroshard_here("plan", *args)
        assert done.returncode == 2 and words in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr


def test_write_loads_and_trains(tmp_path, plan_cache):
    path = tmp_path / "ds_config.json"
    done = _plan(
        "--model",
        "tiny",
        "--seq-len",
        "32",
        "--global-batch",
        "4",
        "--precision",
        "fp32",
        "--write",
        str(path),
        cache=plan_cache,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    config = zeroshard.Config.load(str(path))
    config.check_batch_sizes(2)
    # the command the plan prints after writing, as printed, for 2 steps
    printed = done.stdout.split("train it with: ")[1].split("\n")[0]
    assert printed.startswith("zeroshard train --config ") and "--size tiny --seq-len 32 --nproc 2" in printed
    train = subprocess.run(
        [sys.executable, "-m", *shlex.split(printed), "--steps", "2", "--device", "cpu",
         "--out", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert train.returncode == 0, train.stderr[-3000:]


def test_write_for_another_machine_says_how_to_train_it(tmp_path):
    """A plan for machines `zeroshard train` does not run (several nodes), or for a model given by
    its size alone (--params), says to pass the written config to zeroshard.initialize or
    ZeroTrainer, not a `zeroshard train` line that would build another model or start a launcher
    per rank; a best offloading to nvme is written only with --nvme-path (the config needs it)."""
    path = tmp_path / "ds.json"
    llama = ("--params", "7e9", "--layers", "32", "--width", "4096", "--seq-len", "1024",
             "--write", str(path))
    done = zeroshard_here("plan", *llama, "--nodes", "4", "--gpus-per-node", "8")
    assert "give it to zeroshard.initialize(model, config=...) or ZeroTrainer in your script, under " \
        "torchrun on each of 4 nodes (--nnodes 4 --nproc-per-node 8)" in done.stdout, done.stdout
    zeroshard.Config.load(str(path))
    tight = ("--nodes", "1", "--gpus-per-node", "2", "--gpu-mem", "24", "--host-mem", "48",
             "--global-batch", "2")
    done = zeroshard_here("plan", *llama, *tight)
    assert "opt->nvme" in done.stdout.split("best:")[1].split("\n")[0], done.stdout
    assert f"did not write {path}: the best offloads to nvme: give --nvme-path DIR" in done.stdout
    done = zeroshard_here("plan", *llama, *tight, "--nvme-path", "/local_nvme")  # that machine's path
    zeroshard.Config.load(str(path))
    offload = json.loads(path.read_text())["zero_optimization"]["offload_optimizer"]
    assert done.returncode == 0 and offload["nvme_path"] == "/local_nvme", done.stdout


def test_paper_projection_states_its_error():
    rows = {r["case"]: r for r in paper_projection()}
    assert {r["reported_tflops_per_gpu"] for r in rows.values()} == {38.0, 40.0}
    for r in rows.values():
        assert r["fits"], r
        assert r["error"] == pytest.approx(r["predicted_tflops_per_gpu"] / r["reported_tflops_per_gpu"] - 1)
        assert abs(r["error"]) <= 0.25, r  # the target
    hundred = rows["100B, 400 V100s, MP 16"]
    assert hundred["gpus"] == 400 and hundred["mp"] == 16 and 95e9 < hundred["psi"] < 105e9
    done = zeroshard_here("plan", "--paper")
    assert "error" in done.stdout and "15 PFLOP/s" in done.stdout


@pytest.mark.cuda
def test_verified_on_a_gpu_within_20_percent(tmp_path):
    """On one GPU: the best configuration for the small built-in GPT run here; its device peak
    (the tensors' most) within 20% of the prediction, and a step time measured."""
    done = _plan("--model", "small", "--seq-len", "256", "--global-batch", "16", "--verify", "--json",
                 cache=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    (v,) = json.loads(done.stdout)["verified"]
    assert 0.8 <= v["measured"]["device_peak_bytes"] / v["predicted"]["device_peak_bytes"] <= 1.2, v
    assert v["measured"]["step_s"] > 0 and v["measured"]["host_peak_bytes"] > 0
