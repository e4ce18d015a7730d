"""ZeRO-Offload on one GPU (issue 13's table): zeroshard stages 2 and 3 with and without offload, beside
DeepSpeed's offload (where installed) and FSDP2's CPUOffloadPolicy, on a Llama-shaped model.

Every run trains the same Hugging Face Llama (built from a config, nothing downloaded) on the same random
tokens in bf16 (`--precision`) with fused AdamW, world size 1, each in a fresh process (its GPU peak and
host RSS are its own), in interleaved rounds. Reported per run: median step time (median over rounds),
tokens/s, the time in the optimizer step call (zeroshard's pipelined update returns from step() at
once: its work shows in the next forward, so compare step times), GPU peak allocated, peak host RSS,
last loss.
`--largest` instead searches, per offloading implementation, the most layers of the model's shape that
train two steps at micro-batch 1 (a fresh process per try).

    python benchmarks/offload.py                          # 1.1B (hidden 2048, 22 layers), seq 1024, batch 8
    python benchmarks/offload.py --shape 2.8b --batch 4   # hidden 3072, 26 layers
    python benchmarks/offload.py --clip 1.0               # with gradient clipping, every run
    python benchmarks/offload.py --largest                # the largest model each one trains on this GPU
    python benchmarks/offload.py --device cpu --shape small --seq 128 --batch 4 --precision fp32  # CPU

Writes benchmarks/out/offload.{md,json}.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_step import (LLAMA_1B, TINY, add_run_options, build_model as build_llama, parse_run_args,  # noqa: E402
                      run_worker, start_process_group, write)

SHAPES = {"small": dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=4096),  # for CPU runs
          "1.1b": LLAMA_1B, "2.8b": {**LLAMA_1B, "hidden_size": 3072, "intermediate_size": 8192,
                                     "num_hidden_layers": 26, "num_attention_heads": 24,
                                     "num_key_value_heads": 8}}
OFFLOAD_OPT = {"offload_optimizer": {"device": "cpu", "pin_memory": True}}
OFFLOAD_ALL = {**OFFLOAD_OPT, "offload_param": {"device": "cpu", "pin_memory": True}}
ZEROSHARD = {"zeroshard_2": (2, {}, {}), "zeroshard_3": (3, {}, {}),  # stage, offload, "zeroshard" keys
             "zeroshard_2_offload": (2, OFFLOAD_OPT, {}),
             "zeroshard_2_offload_pipelined": (2, OFFLOAD_OPT, {"pipelined_update": True}),
             "zeroshard_3_offload": (3, OFFLOAD_OPT, {}),  # pipelined: the default at stage 3
             "zeroshard_3_offload_sequential": (3, OFFLOAD_OPT, {"pipelined_update": False}),
             "zeroshard_3_offload_dpu": (3, OFFLOAD_OPT, {"delayed_param_update": True}),
             "zeroshard_3_offload_params": (3, OFFLOAD_ALL, {})}
DEEPSPEED = {"deepspeed_2_offload": (2, OFFLOAD_OPT), "deepspeed_3_offload": (3, OFFLOAD_OPT),
             "deepspeed_3_offload_params": (3, OFFLOAD_ALL)}
FSDP = ["fsdp2", "fsdp2_offload"]
LARGEST = ["zeroshard_3_offload_params", "deepspeed_3_offload_params", "fsdp2_offload"]


def available(device: str) -> list[str]:
    """The runs that apply here: DeepSpeed needs itself and a GPU; FSDP2's offload needs a GPU."""
    names = list(ZEROSHARD) + ["fsdp2"]
    if device == "cuda":
        names.append("fsdp2_offload")
        if importlib.util.find_spec("deepspeed") is not None:
            names += list(DEEPSPEED)
    return names


def build_model(args: argparse.Namespace):
    shape = dict(TINY if args.tiny else SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    return build_llama(args, shape)


def make_step(name: str, model, device, args: argparse.Namespace):
    """(input_ids) -> (loss tensor, seconds in the optimizer step or None), one step done."""
    import torch
    if name in ZEROSHARD:
        import zeroshard
        stage, offload, keys = ZEROSHARD[name]
        engine = zeroshard.initialize(model, None, {
            "zero_optimization": {"stage": stage, **offload}, "bf16": {"enabled": args.precision == "bf16"},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "fused": True}},  # as FSDP2's below
            "gradient_clipping": args.clip, "zeroshard": keys})
        return _timed(lambda ids: engine(input_ids=ids, labels=ids).loss, engine.backward, engine.step,
                      device)
    if name in DEEPSPEED:
        import deepspeed
        stage, offload = DEEPSPEED[name]
        deepspeed.init_distributed()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config={
            "train_micro_batch_size_per_gpu": args.batch, "bf16": {"enabled": args.precision == "bf16"},
            "zero_optimization": {"stage": stage, **offload}, "gradient_clipping": args.clip,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}})
        return _timed(lambda ids: engine(input_ids=ids, labels=ids).loss, engine.backward, engine.step,
                      device)
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
    offload = CPUOffloadPolicy() if name == "fsdp2_offload" else None
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    kwargs = {"mp_policy": MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)}
    if offload is not None:
        kwargs["offload_policy"] = offload  # parameters, gradients and the step on the host
    else:
        model.to(device)
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def update() -> None:
        if args.clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return _timed(lambda ids: model(input_ids=ids, labels=ids).loss, lambda loss: loss.backward(), update,
                  device)


def _timed(forward, backward, update, device):
    import torch

    def step(ids):
        loss = forward(ids)
        backward(loss)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        update()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return loss, time.perf_counter() - start
    return step


def worker(name: str, args: argparse.Namespace) -> dict:
    import torch
    device = start_process_group(args)
    model, vocab = build_model(args)
    params = sum(p.numel() for p in model.parameters())  # before stage 3 leaves placeholders
    step = make_step(name, model, device, args)
    g = torch.Generator().manual_seed(1)
    times, updates, loss = [], [], float("nan")
    for i in range(args.warmup + args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        start = time.perf_counter()
        out, update_s = step(ids)
        loss = out.item()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
            updates.append(update_s)
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else 0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    return {"name": name, "step_s": statistics.median(times), "update_s": statistics.median(updates),
            "loss": loss, "peak_gib": peak / 2**30, "rss_gib": rss / 2**30,
            "params": params}


def largest(args: argparse.Namespace, names: list[str]) -> list[str]:
    """Per implementation: the most layers (doubling, then bisecting) that train at micro-batch 1."""
    lines = [f"{'run':<28} {'layers':>7} {'parameters':>15}"]
    for i, name in enumerate(names):
        fits, port = {}, 29700 + 50 * i

        def trains(layers: int) -> bool:
            nonlocal port
            port += 1
            fits[layers] = run_worker(__file__, name, port, ["--layers", str(layers), "--batch", "1",
                                                          "--warmup", "1", "--steps", "1"])
            return fits[layers] is not None
        lo, hi = 0, 8
        while hi <= 4096 and trains(hi):
            lo, hi = hi, hi * 2
        while hi - lo > 1 and lo < 4096:  # (at the cap, `lo` is a lower bound)
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if trains(mid) else (lo, mid)
        params = fits[lo]["params"] if lo else 0
        lines.append(f"{name:<28} {lo:>7} {params:>15,}")
        print(lines[-1], flush=True)
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_options(p)
    p.add_argument("--shape", default="1.1b", choices=sorted(SHAPES))
    p.add_argument("--layers", type=int, help="override the shape's number of layers")
    p.add_argument("--precision", default="bf16", choices=["bf16", "fp32"],
                   help="compute dtype (bf16 matmuls are slow on most CPUs: use fp32 there)")
    p.add_argument("--impls", nargs="+", choices=list(ZEROSHARD) + list(DEEPSPEED) + FSDP)
    p.add_argument("--largest", action="store_true", help="search the largest model per offloading run")
    p.add_argument("--clip", type=float, default=0.0, help="gradient clipping max norm (default 0: none)")
    args = parse_run_args(p, worker)
    if args is None:
        return
    here = available(args.device)
    skipped = [n for n in list(ZEROSHARD) + list(DEEPSPEED) + FSDP if n not in here]
    if skipped:
        print(f"not run here ({args.device}{', no deepspeed' if args.device == 'cuda' else ''}): "
              f"{', '.join(skipped)}", flush=True)
    names = [n for n in (args.impls or (LARGEST if args.largest else here)) if n in here]
    if args.largest:
        write("offload_largest", largest(args, names), {"args": vars(args)})
        return
    results: dict[str, list[dict]] = {n: [] for n in names}
    for round_ in range(args.rounds):
        for i, name in enumerate(names):
            r = run_worker(__file__, name, 29600 + 20 * round_ + i)
            if r is not None:
                results[name].append(r)
                print(f"round {round_ + 1}: {name} {r['step_s']:.3f} s", flush=True)
    tokens = args.batch * args.seq
    lines = [f"{'run':<28} {'step s':>8} {'tokens/s':>10} {'update s':>9} {'GPU peak GiB':>13} "
             f"{'host RSS GiB':>13} {'last loss':>10}"]
    for name, runs in results.items():
        if runs:
            s, u = (statistics.median(r[k] for r in runs) for k in ("step_s", "update_s"))
            lines.append(f"{name:<28} {s:>8.3f} {tokens / s:>10,.0f} {u:>9.3f} {runs[-1]['peak_gib']:>13.2f} "
                         f"{max(r['rss_gib'] for r in runs):>13.2f} {runs[-1]['loss']:>10.4f}")
    write("offload", lines, {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
