"""The README's speed-and-memory claims table: rendered from results/, and each verdict follows its rule."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qerl_lib.studies import headline
from qerl_lib.studies.result_reading import ResultsError
from qerl_lib.studies.speed_claims import render_speed_claims, speed_claim_rows

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def results_copy(tmp_path):
    shutil.copytree(ROOT / "results", tmp_path / "results")
    return tmp_path / "results"


def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _verdicts(results_dir) -> dict[str, str]:
    return {claim: verdict for claim, _, _, _, verdict in speed_claim_rows(results_dir)}


def test_readme_block_is_the_rendered_one():
    block = headline.read_block((ROOT / "README.md").read_text(encoding="utf-8"), "speed_claims")
    assert block == render_speed_claims(ROOT / "results"), (
        "README.md's speed claims differ from the JSONs: run `qerl results --readme README.md`")


def test_a_step_speedup_below_the_papers_does_not_hold(results_copy):
    claim = "GRPO step faster than 16-bit LoRA's (7B / 14B, batch 8)"
    assert _verdicts(results_copy)[claim] == "**holds**"
    # one case, 14B on the H200, falls to 1.1x lora's step: the claim (x1.2 at every case) no longer holds
    _edit(results_copy / "train_step_merge_h200.json", lambda d: [
        r.update(step_s=r["step_s"] * 1.46 / 1.1) for r in d["rows"]
        if r["model"] == "qwen2.5-14b" and r["mode"] == "qerl" and r["batch"] == 8])
    assert _verdicts(results_copy)[claim] == "**does not hold**"


def test_the_16_bit_32b_claim_holds_only_when_its_peak_passes_the_h100s_memory(results_copy):
    claim = "16-bit LoRA at 32B does not fit one 80 GB GPU (batch 2)"
    assert _verdicts(results_copy)[claim] == "**does not hold**"
    _edit(results_copy / "train_step_merge_h200.json", lambda d: [
        r.update(peak_gib=85.0) for r in d["rows"] if r["model"] == "qwen2.5-32b" and r["mode"] == "lora"])
    assert _verdicts(results_copy)[claim] == "**holds**"


def test_a_memory_share_verdict_names_the_models_where_it_holds(results_copy):
    claim = "QeRL takes 40-50% of 16-bit LoRA's GPU memory"
    rows = json.loads((results_copy / "train_step_merge_h200.json").read_text())["rows"]
    peak = {(r["model"], r["mode"], r["batch"]): r["peak_gib"] for r in rows
            if not r.get("rollout_lora_merge") and r.get("num_gpus") == 1 and r.get("preset") is None}
    share = peak["qwen2.5-32b", "qerl", 2] / peak["qwen2.5-32b", "lora", 2]
    text = {c: k for c, _, k, _, _ in speed_claim_rows(results_copy)}[claim]
    assert f"{share:.0%} of lora's" in text
    assert _verdicts(results_copy)[claim] == "**holds at 32B only**"
    _edit(results_copy / "train_step_merge_h200.json", lambda d: [
        r.update(peak_gib=r["peak_gib"] / 2) for r in d["rows"] if r["model"] == "qwen2.5-7b" and r["mode"] == "qerl"])
    assert _verdicts(results_copy)[claim] == "**holds at 7B, 32B only**"


def test_a_missing_results_file_is_named(results_copy):
    (results_copy / "rollout_nf4_h200.json").unlink()
    with pytest.raises(ResultsError, match="rollout_nf4_h200.json: not found"):
        speed_claim_rows(results_copy)


def test_results_command_writes_both_readme_blocks_or_nothing(tmp_path, capsys):
    from qerl_lib.cli import main

    readme = tmp_path / "README.md"
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = headline.MARKERS["speed_claims"]
    stale = text.split(start)[0] + f"{start}\nold\n{end}" + text.split(end)[1]
    readme.write_text(stale, encoding="utf-8")
    assert main(["results", "--readme", str(readme)]) == 0
    assert readme.read_text(encoding="utf-8") == text
    assert "wrote the speed_claims table" in capsys.readouterr().out
    h_start, h_end = headline.MARKERS["headline"]
    stale_headline = stale.split(h_start)[0] + f"{h_start}\nold\n{h_end}" + stale.split(h_end)[1]
    no_markers = stale_headline.replace(start, "").replace(end, "")
    readme.write_text(no_markers, encoding="utf-8")
    assert main(["results", "--readme", str(readme)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "speed_claims:start" in err[0], err
    assert readme.read_text(encoding="utf-8") == no_markers  # the headline block was not written either


@pytest.mark.parametrize("batch, above, below", [(2, 1.55, 1.45), (4, 1.45, 1.35)])  # 7B's x1.5 / x1.4
def test_small_batch_steps_are_not_measured_until_a_file_has_both_modes(results_copy, batch, above, below):
    claim = f"GRPO step faster than 16-bit LoRA's at batch {batch} (7B / 14B)"
    small = ("qwen2.5-7b", "qwen2.5-14b")

    def drop_small(doc):
        doc["rows"] = [r for r in doc["rows"] if not (r["batch"] == batch and r["model"] in small)]

    _edit(results_copy / "train_step_merge_h200.json", drop_small)
    assert _verdicts(results_copy)[claim] == "**not measured**"

    def add_small(speedup):
        def change(doc):
            drop_small(doc)
            extra = []
            for r in doc["rows"]:
                if r["batch"] == 8 and r["model"] in small and r["mode"] in ("lora", "qerl") \
                        and not r["rollout_lora_merge"] and r["num_gpus"] == 1 and r.get("preset") is None:
                    extra.append({**r, "batch": batch, "step_s": 10.0 * speedup if r["mode"] == "lora" else 10.0})
            doc["rows"] += extra
        return change

    _edit(results_copy / "train_step_merge_h200.json", add_small(above))  # at or above the paper's at 7B and 14B
    row = {c: (k, v) for c, _, k, _, v in speed_claim_rows(results_copy)}[claim]
    assert row == (f"{above:.2f}× / {above:.2f}×, LoRA r32, 256 + 2048", "**holds**")
    shutil.copy(ROOT / "results" / "train_step_merge_h200.json", results_copy / "train_step_merge_h200.json")
    _edit(results_copy / "train_step_merge_h200.json", add_small(below))  # below 7B's
    assert _verdicts(results_copy)[claim] == "**does not hold**"


def test_32b_batch_eight_claims_wait_for_their_rows_then_follow_the_peaks(results_copy):
    fits, no_fit = ("a 32B model trains on one 80 GB GPU (batch 8, gradient checkpointing)",
                    "16-bit LoRA at 32B does not fit one 80 GB GPU (batch 8)")
    step_file = results_copy / "train_step_merge_h200.json"

    def add_big(peaks):
        def change(doc):
            doc["rows"] = [r for r in doc["rows"] if not (r["model"] == "qwen2.5-32b" and r["batch"] == 8)]
            doc["rows"] += [{**r, "batch": 8, "peak_gib": peaks[r["mode"]]} for r in doc["rows"]
                            if r["model"] == "qwen2.5-32b" and r["batch"] == 2 and r["mode"] in peaks]
        return change

    def verdicts():
        found = _verdicts(results_copy)
        return [found[fits], found[no_fit]]

    _edit(step_file, add_big({}))
    assert verdicts() == ["**not measured**"] * 2
    _edit(step_file, add_big({"qerl": 40.0}))  # each row waits for its own mode only
    assert verdicts() == ["**holds**", "**not measured**"]
    _edit(step_file, add_big({"qerl": 40.0, "lora": 90.0}))  # the paper's picture: qerl under the H100's 79.2 GiB
    assert verdicts() == ["**holds**", "**holds**"]
    _edit(step_file, add_big({"qerl": 85.0, "lora": 75.0}))
    assert verdicts() == ["**does not hold**", "**does not hold**"]


@pytest.mark.parametrize("batch", [2, 8])
def test_a_16_bit_32b_step_on_the_h100_decides_whether_it_fits(results_copy, batch):
    claim = f"16-bit LoRA at 32B does not fit one 80 GB GPU (batch {batch})"
    h100_file = results_copy / "train_step_h100.json"
    base = next(r for r in json.loads(h100_file.read_text())["rows"]
                if r["model"] == "qwen2.5-32b" and r["mode"] == "qerl" and r["batch"] == 2)
    _edit(results_copy / "train_step_merge_h200.json", lambda d: [  # the H200's 16-bit peak made to fit: 70 GiB
        r.update(peak_gib=70.0) for r in d["rows"]
        if (r["model"], r["mode"], r["batch"]) == ("qwen2.5-32b", "lora", batch) and r["peak_gib"] >= 79.2])
    assert _verdicts(results_copy)[claim] == "**does not hold**"  # the H200's peak under the H100's 79.2
    oom = {**base, "mode": "lora", "batch": batch, "error": "torch.OutOfMemoryError: CUDA out of memory. Tried to "
           "allocate 1.2 GiB", "step_s": None, "peak_gib": None}
    _edit(h100_file, lambda d: d["rows"].append(oom))
    row = {c: (k, v) for c, _, k, _, v in speed_claim_rows(results_copy)}[claim]
    assert row == ("out of memory on the H100 (79.2 GiB)", "**holds**")
    _edit(h100_file, lambda d: d["rows"].append({**oom, "error": None, "step_s": 50.0, "peak_gib": 78.5}))
    row = {c: (k, v) for c, _, k, _, v in speed_claim_rows(results_copy)}[claim]
    assert row == ("ran on the H100: peak 78.5 GiB of its 79.2", "**does not hold**")  # a step that ran decides


def test_the_batch_two_rollout_follows_the_steps_rollout_phases(results_copy):
    claim = "rollout faster than 16-bit LoRA's at batch 2 (7B / 14B / 32B)"
    step_file = results_copy / "train_step_merge_h200.json"
    rows = {(r["model"], r["mode"]): r for r in json.loads(step_file.read_text())["rows"]
            if r["batch"] == 2 and r["num_gpus"] == 1 and not r["rollout_lora_merge"]}
    ratio = (rows["qwen2.5-32b", "lora"]["rollout_s"] / rows["qwen2.5-32b", "qerl"]["rollout_s"]
             * rows["qwen2.5-32b", "qerl"]["completion_len"] / rows["qwen2.5-32b", "lora"]["completion_len"])
    kit = {c: k for c, _, k, _, _ in speed_claim_rows(results_copy)}[claim]
    assert kit.split(" / ")[2].startswith(f"{ratio:.2f}×")  # tokens/s from each row's own completion length
    # 32B's qerl rollout 1.7x lora's tokens/s: under Tab. 8's 60.0 / 34.0 = 1.76x
    _edit(step_file, lambda d: [r.update(rollout_s=r["rollout_s"] * ratio / 1.7) for r in d["rows"]
                                if r["model"] == "qwen2.5-32b" and r["mode"] == "qerl" and r["batch"] == 2])
    assert _verdicts(results_copy)[claim] == "**does not hold**"
    _edit(step_file, lambda d: d.update(rows=[r for r in d["rows"] if not (r["model"] == "qwen2.5-14b"
                                                                            and r["batch"] == 2)]))
    assert _verdicts(results_copy)[claim] == "**not measured**"

