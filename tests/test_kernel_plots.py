"""The kernel figures' drawing order does not depend on the process (set order varies with PYTHONHASHSEED)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

from qerl_lib.plots.kernel import plot_gemm_speedup, shape_order

ROOT = Path(__file__).resolve().parents[1]


def _row(layout, proj, n, k, m=1):
    return {"layout": layout, "proj": proj, "n": n, "k": k, "m": m}


ROWS = [_row("hf", "down_proj", 3584, 18944), _row("hf", "gate_proj,up_proj", 18944, 3584),
        _row("hf", "q_proj,o_proj", 3584, 3584), _row("fused", "gate_up_proj", 37888, 3584),
        _row("hf", "down_proj", 3584, 18944, m=16)]
EXPECTED = ["gate_up_proj", "down_proj", "gate_proj,up_proj", "q_proj,o_proj"]


def test_shapes_of_equal_size_are_ordered_by_name_whatever_the_input_order():
    orders = {tuple(s[1] for s in shape_order(list(p))) for p in itertools.permutations(ROWS)}
    assert orders == {tuple(EXPECTED)}


def test_shape_order_is_the_same_under_any_hash_seed():
    # a set's order of strings changes with PYTHONHASHSEED: fresh processes with different seeds must agree
    code = ("import json, sys; from qerl_lib.plots.kernel import shape_order; "
            "print(json.dumps([s[1] for s in shape_order(json.loads(sys.argv[1]))]))")
    for seed in ("0", "1", "2", "3", "4", "5"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        done = subprocess.run([sys.executable, "-c", code, json.dumps(ROWS)], env=env, cwd=ROOT, capture_output=True,
                              text=True, check=True)
        assert json.loads(done.stdout) == EXPECTED, (seed, done.stdout)


def test_gemm_speedup_figure_draws_from_the_committed_results(tmp_path):
    from PIL import Image

    src = ROOT / "results" / "gemm_h100_v5.json"
    out = plot_gemm_speedup(src, tmp_path / "speedup.png", target=3.0, target_large_m=0.95)
    info = Image.open(out).info
    assert info["Source"].endswith("gemm_h100_v5.json") and len(json.loads(src.read_text())["rows"]) > 0
