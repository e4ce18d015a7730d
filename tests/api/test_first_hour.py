"""A newcomer's first hour, as README.md tells it: every `zeroshard` and `torchrun` command in its
code blocks runs as written from a fresh directory (on tiny settings), the README's first command
works when run again, the consolidated weights load with the lines it shows; and the small things
that made a first hour worse: --help importing torch, an error showing the top-level usage, a
misspelled config key without a suggestion, exports created 0600, a machine's absolute paths."""
from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys

import pytest
import torch

import zeroshard
from helpers import ROOT
from helpers.cli import zeroshard_here

BIN = os.path.dirname(sys.executable)  # the venv's bin: where `.venv/bin/...` points in a checkout
# Flags that make a README command tiny; the README's own flags come first and these override them.
TINY = {"train": ["--device", "cpu", "--size", "tiny", "--seq-len", "32", "--batch-size", "2"],
        "compare": ["--device", "cpu", "--size", "tiny", "--seq-len", "32", "--batch-size", "2",
                    "--rounds", "1", "--stages", "3"]}


def _readme_blocks(language: str) -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(rf"```{language}\n(.*?)\n```", f.read(), flags=re.S)


def _commands() -> list[list[str]]:
    """The zeroshard and torchrun commands of README.md's shell blocks, in order (the set-up line's
    last command included), comments dropped."""
    commands = []
    for block in _readme_blocks("bash") + _readme_blocks("sh"):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split("&&"):
                words = shlex.split(part)
                if "--nnodes=2" in words:  # one of two launchers: tests/parallel/test_multinode.py
                    continue
                if words and os.path.basename(words[0]) in ("zeroshard", "torchrun"):
                    commands.append(words)
    return commands


def _tiny(words: list[str]) -> list[str]:
    """The command with the venv's executables and the repository's files, made tiny: a train or
    compare takes 1/50 of its steps (2 at least, so a resume still has steps to take)."""
    program = os.path.join(BIN, os.path.basename(words[0]))
    args = [os.path.join(ROOT, w) if w.startswith("examples/") else w for w in words[1:]]
    if program.endswith("zeroshard") and args and args[0] in TINY:
        steps = int(args[args.index("--steps") + 1]) if "--steps" in args else 100
        args = args + TINY[args[0]] + ["--steps", str(max(2, steps // 50))]
    if program.endswith("torchrun"):
        args += ["--steps", "2", "--width", "32", "--layers", "1"]  # the example's own flags
    return [program, *args]


def _run(words: list[str], cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "ZEROSHARD_BACKEND": "gloo", "OMP_NUM_THREADS": "1"}  # the CPU, GPU or not
    done = subprocess.run(_tiny(words), cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (words, done.stdout[-2000:] + done.stderr[-2000:])
    return done


def test_every_readme_command_runs_as_written(tmp_path):
    commands = _commands()
    names = [c[1] if os.path.basename(c[0]) == "zeroshard" else "torchrun" for c in commands]
    assert names.count("train") >= 3 and {"compare", "estimate", "consolidate", "torchrun"} <= set(names)
    seen_train = False
    for words in commands:
        if words[1:2] == ["train"] and not seen_train:  # the first command, twice: the second run
            seen_train = True                            # keeps the first's checkpoints aside
            _run(words, tmp_path)
            assert "earlier run's checkpoints: moved to" in _run(words, tmp_path).stdout
            continue
        _run(words, tmp_path)
    # The lines README.md shows to load the consolidated weights into a plain model.
    (load,) = [b for b in _readme_blocks("python") if "load_state_dict" in b]
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        scope: dict = {}
        exec(load, scope)
    finally:
        os.chdir(cwd)
    model = scope["model"]
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert saved and all(torch.equal(model.state_dict()[k], v) for k, v in saved.items())


def test_help_imports_no_torch():
    probe = ("import sys\nfrom zeroshard.app.cli import main\n"
             "for argv in (['--help'], ['train', '--help']):\n"
             "    try:\n        main(argv)\n    except SystemExit:\n        pass\n"
             "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_a_subcommands_error_shows_its_usage():
    done = zeroshard_here("train", "--device", "cpu", "--steps", "0")
    assert done.returncode == 2 and done.stderr.startswith("usage: zeroshard train") and \
        "--steps must be >= 1" in done.stderr, done.stderr


@pytest.mark.parametrize("config, suggestion", [
    ({"zero_optimisation": {"stage": 2}}, "did you mean 'zero_optimization'?"),
    ({"zero_optimization": {"stage": 3, "offload_optimiser": {}}},
     "did you mean 'zero_optimization.offload_optimizer'?"),
    ({"bf16": {"enable": True}}, "did you mean 'bf16.enabled'?"),
])
def test_a_misspelled_config_key_gets_a_suggestion(config, suggestion):
    with pytest.raises(zeroshard.ConfigError, match=re.escape(suggestion)):
        zeroshard.Config.load(config)


def test_exports_take_the_users_umask(tmp_path):
    from zeroshard.checkpoint.export import write_weights
    before = os.umask(0o027)
    try:
        for name in ("w.safetensors", "w.pt"):
            write_weights({"a": torch.zeros(3), "b": torch.ones(2)}, str(tmp_path / name))
            assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o640, name
    finally:
        os.umask(before)
    assert sorted(os.listdir(tmp_path)) == ["w.pt", "w.safetensors"]  # nothing partial left


def _tracked_text_files() -> list[str]:
    """The repository's text files: git's list on a clone, else every file under the root outside
    hidden and build folders (a copy without .git must not make the check vacuous)."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    files = listed.stdout.split() if listed.returncode == 0 else []
    if not files:
        for folder, subfolders, names in os.walk(ROOT):
            subfolders[:] = [d for d in subfolders if not d.startswith((".", "out", "build"))]
            files += [os.path.relpath(os.path.join(folder, name), ROOT) for name in names]
    text = (".py", ".md", ".toml", ".json", ".txt", ".cfg", ".yml", ".sh")
    return [f for f in files if f.endswith(text) or f.startswith(".ci/")]


def test_no_absolute_path_of_a_machine_anywhere():
    """A path under work, home, root or Users at the file system's top, written into the repository,
    is the machine it was written on: it means nothing on a clone."""
    machine = re.compile(r"(?<![\w.])/(work|home|root|Users|mnt/c)/[\w.-]+")
    found = [f"{name}:{i}: {line.strip()[:80]}" for name in _tracked_text_files()
             for i, line in enumerate(open(os.path.join(ROOT, name), errors="replace"), 1)
             if machine.search(line)]
    assert len(_tracked_text_files()) > 100 and not found, found
    assert machine.search("run /" + "work/bench-venv/bin/pip") and not machine.search("/local_nvme")


def test_readme_and_benchmark_notes_stay_short():
    assert sum(1 for _ in open(os.path.join(ROOT, "README.md"))) < 250
    assert sum(1 for _ in open(os.path.join(ROOT, "benchmarks", "README.md"))) < 400


@pytest.mark.cuda
def test_the_default_run_on_a_gpu_writes_python(tmp_path):
    """On a GPU machine, a bare `zeroshard train` uses the GPUs with the larger default run; the model
    it trains predicts the validation text's next byte better than a table of what follows each
    pair of bytes (so it learned more than counting), and continues a function from that text in
    written characters, not the indent's spaces. The loss is the measure of learning: a sample at
    one seed is a single draw, checked only for being text."""
    done = subprocess.run([os.path.join(BIN, "zeroshard"), "train", "--nproc", "1"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "cuda" in done.stdout, done.stdout[-2000:]
    validation = float(re.search(r"validation (\d+\.\d+)", done.stdout).group(1))
    assert validation < _byte_triple_loss(), done.stdout[-2000:]
    printed = done.stdout.split("sample:")[1].strip("\n").splitlines()
    written = "\n".join(line.removeprefix("  | ") for line in printed[1:])  # after the prompt's line
    assert sum(not c.isspace() for c in written) >= len(written) / 3, written


def _byte_triple_loss() -> float:
    """The cross-entropy, in nats per byte, of the default corpus's validation split under a table
    counted on its training split: each byte given the two before it (add-0.1 smoothing)."""
    from zeroshard.app.data import load_corpus

    tokens = load_corpus(None).long()
    cut = int(len(tokens) * 0.9)  # Batches' split
    train, val = tokens[:cut], tokens[cut:]
    counts = torch.full((256 * 256, 256), 0.1, dtype=torch.float64)
    counts.index_put_((train[:-2] * 256 + train[1:-1], train[2:]),
                      torch.ones(len(train) - 2, dtype=torch.float64), accumulate=True)
    table = counts / counts.sum(1, keepdim=True)
    return -table[val[:-2] * 256 + val[1:-1], val[2:]].log().mean().item()
