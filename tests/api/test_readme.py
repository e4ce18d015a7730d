"""The README's commands are the ones CI and users run."""
from __future__ import annotations

import os
import re

from helpers import ROOT


def _bash_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```bash\n(.*?)\n```", f.read(), flags=re.S)


def test_ci_runs_the_readmes_test_command():
    blocks = _bash_blocks()
    assert len(blocks) == 2, "README: exactly two set-up commands (main job, tests)"
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert blocks[1].strip() in ci
    assert blocks[0].strip().endswith("zeroshard train") and "torch==2.13.0" in blocks[0]
