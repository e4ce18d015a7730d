"""`zeroshard train`: a small GPT trained with ZeRO on local ranks, with the paper's figures on screen.

`launch` starts one process per rank through torch's elastic launcher (what torchrun uses); each
rank runs `worker`, which reads top to bottom like any training loop. `zeroshard compare` runs the
same worker once per stage and once with plain torch DDP (`ddp=True`) as the baseline. With
`max_restarts`, the launcher restarts every rank after one dies and the group resumes from this run's
last checkpoint (`save_every`), exactly: see restart.py.
"""
from __future__ import annotations

import copy
import os
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable

import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import zeroshard

from .baseline import DDPBaseline
from .data import Batches, load_corpus
from .gpt import GPT, config_for, lm_loss, sample
from .report import (MIB, bytes_per_param, gpu_peak, gpu_reserved_peak, peak_rss, print_report,
                     reset_peak_rss, resident_rss)
from .restart import (checkpoints_of, drill_target, maybe_kill, new_run_id, report_line, resume,
                      store_per_attempt, write_progress)


@dataclass
class TrainArgs:
    stage: int = 3
    ddp: bool = False            # no ZeRO: torch DistributedDataParallel (compare's baseline)
    device: str = "cpu"          # "cpu" (gloo ranks) or "cuda" (one GPU per rank, NCCL)
    nproc: int = 2
    steps: int = 300
    batch_size: int = 8          # per rank
    seq_len: int = 64
    size: str = "small"
    layers: int | None = None
    width: int | None = None
    lr: float | None = None      # None: the config's optimizer section, else AdamW at DEFAULT_LR
    precision: str = "fp32"
    data: list[str] = field(default_factory=list)
    config: str | None = None    # a DeepSpeed-style JSON; the fields here (as the CLI resolved them) win
    config_contents: dict | None = None  # its keys as read at launch: what the run trained with
    offload_optimizer: str | None = None  # "none", "cpu" or "nvme"; None: as the config says
    offload_param: str | None = None
    nvme_path: str | None = None  # where "nvme" offload writes its files; None: as the config says
    hf_config: str | None = None  # a Hugging Face config.json: that architecture, built from scratch
    out: str = "out"
    resume: bool = False
    max_restarts: int = 0        # the launcher restarts the whole group up to this many times
    save_every: int = 0          # checkpoint every this many steps too (0: only at the end)
    run_id: str = ""             # set by launch, once per call: which checkpoints are this run's
    sample_tokens: int = 160
    save: bool = True            # checkpoint at the end (compare's runs do not: it reports no checkpoint)
    seed: int = 0
    compile: bool = False        # torch.compile each block (FSDP2's per-block pattern)
    tp: int = 1                  # tensor-parallel ranks (the model's own plan); ZeRO over nproc / tp
    activation_checkpointing: bool = False  # ZeRO-R: recompute each block in backward
    partition_activations: bool = False     # P_a: split the kept block inputs over tp
    cpu_checkpointing: bool = False         # P_a+cpu: keep them in host memory
    quiet: bool = False          # compare: no progress bar, no report

    def engine_config(self) -> dict[str, Any]:
        raw = copy.deepcopy(self.config_contents) if self.config_contents is not None else \
            zeroshard.Config.read(self.config) if self.config else {}
        raw["zero_optimization"] = {**raw.get("zero_optimization", {}), "stage": self.stage}
        for key in ("offload_optimizer", "offload_param"):  # given on the command line: they win
            if self.ddp:  # compare's baseline: plain torch takes the config's recipe, offloading nothing
                raw["zero_optimization"].pop(key, None)
                continue
            if getattr(self, key) is not None:
                section = {**raw["zero_optimization"].get(key, {}), "device": getattr(self, key),
                           "pin_memory": True}
                raw["zero_optimization"][key] = section
            if self.nvme_path is not None and raw["zero_optimization"].get(key, {}).get("device") == "nvme":
                raw["zero_optimization"][key]["nvme_path"] = self.nvme_path
        for name in ("bf16", "fp16"):
            raw[name] = {**raw.get(name, {}), "enabled": self.precision == name}
        if self.lr is not None and "optimizer" in raw:  # --lr given: it sets the section's lr
            raw["optimizer"] = {**raw["optimizer"], "params": {**raw["optimizer"].get("params", {}),
                                                               "lr": self.lr}}
        if "train_batch_size" in raw and "gradient_accumulation_steps" not in raw:  # the one they imply
            config = zeroshard.Config.load(raw)
            config.check_batch_sizes(self.nproc // self.tp)
            raw["gradient_accumulation_steps"] = config.gradient_accumulation_steps
        raw["train_micro_batch_size_per_gpu"] = self.batch_size  # what the loop feeds each rank
        raw.pop("train_batch_size", None)  # (the CLI checked it against the micro-batch)
        flags = ("partition_activations", "cpu_checkpointing")
        if self.activation_checkpointing or any(getattr(self, f) for f in flags):
            raw["activation_checkpointing"] = {**raw.get("activation_checkpointing", {}),
                                               **{f: True for f in flags if getattr(self, f)}}
        return raw


def build_model(args: TrainArgs) -> nn.Module:
    if args.hf_config:
        from zeroshard.hf import causal_lm_from_config
        return causal_lm_from_config(args.hf_config, args.seq_len)
    return GPT(config_for(args.size, args.layers, args.width, args.seq_len))


def compile_blocks(model: nn.Module) -> None:
    """torch.compile every block (each entry of an nn.ModuleList, the units stage 3 gathers), as
    FSDP2 recommends: one graph per block shape, compiled once; the hooks run between them."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList):
            for block in module:
                block.compile()


def launch(args: TrainArgs, target: Callable[..., Any] | None = None, *more: Any) -> Any:
    """Run `target(args, *more)` (default: `worker`) on args.nproc local ranks, restarting them all
    up to args.max_restarts times after one fails; returns rank 0's result (of the attempt that
    finished)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    drill_target()  # a malformed drill variable fails here, once, not in every rank
    args = replace(args, run_id=new_run_id())  # a fresh id per call, even for reused args
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=args.nproc,
                          run_id=f"zeroshard-{args.run_id}", rdzv_backend="c10d",
                          rdzv_endpoint=f"127.0.0.1:{port}", max_restarts=args.max_restarts,
                          monitor_interval=0.2)
    with store_per_attempt():
        return elastic_launch(config, target or worker)(args, *more)[0]


def build_engine(args: TrainArgs):
    """Collective. The model from args.seed, trained by DDP (args.ddp) or by a ZeRO engine."""
    torch.manual_seed(args.seed)
    mesh = None
    if args.tp > 1:  # built whole, then split over tp by its own plan (torch's parallelize_module)
        mesh = init_device_mesh(args.device, (args.nproc // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
        model = zeroshard.tensor_parallel(build_model(args), mesh["tp"])
    elif args.ddp:
        model = build_model(args)
    else:  # partitioned construction: the same values, but no rank ever holds the whole model
        with zeroshard.init():
            model = build_model(args)
    if args.compile:
        compile_blocks(model)
    config = zeroshard.Config.load(args.engine_config())
    make_opt = optimizer_of(config, args)
    return DDPBaseline(model, make_opt, args.device, config) if args.ddp else \
        zeroshard.initialize(model, make_opt, config, mesh=mesh)


# AdamW's learning rate without --lr or an optimizer section. 3e-3 is a little ahead over the CPU's
# short default run, but over longer ones it left every built-in size short of what 1e-3 reaches
# in the same steps, and the large GPT of a GPU's default run on a plateau of whitespace.
DEFAULT_LR = 1e-3


def optimizer_of(config: "zeroshard.Config", args: TrainArgs) -> Callable | None:
    """AdamW (DEFAULT_LR unless --lr, weight decay 0.1), or None where the config's "optimizer"
    section builds the optimizer (for the DDP baseline too: the same class and options)."""
    if config.optimizer is not None:
        if not args.ddp:
            return None  # initialize builds it from the section (fused over host shards, as DeepSpeed)
        cls, options = config.optimizer.build_class(), dict(config.optimizer.params)
        return lambda p: cls(p, **options)
    # Over host shards (offload), torch's fused CPU kernel is several times faster than foreach. On a
    # GPU both sides get the fused kernel, which also lets zeroshard decide the step there.
    fused = args.device == "cuda" or (not args.ddp and config.zero.offload_optimizer)
    lr = DEFAULT_LR if args.lr is None else args.lr
    return lambda p: torch.optim.AdamW(p, lr=lr, weight_decay=0.1, fused=fused or None)


def start_rank(args: TrainArgs) -> None:
    """A rank's threads (the cores shared out), and its process group from the launcher's variables
    (initialize would, DDP does not), on the backend asked for."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.nproc))
    zeroshard.ensure_process_group(backend="nccl" if args.device == "cuda" else "gloo")


def train_batch(data: Batches, args: TrainArgs, step: int, dp_rank: int, dp: int, device: torch.device):
    """(inputs, targets) of `step` for this dp rank, on `device`: the same for any implementation,
    and for the tp ranks of one model shard."""
    rng = torch.Generator().manual_seed((args.seed * 1_000_003 + step) * dp + dp_rank)
    return tuple(t.to(device) for t in data.get("train", args.batch_size, rng))


def train_step(engine, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward, backward, optimizer step; returns the loss. A GPU step is done when its kernels
    are, not when they are queued: it waits for them."""
    loss = lm_loss(logits_of(engine(x)), y)
    engine.backward(loss)
    engine.step()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return loss


def worker(args: TrainArgs) -> dict[str, Any]:
    start_rank(args)
    reset_peak_rss()
    rss_before = resident_rss()  # the runtime's own memory, before any model exists
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    engine = build_engine(args)
    phases = {"built": peak_rss() - rss_before}  # the peak RSS growth so far: where the host peak is
    rank = zeroshard.rank_and_world_size()[0]
    dp_rank, dp = data_rank(engine)
    data = Batches(load_corpus(args.data or None), args.seq_len)
    checkpoints = checkpoints_of(args.out)
    history, resumed = resume(engine, checkpoints, args.out, args.run_id, explicit=args.resume, lr=args.lr)
    progress = _progress(args, rank, initial=len(history))
    times, tokens, states_mib = [], 0, None
    kill, track = drill_target(), args.max_restarts > 0 and rank == 0
    if track:
        os.makedirs(args.out, exist_ok=True)
    for step in range(len(history), args.steps):
        maybe_kill(kill, rank, step)
        x, y = train_batch(data, args, step, dp_rank, dp, engine.device)
        start = time.perf_counter()
        loss = train_step(engine, x, y)
        times.append(time.perf_counter() - start)
        history.append(zeroshard.mean_over_ranks(loss))
        tokens += x.numel() * dp
        if states_mib is None:  # once: memory_stats() waits for a pipelined update, which a step
            # time must count where the next forward waits for it, not between the timed steps
            states_mib = engine.memory_stats()["model_states_in_step"] / MIB
            phases["first_step"] = peak_rss() - rss_before
        # (no refresh of its own: update() redraws at the bar's pace, a line in 10 s into a log)
        progress.set_postfix(loss=f"{history[-1]:.3f}", tok_s=f"{tokens / sum(times):.0f}",
                             states_MiB=f"{states_mib:.1f}", refresh=False)
        progress.update()
        resumed.first_step_done()
        _checkpoint_if_due(engine, args, history, track)
    progress.close()
    val = _evaluate(engine, data, args)
    stats = engine.memory_stats()
    if not args.ddp and args.save:
        engine.save_checkpoint(checkpoints, client_state=_client_state(args, history))
    text = _sample(engine, args, data)
    per_rank = zeroshard.gather_objects(stats)  # collective: every rank takes part
    peaks = zeroshard.gather_objects((peak_rss() - rss_before, gpu_peak(engine.device),
                                      gpu_reserved_peak(engine.device)))
    if rank == 0 and not args.quiet:
        print_report(engine, args, per_rank, history, val, text, sum(times), checkpoints)
        if resumed.restarts:
            print(report_line(resumed))
    return {"train_loss": history[-1] if history else float("nan"), "val_loss": val,
            "step_ms": 1000 * statistics.median(times[1:] or times) if times else float("nan"),
            "step_s_each": times,
            "model_states": stats["model_states_in_step"], "memory_stats": stats,
            "psi": engine.num_parameters(),
            "bytes_per_param": bytes_per_param(engine, args.precision),
            "rss_growth": max(p[0] for p in peaks), "gpu_peak": max(p[1] for p in peaks),
            "gpu_reserved": max(p[2] for p in peaks), "rss_growth_phases": phases,
            "run_id": args.run_id, **resumed.as_dict()}


def _checkpoint_if_due(engine, args: TrainArgs, history: list[float], track: bool) -> None:
    """After each step: rank 0 records the progress (when restarts are allowed), and every
    save_every steps all ranks save a checkpoint (the last step's is saved after evaluation)."""
    done = len(history)
    if track:
        write_progress(args.out, args.run_id, done)
    due = args.save_every > 0 and done % args.save_every == 0 and done < args.steps
    if not args.ddp and args.save and due:
        engine.save_checkpoint(checkpoints_of(args.out),
                               client_state=_client_state(args, history))
        if track:  # alive after the save: the restart time counts from here
            write_progress(args.out, args.run_id, done)


def _client_state(args: TrainArgs, history: list[float]) -> dict[str, Any]:
    """What a resumed run needs besides the engine's state: the loss history (its length is the
    step to resume from), the arguments, and the run id that marks the checkpoint as this run's."""
    return {"losses": list(history), "args": asdict(args), "run_id": args.run_id}


def logits_of(output: Any) -> torch.Tensor:
    return output.logits if hasattr(output, "logits") else output  # Hugging Face models


def _progress(args: TrainArgs, rank: int, initial: int):
    from tqdm import tqdm
    return tqdm(total=args.steps, initial=initial, disable=rank != 0 or args.quiet, desc="train",
                dynamic_ncols=True, mininterval=0.1 if sys.stderr.isatty() else 10)  # a log: a line in 10 s


@torch.no_grad()
def _evaluate(engine, data: Batches, args: TrainArgs, batches: int = 4) -> float:
    """Validation loss in eval mode (no dropout, so no draw from the RNG the checkpoint saves)."""
    rng = torch.Generator().manual_seed(12345 + data_rank(engine)[0])
    pairs = (data.get("val", args.batch_size, rng) for _ in range(batches))
    engine.eval()
    losses = [lm_loss(logits_of(engine(x.to(engine.device))), y.to(engine.device)) for x, y in pairs]
    engine.train()
    return zeroshard.mean_over_ranks(torch.stack(losses).mean())


def _sample(engine, args: TrainArgs, data: Batches) -> str:
    """What the model learned: it continues a prompt from the validation text, which it never
    trained on. Every rank samples together with the same seed (stage 3 unshards in each forward)."""
    if not args.sample_tokens:
        return ""
    prompt = torch.tensor([prompt_from(data.splits["val"], args.seq_len)], device=engine.device)
    engine.eval()
    out = sample(lambda idx: logits_of(engine(idx)), prompt, args.sample_tokens, args.seq_len,
                 torch.Generator().manual_seed(args.seed), temperature=SAMPLE_TEMPERATURE)
    engine.train()
    return bytes(out[0].clamp(max=255).tolist()).decode("utf-8", errors="replace")


# below 1: the likelier bytes; not far below: a byte model sharpened too much repeats its likeliest
# byte (in Python source, the space of an indent) for the whole sample
SAMPLE_TEMPERATURE = 0.8


def prompt_from(text: torch.Tensor, seq_len: int) -> list[int]:
    """The first function definition's line in `text` (bytes), at most half the context long:
    `def name(...):` and the model writes the body. Its first line where there is no `def`."""
    raw = bytes(text[:200_000].tolist())
    start = raw.find(b"\ndef ") + 1  # 0 where there is none: the text's first line
    end = raw.find(b"\n", start)
    end = len(raw) if end < 0 else end + 1
    return list(raw[start:min(end, start + max(8, seq_len // 2))])


def data_rank(engine) -> tuple[int, int]:
    """(this rank's index, ranks) among those reading different data: the dp group, in every MiCS
    copy (the tp ranks of one model shard read the same batch), the world for the DDP baseline."""
    comm = getattr(engine, "comm", None)
    return comm.data_parallel if comm is not None else zeroshard.rank_and_world_size()
