"""The GRPO step figure: which rows become bars, the speedups it prints, and the PNG's named source."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qerl_lib.plots.train_step import plot_train_steps, step_cases

ROOT = Path(__file__).resolve().parents[1]


def _row(model, mode, step_s, batch=8, merged=False, **extra):
    return {"model": model, "mode": mode, "batch": batch, "rollout_lora_merge": merged, "rollout_s": step_s - 2.0,
            "train_s": 1.5, "step_s": step_s, "error": None, "prompt_len": 256, "gen_len": 2048, "lora_rank": 32,
            **extra}


def test_bars_are_the_plain_one_gpu_rows_in_mode_order_with_speedups_over_unmerged_lora():
    rows = [_row("qwen2.5-7b", "lora", 12.0), _row("qwen2.5-7b", "qerl", 8.0),
            _row("qwen2.5-7b", "lora", 11.0, merged=True), _row("qwen2.5-7b", "qlora", 24.0),
            _row("qwen2.5-7b", "qerl", 5.0, num_gpus=2),  # data parallel: another figure's
            _row("qwen2.5-7b", "qerl", 99.0, batch=128, preset="qwen2.5-7b-gsm8k"),
            _row("qwen2.5-7b", "lora", 3.0, error="OutOfMemoryError"),
            _row("qwen2.5-32b", "qerl", 20.0, batch=2), _row("qwen2.5-14b", "qerl", 9.0, batch=2)]
    cases = step_cases(rows)
    assert [(c["model"], c["batch"]) for c in cases] == [("qwen2.5-7b", 8), ("qwen2.5-14b", 2), ("qwen2.5-32b", 2)]
    bars = cases[0]["bars"]
    assert [b["label"] for b in bars] == ["qerl", "lora, merged rollout", "lora", "qlora"]
    assert [b["speedup_vs_lora"] for b in bars] == [1.5, 12.0 / 11.0, 1.0, 0.5]
    assert all(b["other_s"] == pytest.approx(0.5) for b in bars)
    assert cases[2]["bars"][0]["speedup_vs_lora"] is None  # no lora row at 32B


def test_two_rows_for_one_bar_are_refused_by_name():
    rows = [_row("qwen2.5-14b", "qerl", 16.0), _row("qwen2.5-14b", "qerl", 17.0)]
    with pytest.raises(ValueError, match="steps.json: 2 rows for qwen2.5-14b batch 8 mode qerl: keep one"):
        step_cases(rows, source="steps.json")


def test_committed_h200_figure_data_gives_qerls_speedup_over_lora(tmp_path):
    from PIL import Image

    src = ROOT / "results" / "train_step_merge_h200.json"
    doc = json.loads(src.read_text())
    step = {(r["model"], r["mode"]): r["step_s"] for r in doc["rows"]
            if r["batch"] == 8 and not r["rollout_lora_merge"] and r["num_gpus"] == 1 and r.get("preset") is None}
    seven = next(c for c in step_cases(doc["rows"]) if c["batch"] == 8)
    assert seven["model"] == "qwen2.5-7b"
    assert seven["bars"][0]["speedup_vs_lora"] == step["qwen2.5-7b", "lora"] / step["qwen2.5-7b", "qerl"]
    out = plot_train_steps(src, tmp_path / "steps.png")
    assert Image.open(out).info["Source"].endswith("train_step_merge_h200.json")


def test_a_file_without_step_rows_is_a_clear_error(tmp_path):
    src = tmp_path / "empty.json"
    src.write_text(json.dumps({"rows": [], "provenance": {"device": {"name": "X"}}}))
    with pytest.raises(ValueError, match="no measured one-GPU step row"):
        plot_train_steps(src, tmp_path / "x.png")


def test_plot_steps_command_draws_beside_the_json_and_refuses_other_files_in_one_line(tmp_path, capsys):
    from qerl_lib.cli import main

    src = tmp_path / "train.json"
    src.write_text((ROOT / "results" / "train_step_merge_h200.json").read_text())
    assert main(["plot-steps", str(src)]) == 0
    assert (tmp_path / "train.png").is_file()
    capsys.readouterr()
    bad = tmp_path / "rollout.json"
    bad.write_text(json.dumps({"rows": [{"model": "qwen2.5-7b", "batch": 8, "tok_s": 1.0}], "provenance": {}}))
    for path, expected in ((tmp_path / "none.json", "does not exist: pass the file written by `qerl bench train"),
                           (bad, "rollout.json: no measured one-GPU step row")):
        assert main(["plot-steps", str(path)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and expected in err[0], err
