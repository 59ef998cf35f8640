"""Notebook 01's table and figure: `evaluation.format_comparison` and `plots.first_look.plot_format_comparison`
on hand-made `compare_formats` results (CPU, no model)."""
from __future__ import annotations

import json

from qerl_lib.evals.evaluation import format_comparison
from qerl_lib.plots.first_look import plot_format_comparison


def _result(pass_bf16: float, pass_nvfp4: float, task: str) -> dict:
    def fmt(p, length, h, same):
        return {"pass@1": p, "pass@1_ci95": [max(p - 0.1, 0.0), min(p + 0.1, 1.0)], "format_rate": 0.0,
                "mean_length": length, "entropy": None, "entropy_on_reference": h,
                "same_completion_as_reference": same}
    nvfp4 = fmt(pass_nvfp4, 64.0, 1.36, 0.25)
    nvfp4["entropy_diff_vs_reference"] = {"mean_diff": 0.141, "low": 0.09, "high": 0.19, "n": 32}
    return {"reference": "bf16", "n_problems": 32, "task": task, "config": {"max_new_tokens": 64},
            "formats": {"bf16": fmt(pass_bf16, 61.6, 1.22, 1.0), "nvfp4": nvfp4}}


def test_table_says_when_no_model_answered_anything_right():
    empty = format_comparison(_result(0.0, 0.0, "word problems"))
    assert "fmt rate" in empty.splitlines()[0] and empty.splitlines()[0].count("format") == 0
    assert "nvfp4 - bf16 entropy on identical tokens: +0.1410 nats" in empty
    assert "the accuracy comparison is empty here" in empty and "of 64 tokens" in empty
    expressions = _result(0.34, 0.25, "expressions")
    expressions["config"]["first_number"] = True  # no marked format on that task
    table = format_comparison(expressions)
    assert "empty" not in table and table.splitlines()[1].split()[4] == "-"


def test_figure_takes_accuracy_from_the_expression_task_where_present(tmp_path):
    metrics = _result(0.0, 0.0, "word problems")
    metrics["expressions"] = _result(0.34, 0.25, "level-3 expressions")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(metrics))
    out = plot_format_comparison(path, tmp_path / "f.png")
    assert out.is_file() and out.stat().st_size > 1000
    del metrics["expressions"]  # older metrics files: accuracy from the main problems, as before
    path.write_text(json.dumps(metrics))
    assert plot_format_comparison(path, tmp_path / "g.png").is_file()
