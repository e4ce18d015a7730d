"""The `zeroshard` command: `train` (the main job)."""
from __future__ import annotations

import argparse
import sys

from .gpt import SIZES


def _train_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a small GPT with ZeRO on local ranks",
                       description="Train a byte-level GPT on the Python standard library's source "
                                   "(or --data) with ZeRO across local ranks, and report memory and "
                                   "traffic beside the paper's formulas.")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage (default 3)")
    p.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    p.add_argument("--steps", type=int, default=50, help="optimizer steps (default 50)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step (default 8)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    p.add_argument("--size", default="small", choices=sorted(SIZES), help="named model size (default small)")
    p.add_argument("--layers", type=int, help="override the number of layers")
    p.add_argument("--width", type=int, help="override the model width")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    p.add_argument("--data", nargs="+", default=[], help="text files or directories (default: the stdlib's source)")
    p.add_argument("--config", help="a DeepSpeed-style JSON config (--stage overrides its stage)")
    p.add_argument("--out", default="out", help="output directory (default ./out)")
    p.add_argument("--seed", type=int, default=0)


def _check_positive(parser: argparse.ArgumentParser, args: argparse.Namespace, names: list[str]) -> None:
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="zeroshard", description="ZeRO data parallelism for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    _train_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "train":
        _check_positive(parser, args, ["nproc", "steps", "batch_size", "seq_len", "layers", "width"])
        from .train import TrainArgs, launch
        options = {k: v for k, v in vars(args).items() if k != "command"}
        launch(TrainArgs(**options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
