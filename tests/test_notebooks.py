"""Every notebook runs headless through papermill at a tiny scale (house rule P9).

SMOKE maps each notebook to parameters that keep it to tens of seconds on a 2-core CPU; the
notebook's own defaults are the `make reproduce` scale. A notebook without an entry fails
here on purpose: add its smoke parameters when you add it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_lib.cli.notebook_runner import UnknownParameterError, list_notebooks, run_notebook

SMOKE: dict[str, dict] = {
    "00_setup_check": {"max_new_tokens": 16},
    "01_first_look": {"n_problems": 4, "max_new_tokens": 24, "quant_backend": "native"},
    "02_nvfp4_format": {"layers_to_scan": 2},
    "03_fp4_kernel": {},
    "04_adaptive_quantization_noise": {"n_problems": 2, "max_new_tokens": 16},
    "05_grpo_training": {"steps": 2},
    "06_entropy_study": {"n_problems": 4, "max_new_tokens": 16, "samples": 1, "sigmas": [0.0, 0.01]},
    "07_paper_claims": {},  # reads the committed JSONs; the tiny sweep's machinery is tests/test_sweep.py's
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
