"""Writing results: atomic file and folder writes, and the provenance block every result carries.

Every writer goes to a temporary sibling first and then `os.replace`s it into place, which
is atomic on POSIX file systems: a reader (or a resumed run) sees the old file or the new
one, never a torn one.

Every results/ JSON and every metrics JSON embeds `provenance()` (device, date, package
versions, command), so a reader can tell where a number came from and whether it is comparable
with another.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata as _md
import json
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temp file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return path


def write_json_atomic(path: str | os.PathLike, obj: Any, indent: int = 2) -> Path:
    """Serialise `obj` as JSON (keys in insertion order) and write it atomically."""
    return write_text_atomic(path, json.dumps(obj, indent=indent, default=_json_default) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Write one JSON document per line, atomically."""
    text = "".join(json.dumps(r, default=_json_default) + "\n" for r in rows)
    return write_text_atomic(path, text)


def append_jsonl_atomic(path: str | os.PathLike, row: dict) -> Path:
    """Append one line to a JSONL file by rewriting it atomically (files here are small)."""
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    return write_text_atomic(path, old + json.dumps(row, default=_json_default) + "\n")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary folder next to `final`; on success rename it to `final`.

    On any exception the temporary folder is removed and `final` is untouched, so a crash
    (or a corrupt input) never leaves a half-written folder behind. If `final` already
    exists it is replaced.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        if final.exists():
            old = final.with_name(f".{final.name}.old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _json_default(o: Any):
    # numpy / torch scalars and paths show up in metrics; make them plain JSON.
    if isinstance(o, Path):
        return str(o)
    if hasattr(o, "item"):
        return o.item()
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ---------------------------------------------------------------------------------------------
# Provenance

PACKAGES = ("torch", "triton", "transformers", "trl", "peft", "compressed-tensors", "llmcompressor",
            "bitsandbytes", "datasets", "accelerate", "math-verify", "papermill")


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict:
    """Name of the accelerator (or CPU), with the facts that change timings."""
    info: dict = {"cpu": platform.processor() or platform.machine(), "cpu_count": _cpu_count()}
    try:
        import torch
    except ImportError:
        return {"name": "cpu", **info}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    gpu_count=torch.cuda.device_count())
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def provenance(command: str | None = None) -> dict:
    """The block every results JSON carries: device, date (UTC), versions and command."""
    return {
        "device": device_info(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": command if command is not None else " ".join([sys.argv[0].split("/")[-1], *sys.argv[1:]]),
    }


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
