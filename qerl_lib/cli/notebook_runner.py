"""Execute the kit's notebooks headlessly with papermill (`qerl reproduce`, `make reproduce`).

Every notebook under `notebooks/` is named `NN_topic.ipynb` and has exactly one cell tagged
`parameters` holding literals (papermill injects overrides after it). The runner executes
them in order from the repository root, writes executed copies to `artifacts/` (ignored by
git) and stops at the first failure with the notebook's name. Figures are written by the
notebooks themselves, through `qerl_lib.plots`, into `figures/`.

Passing a parameter a notebook does not declare is an error, not papermill's usual warning:
a typo in a parameter name would otherwise silently run the defaults.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from qerl_lib.errors import UserError
from qerl_lib.paths import ARTIFACTS_DIR, NOTEBOOKS_DIR, REPO_ROOT


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


def list_notebooks(only: list[str] | None = None) -> list[Path]:
    """`notebooks/NN_*.ipynb` in order; `only` filters by prefix or name (e.g. ["00", "01_first_look"])."""
    books = sorted(p for p in NOTEBOOKS_DIR.glob("[0-9][0-9]_*.ipynb"))
    if only:
        books = [b for b in books if any(b.stem == o or b.stem.startswith(o) or b.name == o for o in only)]
        if not books:
            raise UserError(f"no notebook matches {only}: names look like 00_setup_check")
    return books


def run_notebook(path: Path, out_dir: Path = ARTIFACTS_DIR, parameters: dict | None = None,
                 kernel_name: str = "python3", progress_bar: bool = True) -> NotebookRun:
    """Execute one notebook; raise `UserError` naming it (and the failing cell's error) on failure."""
    import papermill as pm

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    output = out_dir / path.name
    parameters = dict(parameters or {})
    handler = _RaiseOnUnknownParameter(level=logging.WARNING)
    pm_logger = logging.getLogger("papermill")
    pm_logger.addHandler(handler)
    start = time.perf_counter()
    try:
        pm.execute_notebook(str(path), str(output), parameters=parameters, kernel_name=kernel_name,
                            cwd=str(REPO_ROOT), progress_bar=progress_bar, log_output=False)
    except UnknownParameterError as e:
        raise UnknownParameterError(f"{path.name}: {e}") from None
    except pm.PapermillExecutionError as e:
        raise UserError(f"notebook {path.name} failed in cell {e.exec_count}: {e.ename}: {e.evalue} "
                        f"(executed copy: {output})") from None
    finally:
        pm_logger.removeHandler(handler)
    return NotebookRun(path.name, output, time.perf_counter() - start, parameters)


def reproduce(device: str = "cpu", out_dir: Path = ARTIFACTS_DIR, only: list[str] | None = None,
              extra_parameters: dict | None = None) -> list[NotebookRun]:
    """Run every notebook in order with `device` (and any extra parameters every notebook declares)."""
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device must be cpu or cuda, got {device!r}")
    runs = []
    for path in list_notebooks(only):
        print(f"[reproduce] {path.name} ...", flush=True)
        run = run_notebook(path, out_dir, {"device": device, **(extra_parameters or {})})
        print(f"[reproduce] {path.name} done in {run.seconds:.0f} s -> {run.output}", flush=True)
        runs.append(run)
    return runs
