"""The `zeroshard` command: `train` (the main job), `compare`, `estimate` (the paper's memory model)
and `consolidate`."""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .sizes import SIZES, heads_for
from .options import DEFAULT_RUN, check_nvme_path, check_steps_beyond_checkpoint, default_run, hold_out, \
    defaults_from_config, ranks_report_errors, resolve_device, resume_settings


def _add_training_options(p: argparse.ArgumentParser, steps: int, gpu_run: bool) -> None:
    """gpu_run: on a GPU the defaults are options.DEFAULT_RUN's larger run (train), else the CPU's."""
    def on_gpu(cpu: object, gpu: object) -> str:
        return f"default {cpu}; {gpu} on a GPU" if gpu_run else f"default {cpu}"
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="cuda: one rank per GPU over NCCL; cpu: gloo ranks; auto: cuda when available")
    p.add_argument("--nproc", type=int, help="local ranks (default: every GPU on cuda, 2 on cpu)")
    p.add_argument("--steps", type=int,
                   help=f"training steps in total, one micro-batch each (optimizer steps x "
                        f"gradient_accumulation_steps; {on_gpu(steps, DEFAULT_RUN['cuda']['steps'])})")
    p.add_argument("--batch-size", type=int, help="sequences per rank per step (default: the config's "
                                                   f"micro-batch, else {on_gpu(8, 32)[8:]})")
    p.add_argument("--seq-len", type=int, help=f"bytes per sequence ({on_gpu(64, 256)})")
    p.add_argument("--size", choices=sorted(SIZES), help=f"named model size ({on_gpu('small', 'large')})")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--width", type=int, help="override the model width")
    p.add_argument("--hf-config", help="a Hugging Face config.json: train that architecture from scratch "
                                       "(needs transformers)")
    p.add_argument("--precision", choices=["fp32", "bf16", "fp16"],
                   help="fp32, or mixed precision with fp32 master weights (default: the config's "
                        "bf16/fp16 section, else fp32)")
    resumed = ", also over a resumed optimizer's" if gpu_run else ""  # (compare does not resume)
    p.add_argument("--lr", type=float, help=f"learning rate{resumed} (default: the config's optimizer "
                                            f"section, else AdamW at 1e-3; refused beside a scheduler "
                                            f"section)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile each block (every nn.ModuleList entry) before training")
    p.add_argument("--data", nargs="+", default=[], help="text files or directories (default: the "
                                                         "Python standard library's own source)")
    p.add_argument("--config", help="a DeepSpeed-style JSON config: its stage, precision, micro-batch, "
                                    "optimizer, scheduler, clipping and accumulation are used; a flag "
                                    "given on the command line overrides the config")
    p.add_argument("--out", default="out", help="output directory (default ./out)")
    own = "; --resume: the run's" if gpu_run else ""  # (compare does not resume)
    p.add_argument("--seed", type=int, help=f"seed of the model's initial values, the batches and the "
                                            f"sample (default 0{own})")


def _add_offload_options(p: argparse.ArgumentParser) -> None:
    # A bare --offload-optimizer means cpu, as the flag it replaces did. Not given: the config's.
    p.add_argument("--offload-optimizer", nargs="?", const="cpu", choices=["none", "cpu", "nvme"],
                   help="fp32 master weights and optimizer state in host memory (cpu) or in files "
                        "under --nvme-path (nvme, ZeRO-Infinity) (stage >= 1)")
    p.add_argument("--offload-param", nargs="?", const="cpu", choices=["none", "cpu", "nvme"],
                   help="stage 3: parameter shards rest in host memory (cpu) or in files (nvme) between uses")


def _add_tensor_parallel_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks: the model is split by its own "
                   "plan (Megatron's column/row split), ZeRO shards over the nproc / tp data-parallel "
                   "ranks (default 1)")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="ZeRO-R: keep only each block's input and recompute the block in backward")
    p.add_argument("--partition-activations", action="store_true",
                   help="P_a: split each kept block input over the tp ranks (implies checkpointing)")
    p.add_argument("--cpu-checkpointing", action="store_true",
                   help="P_a+cpu: keep the block inputs in host memory (implies checkpointing)")


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a small GPT with ZeRO on local ranks",
                       description="Train a byte-level GPT on the Python standard library's source "
                                   "(or --data) with ZeRO across local ranks; report memory and traffic "
                                   "beside the paper's formulas, plot the loss, sample text, checkpoint.")
    p.add_argument("--stage", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage (default: the config's, else 3)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoints up to --steps in "
                                                          "total, with the run's settings where no flag is "
                                                          "given (any stage or --nproc may be given)")
    p.add_argument("--max-restarts", type=int, default=0, metavar="K",
                   help="after a rank dies (killed, out of memory), restart every rank up to K times; "
                        "the group resumes from this run's last checkpoint (default 0)")
    p.add_argument("--save-every", type=int, default=0, metavar="S",
                   help="also checkpoint every S steps, so a restart loses at most S steps "
                        "(default 0: only at the end)")
    _add_training_options(p, steps=300, gpu_run=True)
    _add_tensor_parallel_options(p)
    _add_offload_options(p)
    p.add_argument("--nvme-path", metavar="DIR", help="directory for the nvme offload's files (a fast "
                                                     "local disk); each run writes and removes its own")


def _compare_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("compare", help="train the same model with DDP and each ZeRO stage, side by side",
                       description="Train the same model on the same data without ZeRO (torch DDP) and "
                                   "with each ZeRO stage; print time, memory and loss per run and write "
                                   "a bar chart (OUT/compare.png).")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 1, 2, 3], choices=[0, 1, 2, 3],
                   help="ZeRO stages to run (default 0 1 2 3)")
    p.add_argument("--rounds", type=int, default=3,
                   help="rounds: worlds in which every implementation is built and they train side by "
                        "side, one step each in turn, so machine noise hits them alike; times are the "
                        "median over rounds (default 3). Memory and loss: one run of each alone")
    _add_training_options(p, steps=30, gpu_run=False)
    p.set_defaults(compare=True)


def _estimate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("estimate", help="per-rank model-state memory from the paper's formulas",
                       description="Per-rank model-state memory (params, grads, optimizer state) from "
                                   "the ZeRO paper's formulas for a parameter count or a model config, "
                                   "beside stages 0-3; or the paper's Table 1 and Table 2 recomputed.")
    p.add_argument("--params", type=float, help="parameter count Ψ, e.g. 7.5e9")
    p.add_argument("--model", choices=sorted(SIZES), help="a built-in zeroshard GPT size instead of --params")
    p.add_argument("--layers", type=int, help="built-in GPT layers (overrides --model's; default small's)")
    p.add_argument("--width", type=int, help="built-in GPT width (overrides --model's; default small's)")
    p.add_argument("--hf-config",
                   help="a Hugging Face config.json instead of --params (counted on the model "
                        "transformers builds on the meta device; without it, GPT-2 or LLaMA style)")
    p.add_argument("--nproc", type=int, default=64, help="GPUs in all, DP x MP (default 64)")
    p.add_argument("--mp", type=int, default=1, help="model-parallel degree; DP = nproc / mp (default 1)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"],
                   help="fp32 Adam (4+4+8 bytes/param) or mixed-precision Adam (2+2+12) (default bf16)")
    _add_offload_options(p)
    p.add_argument("--configs", action="store_true",
                   help="ZeRO-R: the paper's C1-C5 (stage x P_a x P_a+cpu) with activation checkpoints, "
                        "for a model given by --model or --layers/--width, and exit")
    p.add_argument("--batch", type=int, default=16, help="--configs: sequences per GPU (default 16)")
    p.add_argument("--seq-len", type=int, default=1024, help="--configs: tokens per sequence (default 1024)")
    p.add_argument("--offload", choices=["none", "cpu", "nvme"],
                   help="both offloads at once (parameters at stage 3): nvme gives ZeRO-Infinity's model, "
                        "with the offloaded states on disk")
    p.add_argument("--table1", action="store_true", help="print the paper's Table 1 recomputed and exit")
    p.add_argument("--table2", action="store_true",
                   help="print Table 2's theoretical columns recomputed and exit")
    return p


def _estimate_psi(parser: argparse.ArgumentParser, args: argparse.Namespace) -> float:
    """Ψ from exactly one source: --params, a built-in GPT (--model/--layers/--width), or --hf-config."""
    from zeroshard.paper.estimate import load_hf_config
    from .gpt import gpt_params
    builtin = args.model is not None or args.layers is not None or args.width is not None
    given = [name for name, on in [("--params", args.params is not None),
                                   ("--model/--layers/--width", builtin),
                                   ("--hf-config", args.hf_config is not None)] if on]
    if len(given) != 1:
        parser.error("give one of --params, --model (or --layers/--width) or --hf-config"
                     + (f", not {' and '.join(given)}" if given else ""))
    if args.params is not None:
        if not 0 < args.params < math.inf:  # also refuses nan
            parser.error(f"--params must be a finite number > 0, got {args.params}")
        if args.params != int(args.params):  # "1.5" meant as billions, most likely
            parser.error(f"--params counts parameters, a whole number (1.5e9 for 1.5B), got {args.params}")
        return args.params
    if args.hf_config is not None:
        try:
            return load_hf_config(args.hf_config)
        except (OSError, ValueError) as err:
            parser.error(f"--hf-config {args.hf_config}: {err}")
    _check_positive(parser, args, ["layers", "width"])
    layers, width, _ = SIZES[args.model or "small"]
    return gpt_params(args.layers or layers, args.width or width)


def _run_estimate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from zeroshard.paper.estimate import report, table1_text, table2_text
    if args.table1 or args.table2:
        tables = [(args.table1, table1_text), (args.table2, table2_text)]
        print("\n\n".join(text() for on, text in tables if on))
        return
    _check_positive(parser, args, ["nproc", "mp"])
    if args.nproc % args.mp:
        parser.error(f"--nproc ({args.nproc}) must be a multiple of --mp ({args.mp})")
    psi = _estimate_psi(parser, args)
    if args.configs:
        if args.model is None and (args.layers is None or args.width is None):
            parser.error("--configs needs the model's layers and width: --model NAME or --layers L --width W")
        _check_positive(parser, args, ["batch", "seq_len"])
        from zeroshard.paper.zero_r import configurations_text
        layers, width, _ = SIZES[args.model or "small"]
        print(configurations_text(psi, args.layers or layers, args.width or width, args.nproc, args.mp,
                                  args.batch, args.seq_len, args.precision))
        return
    if args.stage == 0 and (args.offload_optimizer or "none") != "none":
        parser.error("--offload-optimizer at stage 0: ZeRO offloads a rank's shard of the optimizer "
                     "state, from stage 1 on (as initialize() requires); give --stage 1, 2 or 3")
    if args.stage < 3 and (args.offload_param or "none") != "none":
        parser.error(f"--offload-param at stage {args.stage}: parameters are sharded, and offloaded, at "
                     f"stage 3 only; give --stage 3")
    optimizer = args.offload_optimizer or (args.offload if args.stage >= 1 else None)
    param = args.offload_param or (args.offload if args.stage == 3 else None)  # --offload: where it can
    places = {p for p in (optimizer, param) if p not in (None, "none")}
    if len(places) > 1:
        parser.error("the offloads go to one place in this model: both cpu or both nvme")
    print(report(psi, args.nproc, args.stage, args.precision, optimizer in ("cpu", "nvme"), args.mp,
                 param in ("cpu", "nvme"), disk=places == {"nvme"}))


def _check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def _consolidate_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("consolidate", help="write a checkpoint's full fp32 weights as one file",
                       description="Gather a sharded zeroshard checkpoint (any world size, any stage) "
                                   "into full fp32 weights under the model's own names, loadable with "
                                   "model.load_state_dict() without zeroshard. No process group needed.")
    p.add_argument("checkpoint", help="a checkpoint directory, or a parent holding `latest`")
    p.add_argument("output", help="output file: .safetensors or .pt")
    return p


def _run_consolidate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    import zeroshard
    if not args.output.endswith((".safetensors", ".pt")):
        parser.error(f"output '{args.output}' must end in .safetensors or .pt")
    folder = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):  # found before the work, not after
        parser.error(f"cannot write '{args.output}': '{folder}' is not a writable directory")
    try:
        weights = zeroshard.consolidate(args.checkpoint, output=args.output)
        config = _model_config(zeroshard.checkpoint_info(args.checkpoint))
    except zeroshard.CheckpointError as e:  # the checkpoint's fault, not the options': no usage line
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    print(f"wrote {len(weights)} tensors to {args.output}")
    if config is not None:
        kind, values = config
        path = os.path.splitext(args.output)[0] + ".json"
        with open(path, "w") as f:
            json.dump(values, f, indent=1)
        print(f"wrote the model's config to {path} ({kind}; docs/usage.md shows how to load both)")


def _model_config(info: dict) -> tuple[str, dict] | None:
    """The model a checkpoint of `zeroshard train` holds, as (kind, config): the built-in GPT's
    GPTConfig fields, or the Hugging Face config.json it was built from. None for another
    program's checkpoint (the weights alone say nothing of the architecture)."""
    run = (info.get("client_state") or {}).get("args") if isinstance(info.get("client_state"), dict) else None
    if not isinstance(run, dict):
        return None
    if run.get("hf_config"):
        from zeroshard.paper.estimate import hf_config_file
        file = hf_config_file(run["hf_config"])
        if not os.path.isfile(file):
            return None
        with open(file) as f:
            return "a Hugging Face config.json", json.load(f)
    from dataclasses import asdict
    from .gpt import config_for
    return "the built-in GPT's GPTConfig", asdict(config_for(run["size"], run.get("layers"), run.get("width"),
                                                            run["seq_len"]))


def _say_heads(run) -> None:
    """A --width that the size's heads do not divide gets fewer heads (sizes.heads_for): said, not
    done quietly."""
    if run.hf_config is None and run.width is not None:
        heads, own = heads_for(run.size, run.width), SIZES[run.size][2]
        if heads != own:
            print(f"--width {run.width}: {heads} attention head{'s' * (heads > 1)} (the {run.size} size's "
                  f"{own} do not divide it)")


def _continue_line(run) -> str:
    """The command that resumes `run` as it was going (--resume takes its model and settings, not
    these)."""
    import shlex
    line = f"zeroshard train --resume --out {shlex.quote(run.out)} --steps {run.steps}"
    for flag, value in (("--save-every", run.save_every), ("--max-restarts", run.max_restarts)):
        line += f" {flag} {value}" if value else ""
    return line


def _run_training(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    _check_positive(parser, args, ["nproc", "steps", "batch_size", "seq_len", "layers", "width", "rounds"])
    if len(set(getattr(args, "stages", []))) < len(getattr(args, "stages", [])):
        parser.error(f"--stages {' '.join(map(str, args.stages))}: a stage given twice; give each once")
    resolve_device(parser, args)
    if args.command == "train":
        resume_settings(parser, args)
    default_run(args)
    import zeroshard
    from .data import check_paths
    from .train import TrainArgs, build_model, launch
    if args.lr is not None and not args.lr >= 0:
        parser.error(f"--lr must be >= 0, got {args.lr}")
    for name in ("max_restarts", "save_every"):
        if getattr(args, name, 0) < 0:
            parser.error(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if getattr(args, "tp", 1) < 1 or args.nproc % getattr(args, "tp", 1):
        parser.error(f"--tp {args.tp} must be >= 1 and divide --nproc {args.nproc} (ranks = dp x tp)")
    try:  # fail here, in one process, rather than in every rank
        # read once, here: the run's ranks build from these keys, saved with its checkpoints (so a
        # resume can tell an edit of the file since)
        args.config_contents = zeroshard.Config.read(args.config) if args.config else None
        defaults_from_config(args)
        options = {k: v for k, v in vars(args).items() if k not in ("command", "stages", "rounds", "compare")}
        train_args = TrainArgs(**options)
        _say_heads(train_args)
        check_paths(args.data, train_args.seq_len)
        engine_config = train_args.engine_config()
        check_nvme_path(train_args.nvme_path, engine_config)
        accumulation = zeroshard.Config.load(engine_config).gradient_accumulation_steps
        for flag, value in (("--steps", train_args.steps), ("--save-every", train_args.save_every)):
            if value % accumulation:  # a checkpoint cannot hold half-accumulated gradients
                ends = "on an optimizer step" if args.command == "compare" else "with a checkpoint"
                raise ValueError(f"{flag} {value} must be a multiple of gradient_accumulation_steps "
                                 f"({accumulation}): each step is one micro-batch, and the run ends "
                                 f"{ends}")
        if args.hf_config or train_args.tp > 1:
            from zeroshard.parallel import check_heads
            check_heads(build_model(train_args), train_args.tp)
    except (OSError, ValueError, RuntimeError) as e:
        parser.error(str(e))
    if args.command == "compare":
        from .compare import compare
        with ranks_report_errors(parser):
            compare(train_args, args.stages, args.rounds)
        return
    with hold_out(parser, train_args.out):
        check_steps_beyond_checkpoint(parser, train_args, accumulation)
        with ranks_report_errors(parser, train_args.out, _continue_line(train_args)):
            launch(train_args)


class _Version(argparse.Action):
    """`zeroshard --version`: zeroshard's and torch's versions, which a bug report needs (torch is
    imported only when they are asked for)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        # (SUPPRESS: no `version` in the parsed arguments, which TrainArgs would refuse)
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0,
                         help="print zeroshard's and torch's versions and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        import torch

        from .. import __version__
        print(f"zeroshard {__version__} (torch {torch.__version__})")
        parser.exit()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO data parallelism for PyTorch")
    parser.add_argument("--version", action=_Version)
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    _compare_parser(sub)
    estimate = _estimate_parser(sub)
    consolidate = _consolidate_parser(sub)
    from .plan import add_parser as _plan_parser
    plan = _plan_parser(sub)
    args = parser.parse_args(argv)
    if args.command in ("train", "compare"):
        _run_training(sub.choices[args.command], args)  # its errors show its own usage
    elif args.command == "estimate":
        _run_estimate(estimate, args)
    elif args.command == "consolidate":
        _run_consolidate(consolidate, args)
    elif args.command == "plan":
        from .plan import run as _run_plan
        _run_plan(plan, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
