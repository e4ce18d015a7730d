"""Byte-level text data for the main job. The default corpus is the Python standard library's own
source: real text, present on every installation, so nothing is downloaded."""
from __future__ import annotations

import os
import sysconfig

import torch

CORPUS_BYTES = 4_000_000  # what a run reads of its text, at most


def default_corpus_files(max_bytes: int = CORPUS_BYTES) -> list[str]:
    """Sorted .py files of the standard library, up to about `max_bytes` (deterministic)."""
    root = sysconfig.get_paths()["stdlib"]
    files, total = [], 0
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = sorted(d for d in subdirs if d not in ("site-packages", "test", "tests", "__pycache__"))
        for name in sorted(names):
            if name.endswith(".py") and total < max_bytes:
                path = os.path.join(directory, name)
                files.append(path)
                total += os.path.getsize(path)
    return files


def load_corpus(paths: list[str] | None, max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """Bytes of the given text files (or directories of them), or of the default corpus, as uint8:
    a token is a byte, and a rank holds the corpus for the whole run (as int64 it would be 8 times
    the text's size, 30 MiB of the default's 4 MB); Batches widens only the windows it draws."""
    files = default_corpus_files(max_bytes) if not paths else _expand(paths)
    chunks = []
    for path in files:
        with open(path, "rb") as f:
            chunks.append(f.read())
    data = b"\n".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def check_paths(paths: list[str], seq_len: int, max_bytes: int = CORPUS_BYTES) -> None:
    """Raise a clear error now for a --data path that is missing, unreadable or empty, or whose text
    is too short for a window of seq_len in each split (load_corpus's bytes, counted from sizes)."""
    if paths:
        files = _expand(paths)
        tokens = min(sum(os.path.getsize(f) for f in files) + len(files) - 1, max_bytes)
        for name, length in _splits(tokens):
            _check_split(name, length, seq_len)


def _expand(paths: list[str]) -> list[str]:
    files = []
    for path in paths:
        if os.path.isdir(path):
            files += sorted(os.path.join(d, n) for d, _, names in os.walk(path) for n in names)
        elif os.path.isfile(path):
            files.append(path)
        else:
            raise FileNotFoundError(f"--data: '{path}' is neither a file nor a directory")
    for path in files:
        if not os.access(path, os.R_OK):
            raise PermissionError(f"--data: '{path}' is not readable")
    if not files:
        raise ValueError(f"--data: no files found under {paths}")
    return files


def _splits(tokens: int) -> tuple[tuple[str, int], tuple[str, int]]:
    """The train and validation splits' lengths: 90/10."""
    cut = int(tokens * 0.9)
    return ("train", cut), ("val", tokens - cut)


def _check_split(name: str, length: int, seq_len: int) -> None:
    if length <= seq_len + 1:
        raise ValueError(f"the {name} split has {length} tokens, fewer than seq_len + 2 = {seq_len + 2}; "
                         f"give more text or a shorter --seq-len")


class Batches:
    """Random windows of a token stream, split 90/10 into train and validation."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        (_, cut), _ = _splits(len(tokens))
        self.splits = {"train": tokens[:cut], "val": tokens[cut:]}
        self.seq_len = seq_len
        for name, split in self.splits.items():
            _check_split(name, len(split), seq_len)

    def get(self, split: str, batch_size: int,
            generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        data = self.splits[split]
        starts = torch.randint(0, len(data) - self.seq_len - 1, (batch_size,), generator=generator)
        window = torch.stack([data[s:s + self.seq_len + 1] for s in starts.tolist()]).long()
        return window[:, :-1], window[:, 1:]
