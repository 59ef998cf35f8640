"""The `qerl` command line: one small module per command group, each with `register(subparsers)`.

Floor 7, the top: it may import every floor; nothing imports it. Errors the
user can fix (a bad path, an unknown model while offline, a bad flag) are raised as
`UserError` anywhere in the kit and printed here as one line, with no traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qerl_lib.errors import UserError

# command-group modules under qerl_lib/cli/, in the order `qerl --help` lists them
COMMAND_MODULES = (
    "setup",      # prepare-model, env
    "data",       # data arith / data gsm8k
    "quant",      # quantize, inspect, export
    "generation", # generate, eval
    "bench",      # bench gemm, bench rollout
    "train",      # train, plot-run
    "sweep",      # calibrate, sweep, claims
    "reproduce",  # reproduce (papermill runner)
    "results",    # results (the README's GPU results table)
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="qerl", description="QeRL kit: NVFP4 + LoRA RL for LLMs")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(f"qerl_lib.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name == f"qerl_lib.cli.{name}":
                continue  # command group not built yet
            raise
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = args.func(args)
    except UserError as e:
        print(f"qerl {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return int(result or 0)
