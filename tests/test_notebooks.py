"""Every notebook runs headless through papermill at a tiny scale (house rule P9).

SMOKE maps each notebook to parameters that keep it to tens of seconds on a 2-core CPU; the
notebook's own defaults are the `make reproduce` scale. A notebook without an entry fails
here on purpose: add its smoke parameters when you add it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from qerl_lib.cli.notebook_runner import (KERNEL_NAME, UnknownParameterError, ensure_kernel, list_notebooks,
                                          reproduce, run_notebook)
from qerl_lib.errors import UserError
from qerl_lib.paths import REPO_ROOT

SMOKE: dict[str, dict] = {
    "00_setup_check": {"max_new_tokens": 16},
    "01_first_look": {"n_problems": 4, "max_new_tokens": 24, "expr_tokens": 8, "quant_backend": "native"},
    "02_nvfp4_format": {"layers_to_scan": 2},
    "03_fp4_kernel": {},
    "04_adaptive_quantization_noise": {"n_problems": 2, "max_new_tokens": 16},
    "05_grpo_training": {"steps": 2},
    "06_entropy_study": {"n_problems": 4, "max_new_tokens": 16, "samples": 1, "sigmas": [0.0, 0.01]},
    "07_paper_claims": {},  # reads the committed JSONs; the tiny sweep's machinery is tests/test_sweep.py's
    "08_rollout_scheduling": {"n_prompts": 6, "slots": 3, "max_new_tokens": 24},
}

pytestmark = pytest.mark.notebooks


@pytest.mark.parametrize("path", list_notebooks(), ids=lambda p: p.stem)
def test_notebook_runs_headless(path, tmp_path, embedded_model_dir):
    assert path.stem in SMOKE, f"add smoke parameters for {path.stem} to tests/test_notebooks.py"
    params = {"device": "cpu", "artifacts_dir": str(tmp_path), **SMOKE[path.stem]}
    if "figures_dir" in path.read_text():
        params["figures_dir"] = str(tmp_path / "figures")
    run = run_notebook(path, out_dir=tmp_path, parameters=params, progress_bar=False)
    assert run.output.exists()
    written = list(tmp_path.glob("*.json"))
    assert written, f"{path.name} wrote no metrics JSON to artifacts_dir"
    for j in written:
        json.loads(j.read_text())
    if "figures_dir" in params:
        assert list(Path(params["figures_dir"]).glob("*.png")), f"{path.name} wrote no figure"


def test_unknown_parameter_is_an_error(tmp_path):
    path = list_notebooks(["00"])[0]
    with pytest.raises(UnknownParameterError, match="typo_parameter"):
        run_notebook(path, out_dir=tmp_path, parameters={"device": "cpu", "typo_parameter": 1}, progress_bar=False)
    assert not list(tmp_path.iterdir()), "a run refused before executing leaves no file behind"


# ---------------------------------------------------------------------------------------------
# The kernel, and runs that fail


def test_notebooks_name_the_kit_kernel():
    for path in list_notebooks():
        spec = json.loads(path.read_text())["metadata"]["kernelspec"]
        assert spec["name"] == KERNEL_NAME and spec["display_name"] == "QeRL kit (.venv)", \
            f"{path.name}: its metadata.kernelspec must name the kit's kernel {KERNEL_NAME!r} (JupyterLab opens it in that)"


def test_ensure_kernel_registers_repairs_and_starts_in_the_repo_root(tmp_path, monkeypatch):
    import sys

    from jupyter_client.manager import start_new_kernel

    name, ours = "qerl-kit-test", tmp_path / "ours"
    monkeypatch.setenv("JUPYTER_PATH", str(ours / "share" / "jupyter"))  # searched first: the test sees only its own
    folder = ensure_kernel(name, prefix=ours)
    assert folder == ours / "share" / "jupyter" / "kernels" / name
    spec = json.loads((folder / "kernel.json").read_text())
    assert spec["argv"][0] == sys.executable and spec["display_name"] == "QeRL kit (.venv)"

    km, kc = start_new_kernel(kernel_name=name, cwd=str(tmp_path))  # JupyterLab starts it in the notebook's folder
    seen: list = []
    try:
        reply = kc.execute_interactive("import os; print(os.getcwd())", timeout=60, output_hook=seen.append)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert reply["content"]["status"] == "ok"
    printed = "".join(m["content"].get("text", "") for m in seen if m["header"]["msg_type"] == "stream")
    assert printed.strip() == str(REPO_ROOT), "the kit's kernel must start in the repository root"

    stale = dict(spec, argv=["/moved/away/python", *spec["argv"][1:]])
    (folder / "kernel.json").write_text(json.dumps(stale))
    assert ensure_kernel(name, prefix=ours) == folder
    assert json.loads((folder / "kernel.json").read_text()) == spec, "a stale spec is rewritten"

    shadow = tmp_path / "shadow" / "share" / "jupyter" / "kernels" / name
    shadow.mkdir(parents=True)
    (shadow / "kernel.json").write_text(json.dumps(stale))
    monkeypatch.setenv("JUPYTER_PATH", os.pathsep.join([str(shadow.parents[1]), str(ours / "share" / "jupyter")]))
    with pytest.raises(UserError, match=f"jupyter kernelspec remove {name}"):
        ensure_kernel(name, prefix=ours)


def tiny_notebook(folder: Path) -> Path:
    """Write `folder/00_tiny.ipynb`: parameters `device` and `fail`, and a cell that raises when `fail` is set."""
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": KERNEL_NAME, "display_name": "QeRL kit (.venv)", "language": "python"}
    params = nbformat.v4.new_code_cell('device = "cpu"\nfail = False')
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params, nbformat.v4.new_code_cell('print("ran with fail =", fail)\n'
                                                  'if fail:\n    raise RuntimeError("planted failure")')]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "00_tiny.ipynb"
    nbformat.write(nb, path)
    return path


def test_a_failed_run_keeps_the_last_good_copy(tmp_path, capsys):
    books, out = tmp_path / "notebooks", tmp_path / "out"
    tiny_notebook(books)
    reproduce(out_dir=out, notebooks_dir=books)
    good = out / "00_tiny.ipynb"
    before = good.read_bytes()
    assert b"ran with fail = False" in before
    table = capsys.readouterr().out.split("\n\n")[-1].splitlines()
    assert table[0].split() == ["notebook", "seconds", "status"] and table[1].split()[::2] == ["00_tiny.ipynb", "ok"]
    assert table[-1].split()[0] == "total", table
    assert len({re.match(r"\S+ +\S+", line).end() for line in table}) == 1, f"columns must line up: {table}"

    with pytest.raises(UserError, match="00_tiny.ipynb failed in cell .*RuntimeError: planted failure") as e:
        reproduce(out_dir=out, notebooks_dir=books, extra_parameters={"fail": True})
    assert "last good copy kept" in str(e.value)
    assert good.read_bytes() == before, "the failed run must not touch the last good executed copy"
    failed = out / "00_tiny.failed.ipynb"
    assert "planted failure" in failed.read_text() and "ran with fail = True" in failed.read_text()
    assert sorted(p.name for p in out.iterdir()) == ["00_tiny.failed.ipynb", "00_tiny.ipynb"], "no temporary left behind"
    assert capsys.readouterr().out.rstrip().splitlines()[-2].split()[::2] == ["00_tiny.ipynb", "failed"]

    run_notebook(books / "00_tiny.ipynb", out_dir=out, progress_bar=False)
    assert sorted(p.name for p in out.iterdir()) == ["00_tiny.ipynb"], "a good run clears the stale failed copy"


def test_reproduce_without_notebooks_is_an_error(tmp_path, capsys):
    from qerl_lib.cli import main

    assert main(["reproduce", "--notebooks", str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("qerl reproduce: error: no notebooks to run in"), err
    assert not (tmp_path / "out").exists()
