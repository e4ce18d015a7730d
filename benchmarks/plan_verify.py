"""`zeroshard plan`'s predictions checked across configurations: predicted beside measured peak
memory and step time, run here through `zeroshard plan --verify`'s path.

Each configuration is weighed by the planner (this machine calibrated, the rates cached) and then
run for a few optimizer steps here (gloo ranks on a CPU; one GPU with --gpu, or wherever CUDA is
available); the table prints the predicted and measured peak (a
rank's RSS above its baseline on a CPU, the device's peak on a GPU) and step time with their
ratios. The configurations cover stages 0-3, optimizer offload to cpu and nvme, parameter offload,
activation checkpointing, fp32 and bf16, the built-in GPT and three Hugging Face families (GPT-2,
LLaMA and Mixtral, a mixture of experts: configs written here, small enough for a CPU); on a GPU,
the 1.1B LLaMA of offload.py with and without offload. The targets: peaks within 10%, step times
within 25%. --top3 also runs the planner's three best configurations for one shape, alternately over
a few rounds, and says whether the recommended one was the fastest by the medians.

    python benchmarks/plan_verify.py --steps 5 --top3    # 15 configurations and a top 3
    python benchmarks/plan_verify.py --only 0 3 --steps 2
    python benchmarks/plan_verify.py --only --top3 --steps 6   # the top 3 alone
    python benchmarks/plan_verify.py --gpu --steps 4          # one GPU: the 1.1B LLaMA, 3 configurations
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from zeroshard.app.plan_hw import calibrate, local_hardware
from zeroshard.app.plan_verify import verify, with_engine
from zeroshard.paper.plan import plan, weigh
from zeroshard.paper.plan_memory import Setup
from zeroshard.paper.plan_shapes import gpt2_shape, shape_from_hf

SEQ, MIB = 64, 2**20
GPT2 = {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 512, "n_positions": 256,
        "bos_token_id": 0, "eos_token_id": 0}
LLAMA = {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 4,
         "num_key_value_heads": 2, "intermediate_size": 688, "vocab_size": 512,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
LLAMA_1B = {"model_type": "llama", "num_hidden_layers": 22, "hidden_size": 2048, "num_attention_heads": 32,
            "num_key_value_heads": 4, "intermediate_size": 5632, "vocab_size": 32000,
            "max_position_embeddings": 2048, "tie_word_embeddings": False}  # benchmarks/offload.py's
MIXTRAL = {**LLAMA, "model_type": "mixtral", "intermediate_size": 344, "num_local_experts": 4,
           "num_experts_per_tok": 2}  # each token through two of four experts of half LLaMA's MLP
HF = {"gpt2": GPT2, "llama": LLAMA, "mixtral": MIXTRAL, "llama1b": LLAMA_1B}
# (model, stage, precision, offload_optimizer, offload_param, checkpointing, micro_batch, accumulation)
CASES = [
    ("medium", 0, "fp32", "none", "none", False, 2, 2),
    ("medium", 1, "bf16", "none", "none", False, 4, 1),
    ("medium", 2, "bf16", "none", "none", False, 2, 2),
    ("medium", 3, "bf16", "none", "none", False, 4, 1),
    ("medium", 1, "bf16", "cpu", "none", False, 1, 4),
    ("medium", 2, "bf16", "nvme", "none", False, 4, 1),
    ("medium", 3, "bf16", "cpu", "cpu", False, 4, 1),
    ("medium", 3, "bf16", "nvme", "nvme", False, 2, 2),
    ("medium", 2, "fp32", "none", "none", True, 4, 1),
    ("large", 3, "bf16", "none", "none", True, 4, 1),
    ("large", 1, "fp32", "cpu", "none", False, 4, 1),
    ("gpt2", 2, "bf16", "none", "none", False, 4, 1),
    ("llama", 3, "bf16", "cpu", "none", False, 2, 2),
    ("llama", 1, "fp32", "none", "none", True, 4, 1),
    ("mixtral", 3, "bf16", "none", "none", False, 4, 1),
]
# --gpu: the 1.1B LLaMA of benchmarks/offload.py, world size 1, sequences of 1024
GPU_CASES = [
    ("llama1b", 3, "bf16", "none", "none", False, 8, 1),
    ("llama1b", 3, "bf16", "cpu", "none", False, 8, 1),
    ("llama1b", 3, "bf16", "cpu", "cpu", False, 8, 1),
]


def shape_and_cli(model: str, folder: str, nvme: str, steps: int, seq: int = SEQ):
    """The planner's Shape and the namespace `verify` reads (as `zeroshard plan`'s flags would)."""
    hf = None
    if model in HF:
        hf = os.path.join(folder, f"{model}.json")
        with open(hf, "w") as f:
            json.dump(HF[model], f)
        with open(hf) as f:
            shape = shape_from_hf(json.load(f), model)
    else:
        from zeroshard.app.sizes import SIZES

        layers, width, heads = SIZES[model]
        shape = gpt2_shape(model, layers, width, heads, 256, seq)
    cli = argparse.Namespace(hf_config=hf, model=None if hf else model, layers=None, width=None,
                             verify_steps=steps, nvme_path=nvme)
    return shape, cli


MEASURED: set[tuple] = set()  # calibrated (precision, ranks) and referenced (precision, ranks, model) here


def this_machine(precision: str, nproc: int, folder: str, model: str = "medium"):
    """This machine's Hardware as `zeroshard plan` sees it for `model`: calibrated (afresh the first
    time in a run, with the engine's reference runs, in the model's own family for a Hugging Face
    one: a shared machine's rates drift, and a run compares its predictions with what it measures
    now), with the engine's reference; and the calibration's figures."""
    import torch

    family = HF.get(model)
    again = (precision, nproc) not in MEASURED
    referenced_again = again or (precision, nproc, model) not in MEASURED
    MEASURED.update({(precision, nproc), (precision, nproc, model)})
    figures, _ = calibrate(precision, nproc, folder, torch.cuda.is_available(), again)
    hw = with_engine(local_hardware(nproc, figures, folder)[0], precision, referenced_again, family)
    return hw, figures


def run_case(case: tuple, nproc: int, steps: int, folder: str, seq: int = SEQ) -> dict:
    model, stage, precision, opt, par, ckpt, micro, acc = case
    shape, cli = shape_and_cli(model, folder, folder, steps, seq)
    hw, figures = this_machine(precision, nproc, folder, model)
    setup = Setup(stage, precision, opt, par, ckpt, 1, micro, acc, seq)
    plan = weigh(shape, setup, hw)
    result = verify(cli, shape, hw, [plan], micro * acc * nproc)[0]
    # the calibration as measured (its block timings and fit too), to refit a miss from the JSON alone
    return {"model": model, **result, "calibration": figures}


def time_parts(row: dict) -> str:
    """The predicted step's parts and the calibration's fit, for a step that missed."""
    t, c = row["predicted_time"], row["calibration"]
    fit = f", the block fit's worst shape {c['fit_worst']:.0%} off" if "fit_worst" in c else ""
    return (f"        predicted: compute {t['compute']:.3f} s, comm {t['comm']:.3f} s, optimizer "
            f"{t['optimizer']:.3f} s (matmul {c['matmul'] / 1e12:.3g} TFLOP/s{fit})")


def top_three(nproc: int, steps: int, folder: str, rounds: int) -> None:
    """The planner's three best for the medium GPT (bf16, global batch 8 x 64 tokens), each run
    `rounds` times, alternately (1 2 3, 1 2 3, ...: a drift in a shared machine's speed then falls
    on all three alike, where three runs one after the other would each meet their own): is the
    recommended one the fastest by the medians?"""
    shape, cli = shape_and_cli("medium", folder, folder, steps)
    hw, _ = this_machine("bf16", nproc, folder)
    best = [p for p in plan(shape, hw, 8, SEQ, "bf16", [1]) if p.fits][:3]
    runs = [verify(cli, shape, hw, best, 8) for _ in range(rounds)]
    medians = []
    for i, p in enumerate(best):
        each = [r[i]["measured"]["step_s"] for r in runs]
        medians.append(statistics.median(each))
        print(f"top 3: {p.setup.name:45} step {p.time.total:.3f} predicted, {medians[-1]:.3f} measured "
              f"(median of {', '.join(f'{t:.3f}' for t in each)})")
    fastest = min(range(len(best)), key=lambda i: medians[i])
    print(f"the recommended configuration was {'the fastest' if fastest == 0 else 'not the fastest'} "
          f"of the three measured (fastest: {best[fastest].setup.name}; the recommended "
          f"{medians[0] / medians[fastest]:.2f}x its median)")


def ratio(row: dict, key: str) -> float:
    return row["measured"][key] / row["predicted"][key]


def peak_key(row: dict) -> str:
    """The memory that limits: the device's on a GPU, the host's (one memory) on a CPU group."""
    return "host_peak_bytes" if row["measured"]["device_peak_bytes"] is None else "device_peak_bytes"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per run (default 3)")
    parser.add_argument("--nproc", type=int, default=2, help="gloo ranks (default 2)")
    parser.add_argument("--only", type=int, nargs="*", help="these cases (indices) only; none: --top3 alone")
    parser.add_argument("--json", help="also write the rows to this file")
    parser.add_argument("--top3", action="store_true", help="also run the planner's three best (medium GPT)")
    parser.add_argument("--rounds", type=int, default=3, help="--top3's alternating rounds (default 3)")
    parser.add_argument("--gpu", action="store_true", help="the 1.1B LLaMA on one GPU instead (seq 1024)")
    args = parser.parse_args()
    import torch

    gpu = args.gpu or torch.cuda.is_available()
    cases, nproc, seq = (GPU_CASES, 1, 1024) if gpu else (CASES, args.nproc, SEQ)
    picked = [cases[i] for i in args.only] if args.only is not None else cases
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for case in picked:
            row = run_case(case, nproc, args.steps, folder, seq)
            rows.append(row)
            key, predicted, measured = peak_key(row), row["predicted"], row["measured"]
            print(f"{row['model']:7} {row['config']['name']:45} {key.split('_')[0]} peak "
                  f"{predicted[key] / MIB:7.1f} / {measured[key] / MIB:7.1f} MiB ({ratio(row, key):.2f})   "
                  f"step {predicted['step_s']:.3f} / {measured['step_s']:.3f} s ({ratio(row, 'step_s'):.2f})"
                  + (f"   host {predicted['host_peak_bytes'] / MIB:7.1f} / "
                     f"{measured['host_peak_bytes'] / MIB:7.1f} MiB" if key == "device_peak_bytes" else ""),
                  flush=True)
            print(time_parts(row), flush=True)
    peaks = [abs(ratio(r, peak_key(r)) - 1) for r in rows]
    steps = [abs(ratio(r, "step_s") - 1) for r in rows]
    if rows:
        print(f"\n{len(rows)} configurations: peak within 10% for {sum(e <= 0.10 for e in peaks)}, "
              f"median error {statistics.median(peaks):.1%}, worst {max(peaks):.1%}; step within 25% for "
              f"{sum(e <= 0.25 for e in steps)}, median error {statistics.median(steps):.1%}, "
              f"worst {max(steps):.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    if args.top3 and not gpu:
        with tempfile.TemporaryDirectory() as folder:
            top_three(args.nproc, args.steps, folder, args.rounds)


if __name__ == "__main__":
    main()
