"""The `zeroshard` command run inside the test process, for commands that launch no rank (estimate,
--help, the options refused before launch): the same `main(argv)` the console script calls, without
the ~4 s a fresh interpreter spends importing torch. Launches go through a real subprocess."""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass

from zeroshard.app.cli import main


@dataclass
class Done:
    """What subprocess.CompletedProcess would hold."""

    returncode: int
    stdout: str
    stderr: str


def zeroshard_here(*args: str) -> Done:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as end:  # argparse's errors and --help end this way
            code = end.code if isinstance(end.code, int) else (0 if end.code is None else 1)
            if isinstance(end.code, str):
                err.write(end.code)
    return Done(code, out.getvalue(), err.getvalue())
