"""Check a GPU job script's `qerl` commands here, on the CPU, before device time is spent on them.

    .venv/bin/python dev/sweeps/check_job.py dev/sweeps/tab3_tab8_x2.sh [...]

Each `python3 -m qerl_lib ...` command of the script (continuation lines joined; environment assignments,
redirections and a trailing `&` dropped; `$OUT` read as a temporary folder) is parsed by the kit's own argument
parser, and `qerl bench train` commands also run with `--dry-run`, which builds and checks every case and its trainer
config. Other commands are only parsed. Exit 0 when every command passes; each failure is printed with its line.
"""
from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import sys
import tempfile

sys.path.insert(0, os.getcwd())


def commands(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, qerl arguments) of every `python3 -m qerl_lib` command in a shell script's text."""
    joined, start, out = "", None, []
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
        if start is None:
            start = number
        if stripped.endswith("\\"):
            joined += stripped[:-1] + " "
            continue
        joined += stripped
        at = joined.find("-m qerl_lib ")
        if at >= 0:
            words = shlex.split(joined[at + len("-m qerl_lib "):].split(">")[0].split(";")[0].rstrip(" &"))
            out.append((start, words))
        joined, start = "", None
    return out


def check(path: str) -> int:
    from qerl_lib.cli import build_parser, main

    failed = 0
    with tempfile.TemporaryDirectory() as out:
        for number, words in commands(open(path, encoding="utf-8").read()):
            argv = [re.sub(r"\$\{?OUT\}?", out, w) for w in words]
            if argv[:2] == ["bench", "train"]:
                argv.append("--dry-run")
            capture = io.StringIO()
            try:
                with contextlib.redirect_stdout(capture), contextlib.redirect_stderr(capture):
                    code = main(argv) if argv[:2] == ["bench", "train"] else (build_parser().parse_args(argv), 0)[1]
            except SystemExit as stop:
                code = stop.code
            status = "ok" if code == 0 else f"FAILED ({capture.getvalue().strip().splitlines()[-1:]})"
            failed += code != 0
            print(f"{path}:{number}: qerl {' '.join(words[:2])} ... {status}")
    return failed


if __name__ == "__main__":
    sys.exit(1 if sum(check(p) for p in sys.argv[1:]) else 0)
