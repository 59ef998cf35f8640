"""Atomic file and folder writes: nothing the kit writes is ever left half-written.

Every writer goes to a temporary sibling first and then `os.replace`s it into place, which
is atomic on POSIX file systems: a reader (or a resumed run) sees the old file or the new
one, never a torn one.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
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
