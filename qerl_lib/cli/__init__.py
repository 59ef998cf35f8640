"""The `qerl` command line: one small module per command group, each with `register(subparsers)`.

Floor 7, the top: it may import every floor; nothing imports it.

One error path (`main`)
-----------------------
Every error a user can fix ends the command with **one line on stderr and exit code 2**, named
``qerl COMMAND: error: ...``; ``--debug`` (before or after the command) prints the traceback above
that line. Unexpected errors (bugs) still raise with their traceback. User-fixable are:

* `UserError`, raised anywhere in the kit (its message names the problem and the fix);
* argparse's own errors (a bad flag or value), kept to one line;
* known exceptions of the libraries underneath, turned into a line naming the file, line or
  tensor (`user_error_message`): ``json.JSONDecodeError`` (file, line, column), ``UnicodeDecodeError``
  (file, line, the byte), a safetensors error (the file; for a truncated one, the first tensor cut
  off), an adapter that does not fit the model (transformers/peft: the first mismatched tensor), a
  CUDA device asked for where CUDA is missing, a file that is missing, unreadable, or where a
  folder should be (and the reverse), and a full disk. The file is found from the exception or,
  when the library did not keep it, among the paths the failing frames and the command's arguments
  hold: by matching the bytes (JSON, UTF-8) or by reading the header (safetensors).
"""

from __future__ import annotations

import argparse
import errno
import importlib
import json
import os
import re
import sys
import traceback
from pathlib import Path

from qerl_lib.errors import UserError

# command-group modules under qerl_lib/cli/, in the order `qerl --help` lists them
COMMAND_MODULES = (
    "setup",      # prepare-model, env
    "data",       # data arith / data gsm8k
    "quant",      # quantize, inspect, export
    "generation", # generate, eval
    "bench",      # bench gemm, bench rollout, bench train
    "train",      # train, plot-run, plot-steps
    "sweep",      # calibrate, sweep, claims
    "reproduce",  # reproduce (papermill runner)
    "results",    # results (the README's GPU results and speed-claims tables)
)


class _Parser(argparse.ArgumentParser):
    """argparse, with its errors on one line (no usage block); subcommand parsers inherit this."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {_one_line(message)} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="qerl", description="QeRL kit: NVFP4 + LoRA RL for LLMs")
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
    _add_debug_flag(parser, top=True, seen=set())
    return parser


def _add_debug_flag(parser: argparse.ArgumentParser, top: bool, seen: set[int]) -> None:
    """``--debug`` on the top parser and on every (sub)command parser, so it works on either side of
    the command name. Below the top its default is SUPPRESS, so it cannot reset a top-level --debug."""
    if id(parser) in seen:
        return  # an alias names the same parser twice
    seen.add(id(parser))
    try:
        parser.add_argument("--debug", action="store_true", default=False if top else argparse.SUPPRESS,
                            help="on an error, also print the traceback")
    except argparse.ArgumentError:
        pass  # the command defines its own --debug
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                _add_debug_flag(child, top=False, seen=seen)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # argparse: --help (0) or a bad flag (2, already printed on one line)
        return e.code if isinstance(e.code, int) else 2
    try:
        result = args.func(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 -- sorted below: user-fixable -> one line, anything else re-raised
        message = user_error_message(exc, args)
        if message is None:
            raise
        if args.debug:
            traceback.print_exception(exc)
        print(f"qerl {args.command}: error: {message}", file=sys.stderr)
        return 2
    return int(result or 0)


# ---------------------------------------------------------------------------------------------
# Known exceptions -> one line

def user_error_message(exc: BaseException, args: argparse.Namespace | None = None) -> str | None:
    """The one-line message for an error the user can fix, or None for an unexpected one."""
    if isinstance(exc, UserError):
        return _one_line(str(exc))
    for error in _chain(exc):  # a library may wrap the error that names the problem
        for explain in (_json_message, _unicode_message, _safetensors_message, _cuda_message, _adapter_message,
                        _os_message):
            message = explain(error, args)
            if message:
                return _one_line(message)
    return None


def _one_line(text: str) -> str:
    return re.sub(r"\s*\n\s*", " ", str(text)).strip()


def _chain(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while exc is not None and exc not in out and len(out) < 8:
        out.append(exc)
        exc = exc.__cause__ or exc.__context__
    return out


def _frames(exc: BaseException) -> list:
    """The frames of the traceback, innermost first."""
    frames, tb = [], exc.__traceback__
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames[::-1]


def _paths_in_frames(exc: BaseException, args: argparse.Namespace | None, suffixes: tuple[str, ...] = ()) -> list[Path]:
    """Existing files the failing frames (innermost first), then the command's arguments, point at;
    for a folder, the files directly in it with one of `suffixes`."""
    values: list = []
    for frame in _frames(exc):
        values.extend(frame.f_locals.values())
    values.extend(vars(args).values() if args is not None else ())
    found: list[Path] = []
    for value in values:
        if not isinstance(value, (str, os.PathLike)) or (isinstance(value, str) and (len(value) > 4096 or "\n" in value)):
            continue
        try:
            path = Path(value)
            if path.is_file():
                candidates = [path]
            elif path.is_dir() and suffixes:
                candidates = sorted(p for p in path.iterdir() if p.suffix in suffixes and p.is_file())[:50]
            else:
                continue
        except (OSError, ValueError):
            continue
        found.extend(p for p in candidates if p not in found)
    return found


def _where(exc: BaseException) -> str:
    """The innermost frame of the kit, as ``qerl_lib/...py:LINE`` (for errors whose file is unknown)."""
    root = Path(__file__).resolve().parents[1]
    tb, where = exc.__traceback__, None
    while tb is not None:
        file = Path(tb.tb_frame.f_code.co_filename)
        if root in file.parents:
            where = f"{file.relative_to(root.parent)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return where or "qerl"


def _json_message(exc: BaseException, args) -> str | None:
    if not isinstance(exc, json.JSONDecodeError):
        return None
    doc = exc.doc if isinstance(exc.doc, str) else ""
    for path in _paths_in_frames(exc, args, (".json", ".jsonl", ".toml", ".txt")):
        try:
            text = path.read_text(encoding="utf-8", errors="replace") if path.stat().st_size < 64 << 20 else ""
        except OSError:
            continue
        if doc and text == doc:  # the whole file was parsed
            return f"{path}:{exc.lineno}:{exc.colno}: not valid JSON ({exc.msg}): fix or regenerate the file"
        lines = text.splitlines()
        if doc.strip() and doc.strip() in (line.strip() for line in lines):  # one line of a jsonl file
            number = next(i for i, line in enumerate(lines, 1) if line.strip() == doc.strip())
            return f"{path}:{number}: not valid JSON ({exc.msg}, column {exc.colno}): fix or regenerate the file"
    return (f"a JSON file read at {_where(exc)} is not valid JSON (line {exc.lineno}, column {exc.colno}: {exc.msg}): "
            f"fix or regenerate it (--debug shows where it was read)")


def _unicode_message(exc: BaseException, args) -> str | None:
    if not isinstance(exc, UnicodeDecodeError) or not isinstance(exc.object, (bytes, bytearray)):
        return None
    bad = exc.object[exc.start:exc.start + 1].hex() or "??"
    for path in _paths_in_frames(exc, args, (".json", ".jsonl", ".txt", ".toml", ".jinja", ".model")):
        try:
            data = path.read_bytes() if path.stat().st_size < 256 << 20 else b""
        except OSError:
            continue
        at = data.find(bytes(exc.object)) if exc.object else -1
        if at < 0:
            continue
        offset = at + exc.start
        line = data.count(b"\n", 0, offset) + 1
        column = offset - (data.rfind(b"\n", 0, offset) + 1) + 1
        return f"{path}:{line}: not UTF-8 text (byte 0x{bad} at column {column}): re-save the file as UTF-8"
    return (f"a file read at {_where(exc)} is not UTF-8 text (byte 0x{bad} at position {exc.start}): "
            f"re-save it as UTF-8 (--debug shows where it was read)")


def _safetensors_message(exc: BaseException, args) -> str | None:
    if type(exc).__name__ != "SafetensorError":
        return None
    files = [p for p in _paths_in_frames(exc, args, (".safetensors",)) if p.suffix == ".safetensors"]
    for path in files:
        diagnosis = _safetensors_damage(path)
        if diagnosis:
            return f"{path}: {diagnosis}: re-download the checkpoint or write it again"
    where = files[0] if files else f"a safetensors file read at {_where(exc)}"
    return f"{where}: not a readable safetensors file ({_one_line(exc)}): re-download it or write it again"


def _safetensors_damage(path: Path) -> str | None:
    """What is wrong with a safetensors file, read from its header, or None if the layout is whole."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"truncated safetensors file ({size} bytes, no header)"
            header_len = int.from_bytes(head, "little")
            if 8 + header_len > size:
                return f"truncated safetensors file ({size} bytes; its header alone claims {header_len})"
            header = json.loads(f.read(header_len))
    except (OSError, ValueError):
        return "not a safetensors file (unreadable header)"
    data = size - 8 - header_len
    tensors = sorted(((v["data_offsets"][1], k) for k, v in header.items()
                      if isinstance(v, dict) and "data_offsets" in v), key=lambda t: t[0])
    cut = [name for end, name in tensors if end > data]
    if cut:
        more = f" (and {len(cut) - 1} more tensors)" if len(cut) > 1 else ""
        return f"truncated file: tensor {cut[0]!r}{more} lies past its end ({data} bytes of data)"
    return None


_CUDA_MISSING = ("Torch not compiled with CUDA enabled", "Found no NVIDIA driver", "No CUDA GPUs are available",
                 "CUDA driver initialization failed", "no CUDA-capable device is detected")


def _cuda_message(exc: BaseException, args) -> str | None:
    if not isinstance(exc, (AssertionError, RuntimeError)) or not any(s in str(exc) for s in _CUDA_MISSING):
        return None
    device = getattr(args, "device", None)
    asked = f"--device {device}" if device else "a CUDA device"
    return f"{asked} was asked for, but CUDA is not available here ({_one_line(exc)}): use --device cpu"


_SIZE_MISMATCH_RE = re.compile(r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\((\[[^\]]*\])\) "
                               r"from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def _adapter_message(exc: BaseException, args) -> str | None:
    text = str(exc)
    mismatches = _SIZE_MISMATCH_RE.findall(text) if isinstance(exc, RuntimeError) else []
    missing_targets = isinstance(exc, ValueError) and "not found in the base model" in text
    if not mismatches and not missing_targets:
        return None
    adapter = getattr(args, "lora", None) or getattr(args, "adapter", None) or "the adapter"
    model = getattr(args, "model", None) or "the model"
    if mismatches:
        name, stored, wanted = mismatches[0]
        detail = (f"tensor {name} is {stored} in the adapter but {wanted} in the model"
                  f"{f' ({len(mismatches) - 1} more mismatches)' if len(mismatches) > 1 else ''}")
    else:
        detail = _one_line(text).split(". Please")[0]
    return f"adapter {adapter} does not fit {model} ({detail}): use an adapter trained on this base model"


_OS_ERRORS = {FileNotFoundError: "no such file or folder", PermissionError: "permission denied",
              IsADirectoryError: "is a folder, a file was expected", NotADirectoryError: "is not a folder"}


def _os_message(exc: BaseException, args) -> str | None:
    if not isinstance(exc, OSError):
        return None
    if exc.errno == errno.ENOSPC:
        return f"no space left on the device{f' writing {exc.filename}' if exc.filename else ''}: free some space"
    for kind, what in _OS_ERRORS.items():
        if isinstance(exc, kind) and exc.filename:
            return f"{exc.filename}: {what}: check the path"
    return None
