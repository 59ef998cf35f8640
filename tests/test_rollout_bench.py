"""`qerl bench rollout` pieces that run on a CPU: the NF4 (QLoRA) base it times, and the summary's
NVFP4/NF4 ratio (speed targets live in the benchmark's JSON, not here)."""

from __future__ import annotations

import pytest
import torch

from qerl_lib.bench.rollout import Row, RolloutBenchConfig, _nf4, random_lora, time_engine
from qerl_lib.bench.rollout_report import summarize

pytest.importorskip("bitsandbytes", reason="the NF4 base is bitsandbytes' (requirements.txt installs it)")


def test_nf4_bench_model_is_qloras_base_and_the_engine_times_it_with_lora():
    """Every Linear but lm_head becomes a bitsandbytes NF4 layer (as QLoRA loads a model); the engine rolls it
    out with a rank-4 adapter and returns every row's tokens; its greedy tokens are the NF4 model's own."""
    import bitsandbytes as bnb

    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import hf_greedy, tiny_model

    model = _nf4(tiny_model("llama", dtype=torch.bfloat16), "nf4", torch.device("cpu"))
    kinds = {name: type(m) for name, m in model.named_modules() if isinstance(m, (torch.nn.Linear, bnb.nn.Linear4bit))}
    assert kinds.pop("lm_head") is torch.nn.Linear
    assert kinds and all(k is bnb.nn.Linear4bit for k in kinds.values()), kinds
    assert _nf4(tiny_model("llama"), "bf16", torch.device("cpu")).model.layers[0].mlp.up_proj.__class__ is torch.nn.Linear

    prompt = [5, 9, 17, 33]
    out = RolloutEngine(model, decode_backend="eager").generate([prompt], 12, temperature=0.0, stop_token_ids=[])
    assert out[0].token_ids == hf_greedy(model, prompt, 12)

    row = time_engine(model, Row("tiny", "nf4", 3, 4, "eager", "qerl", prompt_len=8, gen_len=10), "eager",
                      random_lora(model, 4), repeats=1, seed=3)
    assert row.useful_tokens == 30 and row.tok_s > 0 and row.error is None


def _row(weights, tok_s, rank=16, batch=8):
    return Row("qwen2.5-7b", weights, batch, rank, "graphs+fused", "qerl", 256, 2048, tok_s=tok_s)


def test_summary_reports_nvfp4_over_nf4_against_its_target():
    summary = summarize([_row("nvfp4", 2400.0), _row("nf4", 1200.0), _row("bf16", 1500.0),
                         _row("nf4", 900.0, batch=64), _row("nvfp4", 8000.0, rank=0)])
    assert summary["nvfp4_over_nf4_7b_b8_r16_p256_g2048"] == pytest.approx(2.0)
    assert summary["nvfp4_over_bf16_7b_b8_r16_p256_g2048"] == pytest.approx(1.6)
    assert summary["targets"]["nvfp4_over_nf4_7b_b8_r16"] == {"value": 2.0, "target": 1.5, "met": True}
    assert not any(k.startswith("nvfp4_over_nf4_7b_b64") or "_r0_" in k and "nf4" in k for k in summary)
    assert "nvfp4_over_nf4_7b_b8_r16" not in summarize([_row("nvfp4", 2400.0)])["targets"]


def test_summary_checks_the_lora_targets_of_issue_17():
    rows = [_row("nvfp4", 2600.0, rank=0), _row("nvfp4", 2340.0, rank=16), _row("bf16", 1300.0, rank=0),
            _row("bf16", 1261.0, rank=16), _row("nvfp4", 2300.0, rank=64), _row("bf16", 1200.0, rank=64),
            _row("nvfp4", 6000.0, batch=32), _row("bf16", 4000.0, batch=32),
            Row("qwen2.5-14b", "nvfp4", 8, 32, "graphs+fused", "qerl", 256, 2048, tok_s=1400.0)]
    summary = summarize(rows)
    targets = summary["targets"]
    assert summary["lora_overhead_7b_nvfp4_b8_r16"] == pytest.approx(0.10)
    assert summary["lora_overhead_7b_bf16_b8_r16"] == pytest.approx(0.03)
    assert targets["lora_overhead_7b_b8_r16"] == {"value": 0.1, "target": 0.05, "met": False}  # the worse of the two
    assert targets["lora_overhead_7b_b8_r64"]["met"] is False and targets["lora_overhead_7b_b8_r64"]["value"] == \
        pytest.approx(1 - 2300 / 2600, abs=1e-3)
    assert targets["nvfp4_tok_s_7b_b8_r16"] == {"value": 2340.0, "target": 2600.0, "met": False}
    assert targets["nvfp4_tok_s_14b_b8_r32"]["met"] is True
    assert targets["nvfp4_over_bf16_7b_b32_r16"] == {"value": 1.5, "target": 1.6, "met": False}
    assert "nvfp4_over_bf16_7b_b64_r16" not in targets  # not measured: no verdict
    assert targets["lora_overhead_7b_b8_r16"]["met"] is False
    cheap = summarize([_row("nvfp4", 2600.0, rank=0), _row("nvfp4", 2550.0, rank=16)])["targets"]
    assert cheap["lora_overhead_7b_b8_r16"]["met"] is True  # at most 5%: 1.9% passes


def test_bad_weights_name_the_choices():
    with pytest.raises(ValueError, match="choose from bf16, nvfp4, nf4"):
        RolloutBenchConfig(weights=("int4",))


def test_lora_fold_choice_is_checked_and_maps_to_the_engine_argument():
    from qerl_lib.bench.rollout import LORA_FOLD

    with pytest.raises(ValueError, match="lora_fold must be one of auto, on, off"):
        RolloutBenchConfig(lora_fold="yes")
    assert RolloutBenchConfig().lora_fold == "auto" and LORA_FOLD["auto"] is None  # the engine's own rule
    assert LORA_FOLD["on"] is True and LORA_FOLD["off"] is False


def test_merge_replaces_a_configuration_measured_again_and_keeps_the_rest():
    from dataclasses import asdict

    from qerl_lib.bench.rollout_report import merge_results

    def doc(*rows):
        return {"provenance": {"command": "x"}, "config": {}, "rows": [asdict(r) for r in rows]}

    old = doc(_row("bf16", 1300.0, rank=0), _row("bf16", 1200.0), _row("nvfp4", 2300.0))
    new = doc(_row("bf16", 1290.0, rank=0), _row("bf16", 1220.0))
    merged = merge_results([old, new])
    kept = sorted((r["weights"], r["rank"], r["tok_s"]) for r in merged["rows"])
    assert kept == [("bf16", 0, 1290.0), ("bf16", 16, 1220.0), ("nvfp4", 16, 2300.0)]
    # the overhead comes from the new pair alone, not from the old r0 row (which is faster)
    assert merged["summary"]["lora_overhead_7b_bf16_b8_r16"] == pytest.approx(1 - 1220.0 / 1290.0)
    # rows of one document that share a configuration (e.g. two backends' fastest) all stay
    assert len(merge_results([doc(_row("bf16", 1.0), _row("bf16", 2.0))])["rows"]) == 2


def test_merged_adapter_rows_stay_out_of_the_acceptance_checks_and_are_summarized_beside():
    """``--lora-merge on`` rows (an option that costs a weight copy) never stand in for the default engine's rows
    in the #17 checks; their overhead against the same setting without an adapter is reported on its own key."""
    from dataclasses import replace

    from qerl_lib.bench.rollout_report import merge_results

    plain = [_row("bf16", 1300.0, rank=0), _row("bf16", 1222.0, rank=16), _row("nvfp4", 2600.0, rank=0),
             _row("nvfp4", 2500.0, rank=16)]
    merged = replace(_row("bf16", 1297.4, rank=16), lora_merged=True)
    summary = summarize(plain + [merged])
    assert summary["lora_overhead_7b_bf16_b8_r16"] == pytest.approx(0.06)
    assert summary["targets"]["lora_overhead_7b_b8_r16"]["value"] == pytest.approx(0.06)
    assert summary["lora_overhead_merged_7b_bf16_b8_r16_p256_g2048"] == pytest.approx(0.002)
    assert summary["nvfp4_over_bf16_7b_b8_r16_p256_g2048"] == pytest.approx(2500 / 1222)
    from dataclasses import asdict

    doc = {"provenance": {}, "config": {}, "rows": [asdict(r) for r in plain + [merged]]}
    assert len(merge_results([doc, {**doc, "rows": [asdict(merged)]}])["rows"]) == 5  # its own configuration


def test_lora_merge_choice_is_checked_and_a_merged_row_runs_on_cpu():
    from tests.test_engine import tiny_model

    with pytest.raises(ValueError, match="--lora-merge takes one or more of off, on"):
        RolloutBenchConfig(lora_merge=("yes",))
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    row = Row("tiny", "bf16", 2, 4, "eager", "qerl", prompt_len=8, gen_len=6, lora_merged=True)
    row = time_engine(model, row, "eager", random_lora(model, 4), repeats=1, seed=1)
    assert row.error is None and row.useful_tokens == 12 and row.lora_merged


def test_static_ttft_is_the_first_calls_prefill_not_the_sum_of_every_calls(monkeypatch):
    """A static rollout of more prompts than rows runs one call per batch; its ``ttft_ms`` is the first call's load +
    prefill (as a continuous rollout's is its one call's), not the calls' prefills summed."""
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import tiny_model

    seen, generate = [], RolloutEngine.generate

    def recording(self, *args, **kwargs):
        out = generate(self, *args, **kwargs)
        if kwargs.get("timing"):
            seen.append(self.last_timing.load_s + self.last_timing.prefill_s)
        return out

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    row = Row("tiny", "bf16", 2, 0, "eager", "qerl", prompt_len=8, gen_len=5, prompts=6)
    row = time_engine(model, row, "eager", None, repeats=1, seed=2)
    assert row.error is None and len(seen) == 3
    assert row.ttft_ms == pytest.approx(1e3 * seen[0])
