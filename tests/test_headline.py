"""The README's GPU numbers come from results/: its table is the rendered one, and a gap in a file fails loudly."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from qerl_lib.studies import headline, headline_training
from qerl_lib.studies.headline import ResultsError

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"


def test_readme_table_is_the_rendered_one():
    block = headline.read_block((ROOT / "README.md").read_text(encoding="utf-8"), "headline")
    assert block == headline.render_headline(RESULTS), (
        "README.md's results table differs from the JSONs: run `qerl results --readme README.md`")


def test_results_readme_index_is_the_rendered_one():
    block = headline.read_block((RESULTS / "README.md").read_text(encoding="utf-8"), "index")
    assert block == headline.results_index(RESULTS), (
        "results/README.md's file table is stale: run `qerl results --index results/README.md`")


def test_results_folder_holds_only_described_results():
    extra, missing = headline.unlisted_entries(RESULTS)
    assert not extra, f"results/ holds {extra}: describe them in headline.RESULT_FILES or move them to dev/runs/"
    assert not missing, f"RESULT_FILES describes {missing}, which results/ lacks"
    files = [p for p in RESULTS.rglob("*") if p.is_file()]
    assert len(files) <= 26, f"results/ holds {len(files)} files (at most 26)"
    assert not [p for p in files if p.suffix == ".py"], "scripts belong in dev/sweeps/"


def test_every_result_records_its_provenance():
    for name in headline.RESULT_FILES:
        doc, label = headline._file_provenance(RESULTS, name)
        runs = doc["provenance"] if isinstance(doc["provenance"], list) else [doc["provenance"]]
        for prov in runs:
            assert {"device", "date", "versions", "command"} <= set(prov), f"{label}: incomplete provenance"


@pytest.fixture()
def results_copy(tmp_path):
    shutil.copytree(RESULTS, tmp_path / "results")
    return tmp_path / "results"


def _edit(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize("file, change, expected", [
    ("rollout_h200.json", lambda d: [r.pop("tok_s") for r in d["rows"]], "['rows'][0]['tok_s']"),
    ("gemm_h100_v5.json", lambda d: d.pop("ceiling"), "missing field ['ceiling']"),
    ("entropy_study_cuda.json", lambda d: d["formats"]["nvfp4"]["diff_vs_bf16"].pop("entropy_gold"),
     "['entropy_gold']"),
    ("rollout_h100.json", lambda d: [p["device"].pop("name") for p in d["provenance"]], "['device']['name']"),
    ("rollout_h100.json", lambda d: d.update(rows=[r for r in d["rows"] if r["model"] != "qwen2.5-32b"]),
     "no measured row with model=qwen2.5-32b"),
    ("rollout_nf4_h200.json", lambda d: d.update(rows=[r for r in d["rows"] if r["weights"] != "nf4"]),
     "no NF4 row measured"),
    ("rollout_nf4_h200.json", lambda d: d["summary"]["paper_vllm_h100"].pop("7b_nf4_b8"), "['7b_nf4_b8']"),
    ("gemm_marlin_peer_h200.json", lambda d: [r.update(marlin_ok=False) for r in d["rows"]],
     "no row with both outputs checked"),
    ("rollout_lora_merge_h200.json", lambda d: [r.update(lora_merged=False) for r in d["rows"]],
     "no row with lora_merged true"),
    ("train_step_merge_h200.json",
     lambda d: d.update(rows=[r for r in d["rows"] if not (r["rollout_lora_merge"] and r["batch"] == 8)]),
     "no measured row with model=qwen2.5-7b, mode=lora, rollout_lora_merge=True, batch=8"),
    ("train_step_merge_h200.json", lambda d: d.update(rows=[r for r in d["rows"] if r["batch"] != 128 or r["mode"] != "qerl"]),
     "no measured row with model=qwen2.5-7b, mode=qerl, batch=128"),
    ("rollout_h200.json", lambda d: d.update(rows=[r for r in d["rows"] if r["batch"] != 128 or r["lora_merged"]]),
     "no measured row with weights=nvfp4, lora_merged=False, model=qwen2.5-7b, batch=128"),
], ids=["field in rows", "top-level field", "nested field", "provenance", "no matching row", "no nf4 row",
        "paper's nf4 number", "no checked marlin row", "no merged row", "no merged train row", "no preset step row",
        "no preset rollout row"])
def test_a_missing_field_names_the_file_and_the_field(results_copy, file, change, expected):
    _edit(results_copy / file, change)
    with pytest.raises(ResultsError) as err:
        headline.render_headline(results_copy)
    assert file in str(err.value) and expected in str(err.value), str(err.value)


def test_a_missing_file_is_named(results_copy):
    (results_copy / "rollout_h200.json").unlink()
    with pytest.raises(ResultsError, match="rollout_h200.json: not found"):
        headline.render_headline(results_copy)


def test_update_block_replaces_only_between_the_markers():
    text = "intro\n<!-- headline:start -->\nold\n<!-- headline:end -->\noutro\n"
    assert headline.update_block(text, "headline", "new") == "intro\n<!-- headline:start -->\nnew\n<!-- headline:end -->\noutro\n"
    with pytest.raises(ResultsError, match="expected one"):
        headline.update_block("no markers here", "headline", "new")


def test_commands_are_shown_with_current_names(tmp_path):
    (tmp_path / "dev" / "runs").mkdir(parents=True)
    (tmp_path / "results").mkdir()
    (tmp_path / "dev" / "runs" / "old.json").write_text("{}")
    shown = headline.display_command("__main__.py bench rollout --merge results/old.json --json /root/out/new.json",
                                     repo_root=tmp_path)
    assert shown == "qerl bench rollout --merge dev/runs/old.json --json new.json"


def test_kernel_summaries_read_the_committed_files():
    from qerl_lib.studies import kernel

    assert len(kernel.current_kernel_hash()) == 12
    split = kernel.step_split(json.loads((RESULTS / "rollout_step_breakdown_h200.json").read_text()))
    assert split["context"] == 1280 and split["parts"][0]["share"] >= split["parts"][-1]["share"]
    assert abs(sum(p["share"] for p in split["parts"]) - 1) < 0.05  # categories cover the busy time
    rollout = kernel.rollout_headline(json.loads((RESULTS / "rollout_h100.json").read_text()))
    assert rollout["fp4_kernel_hashes"] and rollout["targets"]
    with pytest.raises(ValueError, match="no 'fp8' rows"):
        kernel.step_split({"rows": [{"weights": "nvfp4"}]}, weights="fp8")


def test_nf4_row_compares_within_the_kits_engine(results_copy):
    """Faster vLLM NF4 rows do not enter the kit's NVFP4 / NF4 ratio (the first NF4 row), only the vLLM row."""
    before = headline._rollout_nf4_rows(results_copy)

    def faster_vllm(doc):
        for r in doc["rows"]:
            if r["weights"] == "nf4" and r["engine"] == "vllm":
                r["tok_s"] *= 10

    _edit(results_copy / "rollout_nf4_h200.json", faster_vllm)
    after = headline._rollout_nf4_rows(results_copy)
    assert after[0] == before[0] and after[1] != before[1]


def test_nf4_vllm_row_is_computed_from_the_served_rows(results_copy):
    """The vLLM NF4 row: both ratios from the file's rows; without vLLM rows only the kit's row remains."""
    doc = json.loads((results_copy / "rollout_nf4_h200.json").read_text())
    tok = {(r["engine"], r["weights"], r["rank"]): r["tok_s"] for r in doc["rows"] if r["batch"] == 8}
    quantity, value, _, _ = headline._rollout_nf4_rows(results_copy)[1]
    assert "vLLM" in quantity and "r0" in quantity and "r16" in quantity
    for rank in (0, 16):
        assert f"{tok['vllm', 'nvfp4', rank] / tok['vllm', 'nf4', rank]:.2f}×" in value
        assert f"{tok['qerl', 'nvfp4', rank] / tok['vllm', 'nf4', rank]:.2f}×" in value
    _edit(results_copy / "rollout_nf4_h200.json", lambda d: d.update(rows=[r for r in d["rows"] if r["engine"] != "vllm"]))
    assert len(headline._rollout_nf4_rows(results_copy)) == 1


def test_marlin_peer_row_spans_the_checked_rows(results_copy):
    """The peer row's ranges are min-max over the rows whose outputs both matched the oracle, per M."""
    doc = json.loads((results_copy / "gemm_marlin_peer_h200.json").read_text())
    ms = sorted({r["m"] for r in doc["rows"]})
    lowest = {m: min(r["marlin_over_bf16"] for r in doc["rows"] if r["m"] == m) for m in ms}
    _, value, _, _ = headline._gemm_peer_row(results_copy)
    assert all(f"{lowest[m]:.2f}×-" in value for m in ms)

    def unchecked_slowest(d):  # the slowest Marlin row at the first M loses its check: it leaves the range
        slowest = min((r for r in d["rows"] if r["m"] == ms[0]), key=lambda r: r["marlin_over_bf16"])
        slowest["marlin_ok"] = False

    _edit(results_copy / "gemm_marlin_peer_h200.json", unchecked_slowest)
    assert f"{lowest[ms[0]]:.2f}×-" not in headline._gemm_peer_row(results_copy)[1]


def test_merge_row_is_each_cost_against_its_own_batchs_rank_0_row(results_copy):
    """The merged and unmerged costs come from the rows: each against the rank-0 row at its batch and length, and
    the peak difference from the same pairs."""
    doc = json.loads((results_copy / "rollout_lora_merge_h200.json").read_text())
    tok = {(r["batch"], r["rank"], r["lora_merged"]): r["tok_s"] for r in doc["rows"]}
    quantity, value, device, _ = headline._rollout_merge_row(results_copy)
    assert device == "H200" and "batch 32 r16 256 + 1024" in quantity
    for (batch, rank, merged), t in tok.items():
        if rank:
            assert f"{100 * (1 - t / tok[batch, 0, False]):.1f}%" in value, (batch, rank, merged)
    _edit(results_copy / "rollout_lora_merge_h200.json",
          lambda d: [r.update(tok_s=r["tok_s"] / 2) for r in d["rows"] if r["lora_merged"]])
    halved = [f"{100 * (1 - t / 2 / tok[b, 0, False]):.1f}%" for (b, r, m), t in sorted(tok.items()) if m]
    assert f"merged {' / '.join(halved)};" in headline._rollout_merge_row(results_copy)[1]


def test_train_merge_row_is_qerls_step_against_both_lora_rows(results_copy):
    """Each model's speedups are lora's step over qerl's, merged and unmerged, from the rows of one file; the
    paper's number is the qerl row's."""
    doc = json.loads((results_copy / "train_step_merge_h200.json").read_text())
    step = {(r["model"], r["mode"], r["rollout_lora_merge"]): r["step_s"] for r in doc["rows"] if r["batch"] == 8}
    _, value, device, file = headline_training._train_merge_row(results_copy)
    assert device == "H200" and file == "train_step_merge_h200.json"
    for model in ("qwen2.5-7b", "qwen2.5-14b"):
        q = step[model, "qerl", False]
        assert f"{step[model, 'lora', True] / q:.2f}× / {step[model, 'lora', False] / q:.2f}×" in value, model
    _edit(results_copy / "train_step_merge_h200.json",
          lambda d: [r.update(step_s=r["step_s"] * 2) for r in d["rows"] if r["mode"] == "qerl"])
    q = step["qwen2.5-7b", "qerl", False] * 2
    assert f"{step['qwen2.5-7b', 'lora', True] / q:.2f}×" in headline_training._train_merge_row(results_copy)[1]


def test_preset_step_row_is_qerl_against_the_merged_lora_step_at_128_rows(results_copy):
    doc = json.loads((results_copy / "train_step_merge_h200.json").read_text())
    rows = {r["mode"]: r for r in doc["rows"] if r["batch"] == 128}
    quantity, value, device, _ = headline_training._preset_step_merged_row(results_copy)
    q, m = rows["qerl"], rows["lora"]
    assert m["rollout_lora_merge"] and "128 rows" in quantity and device == "H200"
    assert value.startswith(f"{q['step_s']:.0f} / {m['step_s']:.0f} s") and f"qerl at {m['step_s'] / q['step_s']:.2f}×" in value
    assert f"peak {q['peak_gib']:.1f} / {m['peak_gib']:.1f} GiB" in value


def test_preset_rollout_row_compares_nvfp4_with_both_bf16_rows(results_copy):
    doc = json.loads((results_copy / "rollout_h200.json").read_text())
    tok = {(r["weights"], r["lora_merged"]): r["tok_s"] for r in doc["rows"] if r["batch"] == 128 and r["rank"] == 32}
    quantity, value, device, _ = headline_training._preset_rollout_row(results_copy)
    assert "128 rows" in quantity and "LoRA r32" in quantity and device == "H200"
    fp = tok["nvfp4", False]
    assert f"{fp / tok['bf16', False]:.2f}× / {fp / tok['bf16', True]:.2f}× of bf16's" in value


def test_train_merge_row_names_a_rollout_that_stopped_early(results_copy):
    """A mode whose completions averaged fewer tokens than asked did less work: the row says so, and only then."""
    def completions(length):
        def edit(doc):
            for r in doc["rows"]:
                if r["batch"] == 8:
                    r["completion_len"] = length if (r["mode"], r["rollout_lora_merge"]) == ("lora", True) else r["gen_len"]
        return edit

    _edit(results_copy / "train_step_merge_h200.json", completions(1500.0))
    value = headline_training._train_merge_row(results_copy)[1]
    assert value.count("lora merged's completions averaged 1500 tokens") == 2 and value.count("averaged") == 2, value
    _edit(results_copy / "train_step_merge_h200.json", completions(2048.0))
    assert "averaged" not in headline_training._train_merge_row(results_copy)[1]


def test_big_step_row_is_the_32b_lora_step_over_qerls(results_copy):
    doc = json.loads((results_copy / "train_step_merge_h200.json").read_text())
    rows = {r["mode"]: r for r in doc["rows"] if r["model"] == "qwen2.5-32b" and r["batch"] == 2}
    quantity, value, device, file = headline_training._big_step_row(results_copy)
    q, lora = rows["qerl"], rows["lora"]
    assert "Qwen2.5-32B" in quantity and "batch 2" in quantity and device == "H200"
    assert value.startswith(f"{q['step_s']:.1f} / {lora['step_s']:.1f} s: {lora['step_s'] / q['step_s']:.2f}× over lora")
    assert f"peak {q['peak_gib']:.1f} / {lora['peak_gib']:.1f} GiB" in value
    _edit(results_copy / "train_step_merge_h200.json",
          lambda d: d.update(rows=[r for r in d["rows"] if not (r["model"] == "qwen2.5-32b" and r["mode"] == "lora")]))
    with pytest.raises(ResultsError, match="no measured row with model=qwen2.5-32b, mode=lora, batch=2"):
        headline_training._big_step_row(results_copy)


def test_data_parallel_row_is_each_batchs_one_gpu_step_over_its_two_gpu_step(results_copy):
    doc = json.loads((results_copy / "train_step_merge_h200.json").read_text())
    step = {(r["batch"], r["num_gpus"]): r["step_s"] for r in doc["rows"] if r["batch"] in (16, 64)}
    quantity, value, device, file = headline_training._data_parallel_row(results_copy)
    assert "1 / 2 GPUs" in quantity and device == "H200 (2-GPU machine)" and file == "train_step_merge_h200.json"
    for batch in (16, 64):
        one, two = step[batch, 1], step[batch, 2]
        assert f"batch {batch}: {one:.1f} / {two:.1f} s, {one / two:.2f}×" in value
    _edit(results_copy / "train_step_merge_h200.json",
          lambda d: [r.update(step_s=r["step_s"] / 2) for r in d["rows"] if r.get("num_gpus") == 2])
    assert f"{2 * step[64, 1] / step[64, 2]:.2f}×" in headline_training._data_parallel_row(results_copy)[1]
    _edit(results_copy / "train_step_merge_h200.json",
          lambda d: d.update(rows=[r for r in d["rows"] if not (r.get("num_gpus") == 1 and r["batch"] == 64)]))
    with pytest.raises(ResultsError, match="no measured row with model=qwen2.5-7b, mode=qerl, batch=64, num_gpus=1"):
        headline_training._data_parallel_row(results_copy)


def test_dispatch_table_names_the_kernel_each_call_gets():
    """Notebook 03's table: the decode rows on the mma.sync kernel, every label one the GEMM benchmark writes, the
    largest row count on dequantize + cuBLAS, and each cell what `plan_launch` picks for that shape."""
    from qerl_lib.bench.gemm import projection_shapes
    from qerl_lib.kernels import launch_rule
    from qerl_lib.studies.kernel import dispatch_table

    rows = dispatch_table("qwen2.5-7b", [1, 8, 64, 1024, 4096])
    names = [s.name for s in projection_shapes("qwen2.5-7b")]
    assert [r["m"] for r in rows] == [1, 8, 64, 1024, 4096] and all(set(r) == {"m", *names} for r in rows)
    assert all(rows[i][n] == "mma" for i in (0, 1) for n in names)
    assert all(rows[-1][n] == "dequant+cublas" for n in names)
    labels = {"mma", "cuda-register-a", "gluon-producer", "gluon-wgmma", "dequant+cublas", "fused-fragment", "fused"}
    assert {v for r in rows for k, v in r.items() if k != "m"} <= labels
    shape = next(s for s in projection_shapes("qwen2.5-7b") if s.name == "gate_up_proj")
    assert rows[3]["gate_up_proj"] == launch_rule.path_name(
        launch_rule.plan_launch(1024, shape.n, shape.k, 132, gluon=True, producer_aligned=True, ra=True))
