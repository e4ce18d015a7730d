"""`zeroshard plan`: which stage, offload, checkpointing, MP degree and micro-batch fit a model on
some machines, fastest first (the model: zeroshard.paper.plan; docs/plan.md)."""

from __future__ import annotations

import argparse
import json
import math
import os

from .sizes import SIZES, heads_for

GIB = 2**30


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "plan",
        help="the configurations that fit a model on these machines, fastest first",
        description="Weigh ZeRO stages 0-3, optimizer and parameter offload, activation "
        "checkpointing, the MP degree and micro-batch for a model on this machine "
        "(detected and calibrated) or on machines described by flags: peak memory "
        "by place and step time predicted, ranked. docs/plan.md.",
    )
    m = p.add_argument_group("the model (one of)")
    m.add_argument("--hf-config", help="a Hugging Face config.json or model folder (a decoder: GPT-2- or "
                   "LLaMA-style blocks, experts too)")
    m.add_argument("--model", choices=sorted(SIZES), help="a built-in zeroshard GPT size")
    m.add_argument("--params", type=float, help="parameter count Ψ, with --layers and --width")
    m.add_argument("--layers", type=int, help="layers (with --params, or overriding --model's)")
    m.add_argument("--width", type=int, help="width (with --params, or overriding --model's)")
    m.add_argument("--heads", type=int, help="attention heads (with --params; default width / 128)")
    m.add_argument("--vocab", type=int, help="vocabulary (with --params; default 50257)")
    t = p.add_argument_group("the training")
    t.add_argument(
        "--global-batch", type=int, help="sequences per optimizer step in all (default 8 per rank)"
    )
    t.add_argument("--seq-len", type=int, default=512, help="tokens per sequence (default 512)")
    t.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"], help="default bf16")
    t.add_argument(
        "--mp",
        type=int,
        help="fix the model-parallel degree (default: every one that applies within a node; 1 on a CPU)",
    )
    h = p.add_argument_group("another machine (default: this one, detected and calibrated)")
    h.add_argument("--nodes", type=int, help="nodes")
    h.add_argument("--gpus-per-node", type=int, help="GPUs per node (default 8)")
    h.add_argument("--gpu-mem", type=float, help="GB per GPU (default 80)")
    h.add_argument("--host-mem", type=float, help="GB of host memory per node (default 1000)")
    h.add_argument("--disk", type=float, help="GB of free fast disk per node (default 4000)")
    h.add_argument("--link-gbps", type=float, help="Gbit/s between nodes, per node (default 100)")
    h.add_argument("--tflops", type=float, help="sustained matrix TFLOP/s per GPU (default 100)")
    h.add_argument("--host-adam", type=float, help="host Adam, G elements/s per rank (default 1)")
    h.add_argument("--h2d-gbps", type=float, help="host <-> device GB/s (default 20)")
    h.add_argument("--disk-gbps", type=float, help="disk GB/s per node, shared by its GPUs (default 2)")
    h.add_argument("--nproc", type=int, help="this machine: ranks (default every GPU, else 2 CPU ranks)")
    p.add_argument(
        "--nvme-path",
        metavar="DIR",
        help="a writable directory for nvme offload (its free space "
        "and rate are measured); without it nvme is not weighed here",
    )
    p.add_argument("--recalibrate", action="store_true",
                   help="measure this machine's rates (and the engine's reference runs) again")
    p.add_argument("--top", type=int, default=12, help="rows of the table (default 12)")
    p.add_argument("--write", metavar="FILE", help="write the best as a DeepSpeed-style JSON config")
    p.add_argument("--verify", action="store_true", help="run the best configuration for a few steps here")
    p.add_argument("--verify-top", type=int, metavar="K", help="run the K best configurations here")
    p.add_argument("--verify-steps", type=int, default=3, help="optimizer steps per verified run (default 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument(
        "--paper", action="store_true", help="the paper's runs projected on its hardware, and exit"
    )
    return p


def _positive(parser, args, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and not (value > 0 and math.isfinite(value)):
            parser.error(f"--{name.replace('_', '-')} must be a finite number > 0, got {value}")


def shape_of(parser: argparse.ArgumentParser, args: argparse.Namespace, seq: int):
    """The model as the planner sees it, from exactly one of --hf-config, --model, --params."""
    from zeroshard.paper.plan_shapes import gpt2_shape

    given = [
        n
        for n, on in (
            ("--hf-config", args.hf_config),
            ("--model", args.model),
            ("--params", args.params is not None),
        )
        if on
    ]
    if len(given) > 1:
        parser.error(f"give one of --hf-config, --model or --params, not {' and '.join(given)}")
    sized = ("heads", "vocab") + (("layers", "width") if args.hf_config else ())
    unused = [f"--{n}" for n in sized if getattr(args, n) is not None and args.params is None]
    if unused:
        own = "--hf-config's config.json gives" if args.hf_config else "a built-in size has"
        parser.error(f"{' and '.join(unused)} describe a model with --params; {own} its own")
    if args.hf_config:
        from zeroshard.paper.estimate import hf_config_file
        from zeroshard.paper.plan_shapes import shape_from_hf

        file = hf_config_file(args.hf_config)  # a config.json, or the model folder holding one
        try:
            with open(file, encoding="utf-8") as f:
                config = json.load(f)
            shape = shape_from_hf(config, _model_name(file))
        except (OSError, ValueError) as e:
            parser.error(f"--hf-config {args.hf_config}: {e}")
        from zeroshard.hf import context_of_file
        context = context_of_file(config, file)
        if isinstance(context, int) and seq > context:  # (as `zeroshard train` would refuse the plan)
            parser.error(f"--seq-len {seq} exceeds the model's context ({context}) in '{file}'; give "
                         f"--seq-len {context} or less")
        from zeroshard.hf import causal_lm_from_config
        try:  # what `zeroshard train` (and here the reference runs and --verify) would refuse, now
            causal_lm_from_config(file, seq, device="meta")
        except ValueError as e:
            parser.error(str(e))
        except RuntimeError:
            pass  # without transformers: planned from the config's keys
        return shape
    if args.params is not None:
        if args.layers is None or args.width is None:
            parser.error("--params needs --layers and --width (the activations and units depend on them)")
        heads = args.heads or max(1, args.width // 128)
        if args.width % heads:
            parser.error(f"--heads {heads} must divide --width {args.width}")
        from zeroshard.paper.plan_shapes import shape_from_params

        try:
            return shape_from_params(args.params, args.layers, args.width, heads, args.vocab or 50257, seq)
        except ValueError as e:
            parser.error(str(e))
    size = args.model or "small"
    layers, width, _ = SIZES[size]
    width = args.width or width
    return gpt2_shape(size, args.layers or layers, width, heads_for(size, width), 256, seq)


VERIFY_MAX_AGE = 3600.0  # s: --verify measures older cached rates again
FIT_WARN = 0.25  # a calibration shape missed by more than this: the step-time target's own bound


def _model_name(file: str) -> str:
    """What the table calls a Hugging Face model: its folder's name for a config.json (the model's
    folder), else the file's own name (`llama3.json` is "llama3")."""
    path = os.path.abspath(file)
    stem, _ = os.path.splitext(os.path.basename(path))
    return os.path.basename(os.path.dirname(path)) if stem == "config" else stem


def _hardware(parser, args, local: bool):
    from . import plan_hw

    if not local:
        return plan_hw.given_hardware(args)
    import torch

    cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    ranks = args.nproc or (torch.cuda.device_count() if cuda else 2)
    # --verify checks the prediction against this machine as it is now: rates measured more than
    # an hour ago (a shared machine's drift with its neighbours' load) are measured again first
    max_age = VERIFY_MAX_AGE if args.verify or args.verify_top else None
    figures, age = plan_hw.calibrate(
        args.precision, ranks, args.nvme_path or _tmp(), cuda, args.recalibrate, max_age
    )
    hw, line = plan_hw.local_hardware(args.nproc, figures, args.nvme_path)
    line += (" (rates measured now)" if age is None else
             f" (rates from the cache, measured {age / 3600:.1f} h ago; --recalibrate to measure again)")
    if figures.get("fit_worst", 0.0) > FIT_WARN:  # the block model cannot follow this machine's shapes
        line += (f"\nnote: the calibration's block fit missed one of its shapes by "
                 f"{figures['fit_worst']:.0%}: step times are less certain than usual (a busy machine, or "
                 f"kernels the model does not describe; --recalibrate when it is quiet)")
    return hw, line


def _tmp() -> str:
    import tempfile

    return tempfile.gettempdir()


def _check(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Refuse bad figures by name; return whether the hardware is this machine's."""
    _positive(
        parser,
        args,
        [
            "params",
            "nodes",
            "gpus_per_node",
            "gpu_mem",
            "host_mem",
            "disk",
            "link_gbps",
            "tflops",
            "host_adam",
            "h2d_gbps",
            "disk_gbps",
        ],
    )
    for name in (
        "layers",
        "width",
        "heads",
        "vocab",
        "global_batch",
        "seq_len",
        "mp",
        "nproc",
        "top",
        "verify_top",
        "verify_steps",
    ):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    another = [f"--{n.replace('_', '-')}" for n in _ANOTHER_MACHINE if getattr(args, n) is not None]
    local = not another
    if args.nvme_path is not None and local:  # (another machine's path is written, not used, here)
        if not _writable_dir(args.nvme_path):
            parser.error(f"--nvme-path {args.nvme_path}: not a writable directory")
    for given, why in (
        (args.verify or args.verify_top, "--verify runs here: it cannot check a plan for another machine"),
        (args.nproc, "--nproc counts this machine's ranks (another's are --nodes x --gpus-per-node)"),
        (args.recalibrate, "--recalibrate measures this machine's rates, which a plan for another does "
                           "not use"),
    ):
        if given and not local:
            parser.error(f"{why}; {' '.join(another)} describe another machine: drop one or the other")
    if (args.verify or args.verify_top) and args.params is not None:
        parser.error("--verify runs the model, and --params describes one by its size alone: give "
                     "--model or --hf-config to verify")
    if args.write:
        folder = os.path.dirname(os.path.abspath(args.write))
        if os.path.isdir(args.write):
            parser.error(f"--write {args.write} is a directory; give a file name (ds_config.json)")
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            parser.error(f"--write {args.write}: '{folder}' is not a writable directory")
    return local


def _writable_dir(path: str) -> bool:
    """A file can be made there (os.access says yes to root on /proc)."""
    import tempfile

    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


# the flags that describe another machine (with the rates': any one of them plans for another)
_ANOTHER_MACHINE = ("nodes", "gpus_per_node", "gpu_mem", "host_mem", "disk", "link_gbps", "tflops",
                    "host_adam", "h2d_gbps", "disk_gbps")


def _hf_family(args: argparse.Namespace) -> dict | None:
    """The Hugging Face config.json the plan is for (shape_of has read it), else None: the engine's
    reference runs are then of its family."""
    if not args.hf_config:
        return None
    from zeroshard.paper.estimate import hf_config_file

    with open(hf_config_file(args.hf_config), encoding="utf-8") as f:
        return json.load(f)


def _mp_degrees(args: argparse.Namespace, hw) -> tuple[list[int] | None, str]:
    """The MP degrees to weigh (None: every one paper.plan.setups allows) and, where a Hugging Face
    model allows none above 1, why: `zeroshard train --tp` splits it by its own tensor-parallel
    plan, which must be one zeroshard takes."""
    if args.mp:
        degrees = [args.mp]
    elif hw.device == "cpu":
        return [1], ""
    else:
        degrees = None
    config = _hf_family(args)
    if config is None or degrees == [1]:
        return degrees, ""
    import zeroshard
    from zeroshard.paper.estimate import hf_meta_model
    from zeroshard.parallel import model_plan, plan_styles

    model = hf_meta_model(config, causal_lm=True)
    if model is not None:
        try:
            plan_styles(model_plan(model)[1])
        except zeroshard.ConfigError as e:
            return [1], f"--tp cannot split {config.get('model_type')!r}: {e}"
    return degrees, ""


def run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from zeroshard.paper.plan import mp_splits, plan, smallest_change
    from .plan_report import config_of, cpu_notes, paper_text, plan_json, table, train_command, unwritten_why

    if args.paper:
        print(paper_text(args.json))
        return
    local = _check(parser, args)
    shape = shape_of(parser, args, args.seq_len)
    hw, line = _hardware(parser, args, local)
    if args.mp is not None and not mp_splits(shape, hw, args.mp):
        parser.error(f"--mp {args.mp} must divide the GPUs per node ({hw.per_node}) and the heads and "
                     f"key/value heads ({' and '.join(map(str, shape.mp_divides))})")
    mps, why_mp_1 = _mp_degrees(args, hw)
    if args.mp and args.mp not in mps:
        parser.error(f"--mp {args.mp}: {why_mp_1}")
    if local:  # (after the input is checked: the reference runs take seconds the first time)
        from .plan_verify import with_engine

        hw = with_engine(hw, args.precision, args.recalibrate, _hf_family(args))
    batch = args.global_batch or 8 * hw.ranks
    plans = plan(shape, hw, batch, args.seq_len, args.precision, mps)
    if not plans:
        parser.error(
            f"--global-batch {batch} does not split over {hw.ranks} ranks at any MP degree: give a "
            f"multiple of {hw.ranks}"
        )
    best = plans[0] if plans[0].fits else None
    changes = [] if best else smallest_change(shape, hw, batch, args.seq_len, args.precision, mps,
                                               _machine_flags(hw) if local else "")
    unwritten = unwritten_why(args, best)
    if args.write and best and not unwritten:
        with open(args.write, "w") as f:
            json.dump(config_of(best, batch, args.nvme_path), f, indent=1)
    verified = []
    if best and (args.verify or args.verify_top):
        from .plan_verify import verify

        fitting = [p for p in plans if p.fits][: args.verify_top or 1]
        verified = verify(args, shape, hw, fitting, batch)
    if args.json:
        print(json.dumps(plan_json(shape, hw, line, plans, batch, args, changes, verified), indent=1))
        return
    print(table(shape, hw, line, plans, batch, args, changes, verified))
    if why_mp_1 and not args.mp:
        print(f"mp 1 only: {why_mp_1}")
    for note in cpu_notes(shape, hw, args.precision, args.mp or 1):
        print(f"note: {note}")
    if (args.verify or args.verify_top) and not best:
        print("nothing verified: nothing fits")
    if args.write:
        print(f"did not write {args.write}: {unwritten}" if unwritten else
              f"wrote the best configuration to {args.write}; {train_command(args, best, hw)}")


def _machine_flags(hw) -> str | None:
    """This machine as --nodes' companions: a suggestion of more nodes then plans more of these,
    not of another machine's defaults. None for a CPU group (another machine's flags plan GPUs)."""
    if hw.device == "cpu":
        return None
    return (f" --gpus-per-node {hw.per_node} --gpu-mem {hw.device_bytes / 1e9:.0f} "
            f"--host-mem {hw.host_bytes / 1e9:.0f}")
