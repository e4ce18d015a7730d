"""Bytes that cross nodes, per layout: counted on 4 gloo ranks as 2 nodes x 2, then projected.

Four processes on this machine, told they are two nodes of two ranks (`"zeroshard": {"ranks_per_node":
2}`), train the built-in GPT with bf16 parameters and gradients under each layout, and print the
inter-node bytes of one optimizer step (a collective's bytes count as inter-node when its group spans
nodes, the paper's convention: per rank, an all-reduce 2x its size, a gather or reduce-scatter its
full size) as a multiple of Ψ x 2 bytes, beside the formula for the layout. Then a scale note: from
those multiples (their formulas, checked here at 2 x 2) and a stated link model, the communication
time of one step for 7B and 70B models at 16-64 nodes.

Step times are printed too, but loopback is not a node link: they show what a layout costs in
compute and copies here, not what it saves on a network.

    python benchmarks/topology.py                   # stage 3 and MiCS, about a minute
    python benchmarks/topology.py --steps 5 --layers 4 --width 256
"""
from __future__ import annotations

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import zeroshard
from zeroshard.app.data import Batches, load_corpus
from zeroshard.app.gpt import GPT, GPTConfig, lm_loss

RANKS, PER_NODE = 4, 2
# name -> (zero_optimization keys, the formula's inter-node multiple of Ψ x 2 bytes at 2 x 2, its text)
LAYOUTS: dict[str, tuple[dict, float, str]] = {
    "stage 3": ({"stage": 3}, 3.0, "3 (gather fwd + gather bwd + reduce-scatter, all across)"),
    "MiCS 2": ({"stage": 3, "mics_shard_size": 2}, 1.0, "2 x Ψ/2 (all-reduce of the shard over 2 replicas)"),
    "hpZ": ({"stage": 3, "zero_hpz_partition_size": 2}, 2.0, "2 (gather fwd + reduce-scatter; bwd inside)"),
    "hpZ+qwZ": ({"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True}, 1.5,
                "0.5 + 1 (fwd gather at 1 byte + scales; reduce-scatter)"),
    "hpZ+qwZ+qgZ": ({"stage": 3, "zero_hpz_partition_size": 2, "zero_quantized_weights": True,
                     "zero_quantized_gradients": True}, 0.625,
                    "0.5 + 1/8 (+ scales: int4 partial sums of Ψ/2 across)"),
}
QUALITY = ("stage 3", "hpZ+qwZ+qgZ")  # --quality: the exact run and the quantized one


def measure(rank: int, layouts: list[str], args: argparse.Namespace, port: int, out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=RANKS)
    torch.set_num_threads(1)
    for name in layouts:
        torch.manual_seed(0)
        model = GPT(GPTConfig(layers=args.layers, width=args.width, heads=4, seq_len=args.seq))
        # overlap_comm off: no unit kept gathered from forward into backward (the paper's profile)
        config = {"zero_optimization": {**LAYOUTS[name][0], "overlap_comm": False},
                  "bf16": {"enabled": True}, "zeroshard": {"ranks_per_node": PER_NODE}}
        engine = zeroshard.initialize(model, lambda p: torch.optim.AdamW(p, lr=1e-3), config)
        batches, gen = Batches(load_corpus(None), args.seq), torch.Generator().manual_seed(rank)
        times, losses = [], []
        for _ in range(args.steps):
            x, y = batches.get("train", args.batch, gen)
            start = time.perf_counter()
            loss = lm_loss(engine(x), y)
            engine.backward(loss)
            engine.step()
            times.append(time.perf_counter() - start)
            losses.append(zeroshard.mean_over_ranks(loss))
        step = engine.comm_stats()["last_step"]
        weights = engine.full_state_dict()
        if rank == 0:
            out[name] = {"psi": engine.num_parameters(), "seconds": statistics.median(times[1:]),
                         "inter": sum(v["inter_node_bytes"] for v in step.values()),
                         "all": sum(v["bytes"] for v in step.values()),
                         "loss": sum(losses[-10:]) / len(losses[-10:]),
                         "weights": {k: v.float() for k, v in weights.items()} if args.quality else None}
    dist.destroy_process_group()


def scale_note(multiples: dict[str, tuple[float, int]], gbps: float, tflops: float, per_node: int,
               tokens: int, gpu_gib: float) -> None:
    """Per-GPU time of one step's cross-node traffic (each GPU its own NIC of `gbps`) beside its
    compute (6 Ψ FLOPs per token at `tflops`), and the step if they overlap fully (the larger of the
    two). `multiples`: layout -> (cross-node bytes in Ψ x 2, the ranks sharding the model states, 0:
    all of them), the model states (16 bytes per parameter) checked against `gpu_gib`."""
    print(f"\nscale note: {per_node} GPUs per node, {gbps:g} Gb/s per GPU across nodes, {tflops:g} TFLOP/s "
          f"achieved per GPU, {tokens} tokens per GPU per step; seconds per step: compute, then per "
          f"layout cross-node time / step time (max of the two); '-': model states over {gpu_gib:g} GiB")
    print(f"{'model':>6} {'nodes':>6} {'compute':>8} " + " ".join(f"{n:>14}" for n in multiples))
    for psi in (7e9, 70e9):
        for nodes in (16, 32, 64):
            compute = 6 * psi * tokens / (tflops * 1e12)
            cells = []
            for multiple, shards in multiples.values():
                comm = multiple * psi * 2 / (gbps * 1e9 / 8)
                fits = 16 * psi / (shards or nodes * per_node) <= gpu_gib * 2**30
                cells.append(f"{comm:6.2f} / {max(comm, compute):5.2f}" if fits else "-")
            print(f"{psi / 1e9:>5.0f}B {nodes:>6} {compute:>8.2f} " + " ".join(f"{c:>14}" for c in cells))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=list(LAYOUTS))
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--quality", action="store_true",
                   help=f"train {' and '.join(QUALITY)} for --steps (200 suggested) on text; compare losses")
    p.add_argument("--gbps", type=float, default=200, help="scale note: Gb/s per GPU across nodes")
    p.add_argument("--tflops", type=float, default=300, help="scale note: achieved TFLOP/s per GPU")
    p.add_argument("--gpu-gib", type=float, default=80, help="scale note: GPU memory, GiB")
    p.add_argument("--tokens", type=int, default=8192, help="scale note: tokens per GPU per step")
    args = p.parse_args()
    if args.quality:
        args.layouts = list(QUALITY)
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(measure, args=(args.layouts, args, free_port(), out), nprocs=RANKS,
                           start_method="spawn")
        results = dict(out)
    print(f"{RANKS} ranks as {RANKS // PER_NODE} nodes x {PER_NODE}, bf16, built-in GPT "
          f"(Ψ = {results[args.layouts[0]]['psi']:,}); inter-node bytes of one step per rank, in Ψ x 2 bytes")
    print(f"{'layout':>10} {'across':>8} {'formula':>8} {'all':>8} {'step s':>8}  formula")
    for name in args.layouts:
        r, (_, formula, why) = results[name], LAYOUTS[name]
        unit = r["psi"] * 2
        print(f"{name:>10} {r['inter'] / unit:>8.3f} {formula:>8.3f} {r['all'] / unit:>8.3f} "
              f"{r['seconds']:>8.3f}  {why}")
    if args.quality:
        exact, quantized = (results[name] for name in QUALITY)
        worst = max((quantized["weights"][k] - v).abs().max().item() for k, v in exact["weights"].items())
        print(f"\nafter {args.steps} steps (mean loss of the last 10): {QUALITY[0]} {exact['loss']:.4f}, "
              f"{QUALITY[1]} {quantized['loss']:.4f} "
              f"({100 * (quantized['loss'] / exact['loss'] - 1):+.2f}%); "
              f"largest weight difference {worst:.3g}")
    # Projected from what was counted: stage 3's multiple as measured; at nodes of 8 GPUs a MiCS group
    # of one node all-reduces Ψ/8 shards where the 2 x 2 run all-reduced Ψ/2: the measured multiple x 2/8.
    measured = {name: results[name]["inter"] / (results[name]["psi"] * 2) for name in args.layouts}
    projected = {"stage 3": (measured.get("stage 3", 3.0), 0),
                 "MiCS 8": (measured.get("MiCS 2", 1.0) * 2 / 8, 8)}
    # ZeRO++ at nodes of 8 (hpZ over the node): forward's gather (1 byte an element with qwZ) and the
    # reduce-scatter (int4 partial sums of Ψ/8 with qgZ) cross; scales as measured at 2 x 2.
    if "hpZ" in measured:
        projected["hpZ"] = (measured["hpZ"], 0)
    if "hpZ+qwZ+qgZ" in measured:
        qgz_2x2 = measured["hpZ+qwZ+qgZ"] - measured.get("hpZ+qwZ", 1.5) + 1  # its reduce-scatter part
        projected["hpZ+qwZ+qgZ"] = (measured["hpZ+qwZ+qgZ"] - qgz_2x2 + qgz_2x2 * 2 / 8, 0)
    scale_note(projected, args.gbps, args.tflops, 8, args.tokens, args.gpu_gib)


if __name__ == "__main__":
    main()
