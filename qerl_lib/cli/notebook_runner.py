"""Execute the kit's notebooks headlessly with papermill (`qerl reproduce`, `make reproduce`).

Every notebook under `notebooks/` is named `NN_topic.ipynb` and has exactly one cell tagged
`parameters` holding literals (papermill injects overrides after it). The runner executes
them in order from the repository root, writes executed copies to `artifacts/` (ignored by
git) and stops at the first failure with the notebook's name. Figures are written by the
notebooks themselves, through `qerl_lib.plots`, into `figures/`.

Nothing is lost on a failure: papermill writes into a hidden temporary file beside the
executed copy, a finished run then replaces `artifacts/NAME.ipynb` atomically, and a failed
run leaves the last good `NAME.ipynb` as it was and puts its own partial output in
`NAME.failed.ipynb` next to it.

The notebooks run in the Jupyter kernel `qerl-kit` ("QeRL kit (.venv)"): the Python running
this module, started in the repository root. `make setup` registers it and `run_notebook`
registers it again when it is missing or differs (another Python, a moved checkout), so a fresh
clone, `make reproduce` and JupyterLab (`make lab`) all run the notebooks the same way, relative
paths included.

Passing a parameter a notebook does not declare is an error, not papermill's usual warning:
a typo in a parameter name would otherwise silently run the defaults.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from qerl_lib.errors import UserError
from qerl_lib.io import atomic_directory, write_json_atomic, write_text_atomic
from qerl_lib.paths import ARTIFACTS_DIR, NOTEBOOKS_DIR, REPO_ROOT

KERNEL_NAME = "qerl-kit"
KERNEL_DISPLAY_NAME = "QeRL kit (.venv)"


class UnknownParameterError(UserError):
    """A parameter was passed that the notebook's `parameters` cell does not define."""


class _RaiseOnUnknownParameter(logging.Handler):
    """Turns papermill's 'Passed unknown parameter' warning into an exception."""

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "Passed unknown parameter" in message:
            raise UnknownParameterError(f"{message}: check the spelling against the notebook's parameters cell")


@dataclass
class NotebookRun:
    notebook: str
    output: Path
    seconds: float
    parameters: dict = field(default_factory=dict)
    status: str = "ok"  # "ok" or "failed" (then `output` is the NAME.failed.ipynb copy)


# ---------------------------------------------------------------------------------------------
# The kernel


def kernel_spec(display_name: str = KERNEL_DISPLAY_NAME) -> dict:
    """The kernel.json this Python registers: ipykernel's own spec, run by `sys.executable`, whose
    kernel first changes into the repository root (where `qerl reproduce` runs the notebooks), so
    the notebooks' relative paths (artifacts/, figures/, results/) mean the same in JupyterLab."""
    from ipykernel.kernelspec import get_kernel_dict

    chdir = f"--IPKernelApp.exec_lines=__import__('os').chdir({str(REPO_ROOT)!r})"
    python_arguments = ["-Xfrozen_modules=off"] if platform.python_implementation() == "CPython" else []
    spec = get_kernel_dict(extra_arguments=[chdir], python_arguments=python_arguments)
    spec["display_name"] = display_name
    return spec


def _found_kernel(name: str) -> tuple[Path, dict | None] | None:
    """(folder, kernel.json or None if unreadable) of the spec Jupyter resolves `name` to, or None."""
    from jupyter_client.kernelspec import KernelSpecManager

    folder = KernelSpecManager().find_kernel_specs().get(name.lower())
    if folder is None:
        return None
    try:
        return Path(folder), json.loads((Path(folder) / "kernel.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return Path(folder), None


def _kernel_install_dir(name: str, prefix: str | os.PathLike | None) -> Path:
    """`prefix`/share/jupyter/kernels/`name`; without `prefix`: `sys.prefix` where it is writable (a
    virtual or conda environment, as `ipykernel install --sys-prefix`), else the user's Jupyter data folder."""
    if prefix is None and os.access(sys.prefix, os.W_OK):
        prefix = sys.prefix
    if prefix is not None:
        return Path(prefix) / "share" / "jupyter" / "kernels" / name
    from jupyter_core.paths import jupyter_data_dir

    return Path(jupyter_data_dir()) / "kernels" / name


def ensure_kernel(name: str = KERNEL_NAME, prefix: str | os.PathLike | None = None,
                  display_name: str = KERNEL_DISPLAY_NAME) -> Path:
    """Register `kernel_spec()` as Jupyter kernel `name` unless the spec Jupyter finds under that
    name already is exactly it; return the spec's folder.

    The folder is written atomically into `_kernel_install_dir(name, prefix)`, with ipykernel's logos.
    Raises `UserError` when a spec of the same name earlier on Jupyter's search path still hides it.
    """
    wanted = kernel_spec(display_name)
    found = _found_kernel(name)
    if found is not None and found[1] == wanted:
        return found[0]
    from ipykernel.kernelspec import RESOURCES

    target = _kernel_install_dir(name, prefix)
    with atomic_directory(target, force=True) as tmp:  # the kit's own kernel spec, replaced when stale
        for logo in Path(RESOURCES).iterdir():
            if logo.is_file():
                shutil.copyfile(logo, tmp / logo.name)
        write_json_atomic(tmp / "kernel.json", wanted, indent=1).chmod(0o644)
        tmp.chmod(0o755)
    found = _found_kernel(name)
    if found is None or found[1] != wanted:
        where = found[0] if found else "nowhere"
        raise UserError(f"Jupyter resolves kernel {name!r} to {where}, not to {target} just written: "
                        f"remove the other one (`jupyter kernelspec remove {name}` from its environment)")
    return target


# ---------------------------------------------------------------------------------------------
# Running notebooks


def list_notebooks(only: list[str] | None = None, notebooks_dir: Path = NOTEBOOKS_DIR) -> list[Path]:
    """`notebooks_dir/NN_*.ipynb` in order; `only` filters by prefix or name (e.g. ["00", "01_first_look"])."""
    books = sorted(p for p in Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb"))
    if only:
        books = [b for b in books if any(b.stem == o or b.stem.startswith(o) or b.name == o for o in only)]
        if not books:
            raise UserError(f"no notebook matches {only}: names look like 00_setup_check")
    return books


def failed_copy(out_dir: Path, path: Path) -> Path:
    """Where a failed run of notebook `path` leaves its partial output: `out_dir/NAME.failed.ipynb`."""
    return Path(out_dir) / f"{path.stem}.failed.ipynb"


def run_notebook(path: Path, out_dir: Path = ARTIFACTS_DIR, parameters: dict | None = None,
                 kernel_name: str = KERNEL_NAME, progress_bar: bool = True) -> NotebookRun:
    """Execute one notebook into `out_dir/NAME`; raise `UserError` naming it (and the failing cell's error) on failure.

    Papermill writes into a hidden temporary file in `out_dir`. When the run finishes it atomically
    replaces `out_dir/NAME` and a stale `NAME.failed.ipynb` is removed; when it fails, `out_dir/NAME`
    (the last good copy) is left as it was and whatever papermill wrote goes to `NAME.failed.ipynb`.
    The kit's kernel is registered first if missing or stale (`ensure_kernel`).
    """
    import papermill as pm

    path = Path(path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    output, failed = out_dir / path.name, failed_copy(out_dir, path)
    parameters = dict(parameters or {})
    if kernel_name == KERNEL_NAME:
        ensure_kernel()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".running.ipynb", dir=out_dir)
    os.close(fd)
    running = Path(tmp_name)
    handler = _RaiseOnUnknownParameter(level=logging.WARNING)
    pm_logger = logging.getLogger("papermill")
    pm_logger.addHandler(handler)
    finished = False
    start = time.perf_counter()
    try:
        pm.execute_notebook(str(path), str(running), parameters=parameters, kernel_name=kernel_name,
                            cwd=str(REPO_ROOT), progress_bar=progress_bar, log_output=False)
        finished = True
    except UnknownParameterError as e:
        raise UnknownParameterError(f"{path.name}: {e}") from None
    except pm.PapermillExecutionError as e:
        kept = f"; last good copy kept: {output}" if output.exists() else ""
        raise UserError(f"notebook {path.name} failed in cell {e.exec_count}: {e.ename}: {e.evalue} "
                        f"(executed copy: {failed}{kept})") from None
    finally:
        pm_logger.removeHandler(handler)
        _settle(running, output if finished else failed)
        if finished:
            failed.unlink(missing_ok=True)
    return NotebookRun(path.name, output, time.perf_counter() - start, parameters)


def _settle(running: Path, destination: Path) -> None:
    """Move papermill's temporary output to `destination` atomically (nothing if papermill never wrote it)."""
    try:
        if running.stat().st_size:
            write_text_atomic(destination, running.read_text(encoding="utf-8"))
    finally:
        running.unlink(missing_ok=True)


def timing_table(runs: list[NotebookRun], total_seconds: float) -> str:
    """Per-notebook wall times and the total, fixed width."""
    lines = [f"{'notebook':44s} {'seconds':>9s}  status"]
    lines += [f"{r.notebook:44s} {r.seconds:9.1f}  {r.status}" for r in runs]
    lines.append(f"{'total':44s} {total_seconds:9.1f}")
    return "\n".join(lines)


def reproduce(device: str = "cpu", out_dir: Path = ARTIFACTS_DIR, only: list[str] | None = None,
              extra_parameters: dict | None = None, notebooks_dir: Path = NOTEBOOKS_DIR) -> list[NotebookRun]:
    """Run every notebook in order with `device` (and any extra parameters every notebook declares).

    Raises `UserError` when there is no notebook to run. Prints the timing table at the end, also
    when a notebook fails (its row then says "failed" and the error propagates).
    """
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    books = list_notebooks(only, notebooks_dir)
    if not books:
        raise UserError(f"no notebooks to run in {notebooks_dir}: qerl reproduce runs NN_topic.ipynb files "
                        f"(pass --notebooks DIR, or run from a complete checkout of the kit)")
    parameters = {"device": device, **(extra_parameters or {})}
    runs: list[NotebookRun] = []
    start = time.perf_counter()
    try:
        for path in books:
            print(f"[reproduce] {path.name} ...", flush=True)
            began = time.perf_counter()
            try:
                run = run_notebook(path, out_dir, parameters)
            except BaseException:
                runs.append(NotebookRun(path.name, failed_copy(out_dir, path), time.perf_counter() - began,
                                        parameters, status="failed"))
                raise
            print(f"[reproduce] {path.name} done in {run.seconds:.0f} s -> {run.output}", flush=True)
            runs.append(run)
    finally:
        print("\n" + timing_table(runs, time.perf_counter() - start), flush=True)
    return runs


def main() -> int:
    """`python -m qerl_lib.cli.notebook_runner` (run by `make setup`): register the kit's kernel."""
    try:
        print(f"Jupyter kernel {KERNEL_NAME!r} ({KERNEL_DISPLAY_NAME}): {ensure_kernel()}")
    except UserError as e:
        print(f"kernel: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
