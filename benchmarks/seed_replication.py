"""The seed replication's experiment: Hugging Face Trainer fine-tuning a BERT sequence classifier,
standard Trainer against ZeroTrainer with the seed's DeepSpeed config exactly as written
(stage 3 + optimizer offload to the CPU, no batch keys), and Trainer + DeepSpeed where installed: the
seed config as written ("deepspeed"; DeepSpeed refuses a config without batch keys, and the Trainer fills
in only keys that are present) and with the one "auto" batch key added ("deepspeed-auto-batch").

    python seed_replication.py                    # bert-large shape on a GPU; a small BERT on the CPU
    python seed_replication.py --size large --device cuda --batch 8 16

Each run is a fresh process (one rank, as the seed ran it): time in trainer.train(), peak memory
(CUDA: max_memory_allocated; CPU: peak RSS), the training losses logged and the evaluation losses.
Same model (from config, seeded), same synthetic data (seeded token ids, seq 128, binary labels),
1 epoch, evaluation every --eval-every steps, fp32. Writes out/seed_replication.{md,json}.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import time

SIZES = {  # (layers, hidden, heads, intermediate): large is bert-large-uncased's shape (336M)
    "large": (24, 1024, 16, 4096),
    "small": (4, 256, 4, 1024),
}
SEED_CONFIG = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
AUTO_BATCH = {"train_micro_batch_size_per_gpu": "auto"}  # the least the Trainer + DeepSpeed accepts
DEEPSPEED_CONFIGS = {"deepspeed": SEED_CONFIG, "deepspeed-auto-batch": {**SEED_CONFIG, **AUTO_BATCH}}
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def dataset(n: int, seq: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, 30000, (n, seq), generator=g)
    labels = (ids[:, 0] % 2).long()  # learnable: the first token's parity
    return [{"input_ids": i, "attention_mask": torch.ones_like(i), "labels": y} for i, y in zip(ids, labels)]


def run_one(kind: str, batch: int, args: argparse.Namespace) -> dict:
    """In this process: one training run; returns its figures."""
    import torch
    import transformers
    layers, hidden, heads, inter = SIZES[args.size]
    transformers.set_seed(0)
    model = transformers.BertForSequenceClassification(transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=inter,
        num_labels=2))
    params = sum(p.numel() for p in model.parameters())
    training = transformers.TrainingArguments(
        output_dir=os.path.join(args.scratch, f"{kind}-{batch}"), per_device_train_batch_size=batch,
        per_device_eval_batch_size=batch, num_train_epochs=1, eval_strategy="steps",
        eval_steps=args.eval_every, logging_steps=1, save_strategy="no", report_to=[], seed=0,
        use_cpu=args.device == "cpu", disable_tqdm=True,
        deepspeed=DEEPSPEED_CONFIGS.get(kind))
    train, evaluation = dataset(args.train, args.seq, 1), dataset(args.eval, args.seq, 2)
    if kind == "zeroshard":
        from zeroshard.hf import ZeroTrainer
        trainer = ZeroTrainer(model=model, args=training, train_dataset=train, eval_dataset=evaluation,
                              zero_config=SEED_CONFIG)
    else:
        trainer = transformers.Trainer(model=model, args=training, train_dataset=train,
                                       eval_dataset=evaluation)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if args.device == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    history = trainer.state.log_history
    return {"kind": kind, "batch": batch, "params": params, "seconds": seconds, "peak_mib": peak / 2**20,
            "losses": [h["loss"] for h in history if "loss" in h],
            "eval_losses": [h["eval_loss"] for h in history if "eval_loss" in h]}


def in_fresh_process(kind: str, batch: int, args: argparse.Namespace) -> dict:
    """One run in a fresh process: its figures, or {"kind", "batch", "error"} (the last error line)."""
    command = [sys.executable, __file__, "--one", kind, "--batch", str(batch), "--size", args.size,
               "--device", args.device, "--train", str(args.train), "--eval", str(args.eval),
               "--seq", str(args.seq), "--eval-every", str(args.eval_every), "--scratch", args.scratch]
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(29500 + os.getpid() % 1000),
           "OMP_NUM_THREADS": str(args.threads),  # the same for every run (accelerate picks its own)
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    done = subprocess.run(command, capture_output=True, text=True, env=env)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        print(f"{kind}, batch {batch}: failed\n{done.stderr[-2000:]}", file=sys.stderr)
        errors = [ln.removeprefix("[rank0]: ") for ln in done.stderr.splitlines()
                  if re.match(r"(\[rank0\]: )?\w*(Error|Exception)\b", ln)]
        return {"kind": kind, "batch": batch, "error": errors[-1] if errors else f"exit {done.returncode}"}
    return json.loads(lines[-1][len("RESULT "):])


def deepspeed_installed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except Exception:  # noqa: BLE001 - not installed, or installed without its ops
        return False
    return True


def report(results: list[dict], args: argparse.Namespace) -> str:
    failed, results = [r for r in results if "error" in r], [r for r in results if "error" not in r]
    first = results[0]
    lines = [f"# Seed replication: BertForSequenceClassification ({args.size}, Ψ = {first['params']:,}), "
             f"seq {args.seq}, {args.train} train / {args.eval} eval samples, 1 epoch, eval every "
             f"{args.eval_every} steps, fp32, {args.device}", "",
             "| batch | run | train s | × standard | peak (MiB) | × standard | last train loss | "
             "max abs train-loss diff vs standard | eval losses |", "|" + "---|" * 9]
    for batch in args.batch:
        rows = [r for r in results if r["batch"] == batch]
        standard = next((r for r in rows if r["kind"] == "standard"), None)
        for r in rows:
            diff = max((abs(a - b) for a, b in zip(r["losses"], standard["losses"])), default=float("nan")) \
                if standard else float("nan")
            lines.append(f"| {batch} | {r['kind']} | {r['seconds']:.1f} | "
                         f"{r['seconds'] / standard['seconds']:.2f} | {r['peak_mib']:,.0f} | "
                         f"{r['peak_mib'] / standard['peak_mib']:.2f} | {r['losses'][-1]:.4f} | {diff:.1e} | "
                         f"{', '.join(f'{v:.4f}' for v in r['eval_losses'])} |")
    if not deepspeed_installed():
        lines += ["", "Trainer + DeepSpeed: not run (deepspeed is not installed here)."]
    for r in failed:
        lines += ["", f"{r['kind']}, batch {r['batch']}: failed: `{r['error']}`"]
    if any(r["kind"] == "deepspeed-auto-batch" for r in results):
        lines += ["", "deepspeed-auto-batch: Trainer + DeepSpeed with the seed config plus "
                  f"`{json.dumps(AUTO_BATCH)}` (the Trainer fills it from per_device_train_batch_size)."]
    lines += ["", "zeroshard: the seed config as written, "
              f"`{json.dumps(SEED_CONFIG)}`; targets (on one H100, bert-large): ZeroTrainer ≤ 1.5× the "
              "standard time, peak ≤ DeepSpeed's, losses equal to standard."]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda if available")
    p.add_argument("--size", choices=sorted(SIZES), default=None, help="default: large on cuda, small on cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[8, 16])
    p.add_argument("--train", type=int, default=None, help="training samples (default 800; 160 on cpu)")
    p.add_argument("--eval", type=int, default=None, help="evaluation samples (default 200; 40 on cpu)")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--threads", type=int, default=None, help="CPU threads per run (default: 1 on the cpu, "
                   "where more threads on a shared machine slow some runs far more than others; all on cuda, "
                   "where the offloaded optimizer steps on the host)")
    p.add_argument("--eval-every", type=int, default=None, help="default 50 (5 on cpu)")
    p.add_argument("--scratch", default=os.path.join(OUT, "seed_replication_runs"))
    p.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one kind in this process
    args = p.parse_args()
    if args.device is None:
        import torch
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cpu = args.device == "cpu"
    args.size = args.size or ("small" if cpu else "large")
    args.train = args.train or (160 if cpu else 800)
    args.eval = args.eval or (40 if cpu else 200)
    args.eval_every = args.eval_every or (5 if cpu else 50)
    args.threads = args.threads or (1 if cpu else os.cpu_count() or 1)
    if args.one:
        print("RESULT " + json.dumps(run_one(args.one, args.batch[0], args)), flush=True)
        return
    kinds = ["standard", "zeroshard"] + (list(DEEPSPEED_CONFIGS) if deepspeed_installed() else [])
    results = [in_fresh_process(kind, batch, args) for batch in args.batch for kind in kinds]
    text = report(results, args)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "seed_replication.md"), "w") as f:
        f.write(text + "\n")
    with open(os.path.join(OUT, "seed_replication.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print(text)


if __name__ == "__main__":
    main()
