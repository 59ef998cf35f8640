"""Writing results: atomic file and folder writes, and the provenance block every result carries.

Every writer goes to a temporary sibling first and then `os.replace`s it into place, which
is atomic on POSIX file systems: a reader (or a resumed run) sees the old file or the new
one, never a torn one. Temporary files and folders are created private (0600 / 0700); before
they are published they get the modes a plain `open` / `mkdir` would give (0666 / 0777 less the
process umask: `file_mode` / `folder_mode`; `atomic_directory` widens everything inside to at
least those, `open_up_tree`), so outputs are as readable as the user's umask allows.

JSON writers refuse NaN and Infinity (not JSON; most parsers reject them) with one line naming the
key path of the first offending value: a writer that has no number writes null and says why.

Output folders (`--out` of quantize, export, prepare-model): `prepare_output_folder` decides
whether a folder may be written at all (an existing non-empty one only with `--force`; one that
is, contains or lies inside an input never), and `atomic_directory` writes it into a temporary
sibling that replaces the old folder by rename only once complete. `atomic_directory` itself
refuses to replace a non-empty folder unless told `force=True` or `prepare_output_folder` cleared
that folder for replacement earlier in the process, so library code that skips the check cannot
delete a user's folder. `fsync_tree` / `fsync_dir` make a folder's files durable before a
completion marker is written after them.

Every results/ JSON and every metrics JSON embeds `provenance()` (device, date, package
versions, command), so a reader can tell where a number came from and whether it is comparable
with another.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import importlib.metadata as _md
import json
import math
import os
import platform
import shutil
import stat
import sys
import tempfile
import uuid
from pathlib import Path
from typing import Any, Iterable, Iterator

from qerl_lib.errors import UserError


def current_umask() -> int:
    """The process umask, read without changing it where Linux allows (/proc), else by setting and restoring it."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # no read-only API elsewhere: set, then restore at once
    os.umask(mask)
    return mask


def file_mode() -> int:
    """Mode of a new file under the current umask, as `open` gives it: 0o666 & ~umask."""
    return 0o666 & ~current_umask()


def folder_mode() -> int:
    """Mode of a new folder under the current umask, as `mkdir` gives it: 0o777 & ~umask."""
    return 0o777 & ~current_umask()


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` to `path` through a temp file + rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, file_mode())  # mkstemp's 0600 would make every output private
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
    """Serialise `obj` as JSON (keys in insertion order) and write it atomically; NaN/Infinity are refused."""
    return write_text_atomic(path, dumps_strict(obj, path, indent=indent) + "\n")


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    """Write one JSON document per line, atomically; NaN/Infinity are refused."""
    text = "".join(dumps_strict(r, path, where=f"line {i + 1}: ") + "\n" for i, r in enumerate(rows))
    return write_text_atomic(path, text)


def append_jsonl_atomic(path: str | os.PathLike, row: dict) -> Path:
    """Append one line to a JSONL file by rewriting it atomically (files here are small); NaN/Infinity are refused."""
    path = Path(path)
    line = dumps_strict(row, path, where="new line: ")  # before reading: a refused row changes nothing
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    return write_text_atomic(path, old + line + "\n")


def dumps_strict(obj: Any, path: str | os.PathLike = "JSON", indent: int | None = None, where: str = "") -> str:
    """`json.dumps` with ``allow_nan=False``; a NaN/Infinity raises ValueError naming its key path, e.g.
    ``results/x.json: NaN at formats.nvfp4.per_problem[3] is not JSON: write null (and a note saying why) instead``."""
    try:
        return json.dumps(obj, indent=indent, default=_json_default, allow_nan=False)
    except ValueError as e:
        found = _non_finite_path(obj, "") if str(e).startswith("Out of range float") else None
        if found is None:  # another error (a circular reference...): json's own message
            raise
        key, value = found
        value = "NaN" if math.isnan(value) else "Infinity" if value > 0 else "-Infinity"
        raise ValueError(f"{path}: {where}{value} at {key or '(top level)'} is not JSON: "
                         "write null (and a note saying why) instead") from None


def _non_finite_path(obj: Any, key: str) -> tuple[str, float] | None:
    """(key path, value) of the first NaN/Infinity in `obj`, converting objects as `_json_default` does."""
    if isinstance(obj, float):
        return None if math.isfinite(obj) else (key, obj)
    if isinstance(obj, dict):
        items = ((f"{key}.{k}" if key else str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{key}[{i}]", v) for i, v in enumerate(obj))
    elif isinstance(obj, (str, int, bool, Path)) or obj is None:
        return None
    else:
        try:
            return _non_finite_path(_json_default(obj), key)
        except TypeError:
            return None
    for k, v in items:
        found = _non_finite_path(v, k)
        if found is not None:
            return found
    return None


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def earlier_results(path: str | os.PathLike) -> tuple[Any, list[dict]]:
    """An existing results file that a rerun may resume: its JSON document (None when it is unreadable or not JSON;
    the caller says what it expected) and the provenance of every run whose rows it holds, oldest first (the
    runs it had itself resumed from, under ``provenance.resumed_from``, then the one that wrote it)."""
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None, []
    last = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(last, dict):
        return doc, []
    prior = last.get("resumed_from")
    return doc, [*(prior if isinstance(prior, list) else []), {k: v for k, v in last.items() if k != "resumed_from"}]


RESUME_FIX = "pass --force to replace it, or choose another --json"  # how every resumed --json refusal ends


def resumable_record(path: str | os.PathLike, command: str, tables: tuple[str, ...] = ("provenance",),
                     row_fields: tuple[str, ...] = (), note: str = "") -> tuple[dict, list[dict]]:
    """`earlier_results` for an existing ``--json`` file that ``command`` (e.g. ``"qerl bench train"``) resumes: the
    document must be one run's record, a ``rows`` list of dicts (each with ``row_fields``) and a dict under each
    key of ``tables``; anything else raises a one-line `UserError` naming ``--force`` (``note`` adds to what it
    says was expected)."""
    doc, runs = earlier_results(path)
    rows = doc.get("rows") if isinstance(doc, dict) else None
    if not (isinstance(rows, list) and all(isinstance(doc.get(k), dict) for k in tables)
            and all(isinstance(r, dict) and set(row_fields) <= set(r) for r in rows)):
        expected = ", ".join(("rows", *tables)[:-1]) + " and " + tables[-1] if tables else "rows"
        raise UserError(f"--json {path} exists and is not the record of one `{command}` run ({expected}{note}): "
                        f"{RESUME_FIX}")
    return doc, runs


def _inside(path: Path, folder: Path) -> bool:
    """True when `path` is `folder` or lies below it (both already resolved)."""
    return path == folder or folder in path.parents


def refuse_overlap(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                   flag: str = "--out") -> Path:
    """Raise `UserError` when `out` is, contains or lies inside one of `inputs`; return `out` as a Path.

    Inputs that do not exist locally (None, hub ids, aliases) are skipped. Paths are compared after
    resolving symbolic links, so a link to the model folder counts as the model folder.
    """
    out = Path(out).expanduser()
    target = out.resolve()
    for given in inputs:
        if given is None or not Path(given).expanduser().exists():
            continue
        source = Path(given).expanduser().resolve()
        if target == source:
            relation = "is"
        elif _inside(source, target):
            relation = "contains"
        elif _inside(target, source):
            relation = "is inside"
        else:
            continue
        raise UserError(f"{flag} {out} {relation} the input {given}: choose an {flag} folder outside every input "
                        "(--force does not override this)")
    return out


def prepare_output_file(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                        force: bool | None = False, flag: str = "--out", suffix: str | None = None) -> Path:
    """Check, before any work, that a file may be written at `out`; return `out` as a Path.

    Refused with a one-line `UserError` naming the fix: an `out` that is a folder, one that is one of `inputs`
    (`refuse_overlap`: writing it would destroy what is being read), one without `suffix` where one is given
    (a figure must end in ``.png``), and, unless `force` (None: replacing is this output's normal use, as for a
    figure redrawn), an existing file. Nothing is written here; the writers replace files atomically."""
    out = Path(out).expanduser()
    if out.is_dir():
        raise UserError(f"{flag} {out} is a folder: pass a file path")
    if suffix is not None and out.suffix.lower() != suffix:
        raise UserError(f"{flag} {out} does not end in {suffix}: pass a {suffix} path")
    refuse_overlap(out, inputs, flag)
    if force is False and out.is_file():
        raise UserError(f"{flag} {out} already exists: pass --force to replace it, or choose another {flag}")
    return out


def prepare_output_folder(out: str | os.PathLike, inputs: Iterable[str | os.PathLike | None] = (),
                          force: bool = False, flag: str = "--out") -> Path:
    """Check, before any work, that a new folder may be written at `out`; return `out` as a Path.

    Refused with a one-line `UserError` naming the fix, whatever `force` says: an `out` that is a
    file or a symbolic link, and one that is, contains or lies inside an input (`refuse_overlap`).
    Refused unless `force`: an existing folder that is not empty. Nothing is written or removed here;
    the writer then replaces the folder atomically (`atomic_directory`).
    """
    out = Path(out).expanduser()
    if out.is_symlink():
        raise UserError(f"{flag} {out} is a symbolic link: pass the folder it points to, or another {flag}")
    if out.exists() and not out.is_dir():
        raise UserError(f"{flag} {out} is a file, not a folder: choose another {flag}")
    refuse_overlap(out, inputs, flag)
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise UserError(f"{flag} {out} already exists and is not empty: pass --force to replace it, "
                            f"or choose another {flag}")
        _CLEARED.add(_key(out))  # atomic_directory may now replace it (once)
    return out


# Folders `prepare_output_folder` cleared for replacement (with force) in this process; `atomic_directory`
# consumes an entry when it replaces the folder.
_CLEARED: set[str] = set()


def _key(folder: Path) -> str:
    return os.path.abspath(folder)


def _refuse_replacing(final: Path, force: bool) -> None:
    """`UserError` unless `final` is absent, an empty folder, cleared by `prepare_output_folder`, or `force`."""
    if force or _key(final) in _CLEARED:
        return
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        what = "a symbolic link" if final.is_symlink() else "a file"
    elif final.is_dir() and any(final.iterdir()):
        what = "a non-empty folder"
    else:
        return
    raise UserError(f"{final} already exists ({what}) and writing there would replace it: pass force=True "
                    "(or clear it with io.prepare_output_folder(..., force=True)), or write elsewhere")


@contextlib.contextmanager
def atomic_directory(final: str | os.PathLike, force: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to `final`; on success it replaces `final` by rename.

    On any exception the temporary folder is removed and `final` is untouched, so a crash
    (or a corrupt input) never leaves a half-written folder behind. If `final` already exists
    it is renamed to a fresh hidden sibling, the new folder renamed into place, and only then
    the old one removed; a crash between the two renames leaves the old folder under
    ``.NAME.*.old`` beside it, never deleted. An existing `final` that is not an empty folder is
    replaced only with `force=True` or when `prepare_output_folder(final, force=True)` cleared it
    in this process; otherwise `UserError` before anything is written. Before publishing,
    `open_up_tree` gives the folder and everything in it at least the modes `mkdir` / `open` give
    under the umask (the temporary folder is created 0700, and safetensors writes its files 0600).
    """
    final = Path(final)
    _refuse_replacing(final, force)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent))
    try:
        yield tmp
        open_up_tree(tmp)
        fsync_tree(tmp)
        if final.exists() or final.is_symlink():
            old = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.old")  # a name nobody holds
            os.replace(final, old)
            os.replace(tmp, final)
            fsync_dir(final.parent)
            if old.is_dir() and not old.is_symlink():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink()
        else:
            os.replace(tmp, final)
            fsync_dir(final.parent)
        _CLEARED.discard(_key(final))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def open_up_tree(folder: str | os.PathLike) -> None:
    """Widen modes below `folder` (itself included) to at least 0o777 & ~umask for folders and
    0o666 & ~umask for files, as `mkdir` / `open` would create them.

    Writers that go through private temporary files (mkstemp, safetensors) leave 0600 behind; this
    undoes that without narrowing anything a writer made more open on purpose (an executable bit,
    a 0644 under umask 027). Symbolic links are left alone.
    """
    dmode, fmode = folder_mode(), file_mode()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, stat.S_IMODE(os.stat(root).st_mode) | dmode)
        for name in files:
            path = os.path.join(root, name)
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode):
                os.chmod(path, stat.S_IMODE(st.st_mode) | fmode)


def fsync_dir(folder: str | os.PathLike) -> None:
    """Flush a folder's entries (names created, renamed or removed) to disk."""
    fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(folder: str | os.PathLike) -> dict[str, int]:
    """Flush every file below `folder` and every folder's entries to disk; return {relative path: size}.

    Called before a completion marker is written, so that the marker, once on disk, implies the
    files it vouches for are on disk too (the marker can then list the sizes this returns).
    """
    folder = Path(folder)
    sizes: dict[str, int] = {}
    for root, dirs, files in os.walk(folder):
        for name in sorted(files):
            path = Path(root) / name
            if path.is_symlink():
                continue
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            sizes[path.relative_to(folder).as_posix()] = path.stat().st_size
        fsync_dir(root)
    return sizes


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
    """The block every results JSON carries: device, date (UTC), versions, command, the ``QERL_*``
    environment switches that were set (README "Environment switches"), since they change what ran, and the
    library's source hash (``library_sha256``), which names the code that ran."""
    return {
        "device": device_info(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": command if command is not None else " ".join([sys.argv[0].split("/")[-1], *sys.argv[1:]]),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("QERL_")},
        "library_sha256": library_sha256(),
    }


LIBRARY_SOURCES = ("*.py", "*.cu", "*.cuh")  # what library_sha256 reads under qerl_lib/


def tree_sha256(path: str | os.PathLike, patterns: Iterable[str] = ("*",)) -> str:
    """The first 12 hex digits of a sha256 over a file's bytes, or over a folder's files matching ``patterns`` (each
    one's path under the folder, then its bytes, in path order)."""
    base = Path(path)
    digest = hashlib.sha256()
    if base.is_file():
        digest.update(base.read_bytes())
    else:
        for file in sorted({p for pattern in patterns for p in base.rglob(pattern) if p.is_file()}):
            digest.update(file.relative_to(base).as_posix().encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def library_sha256(root: str | os.PathLike | None = None) -> str:
    """``tree_sha256`` of the library's source files (``root``: the installed ``qerl_lib``): it names the code that
    wrote a result also where the tree is a copy without git history, as on the GPU machines; compiled caches are
    not read."""
    return tree_sha256(Path(root) if root is not None else Path(__file__).resolve().parent, LIBRARY_SOURCES)


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
