"""Tests for qerl_lib.studies.entropy and qerl_lib.plots.entropy.

A tiny random Llama (2 layers, hidden 64) with the embedded model's tokenizer and chat template
stands in for the real model, so the whole study runs in seconds. The checks are about
machinery whose error would bias the result: the grouped teacher forcing against the plain
reference, packed NVFP4 against fake quantization, AQN at σ = 0 against no noise, and the
verdict sentences against the intervals they are built from.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from qerl_lib.evals.entropy import NO_PAIRS, NO_TOKENS, paired_bootstrap, token_entropies
from qerl_lib.studies.entropy import (StudyConfig, _add_comparisons, _aqn_curve, _score, _set_entropy, direction,
                                    grouped_token_entropies, load_format_model, paper_direction_holds,
                                    reference_completion, run_entropy_study, verdict_lines)
from qerl_lib.errors import UserError
from qerl_lib.io import write_json_atomic


def strict_json(path):
    """Parse a file as standard JSON: NaN / Infinity fail the test."""
    return json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{path.name} holds {c}"))


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory, embedded_model_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    model = AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16)
    with torch.no_grad():  # norm weights around the embedded model's (~0.3), so AQN noise is relative as there
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.2, 0.4)
    folder = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (embedded_model_dir / name).exists():
            shutil.copy(embedded_model_dir / name, folder / name)
    return folder


def test_reference_completion_removes_calculator_annotations():
    problem = {"question": "q", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips.\n48+24 = <<48+24=72>>72\n#### 72"}
    assert reference_completion(problem) == ("<think>\nNatalia sold 48/2 = 24 clips.\n48+24 = 72\n</think>\n"
                                             "<answer>72</answer>")
    with pytest.raises(UserError, match="####"):
        reference_completion({"question": "q", "answer": "72"})


@pytest.mark.parametrize("kwargs, match", [
    ({"formats": ("nvfp4", "bf16")}, "start with 'bf16'"), ({"formats": ("bf16", "int4")}, "unknown formats"),
    ({"sigmas": (-1e-3,)}, "sigmas"), ({"formats": ("bf16", "mxfp4")}, "aqn_format"),
    ({"n_problems": 1}, "n_problems"), ({"temperature": 0}, "temperature"), ({"nvfp4_backend": "x"}, "nvfp4_backend"),
    ({"aqn_references": ("own",)}, "aqn_references"),
], ids=["bf16-first", "unknown-format", "negative-sigma", "aqn-format-missing", "one-problem", "greedy",
        "backend", "aqn-on-own"])
def test_study_config_rejects_bad_values(kwargs, match):
    with pytest.raises(UserError, match=match):
        StudyConfig(**kwargs)


def test_grouped_entropies_equal_the_plain_reference(tiny_model_dir):
    from qerl_lib.models.loader import load_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (7, 12, 3)]
    items = [(i, torch.randint(0, 49152, (c,), generator=gen).tolist())
             for i, c in [(0, 5), (1, 1), (0, 9), (2, 3), (1, 0), (2, 12), (0, 2)]]
    grouped = grouped_token_entropies(model, prompts, items, chunk=2)  # chunk 2: a prompt split over chunks
    plain = token_entropies(model, [prompts[i] for i, _ in items], [c for _, c in items])
    for (i, c), g, p in zip(items, grouped, plain):
        assert g.shape == p.shape == (len(c),)
        # float32, KV cache vs one full forward: only the summation order differs (observed ~1e-5 on the
        # 30-layer embedded model, ~1e-6 here); 1e-4 nats is far below any effect the study reports.
        torch.testing.assert_close(g, p, atol=1e-4, rtol=0)


def test_token_entropies_equal_one_sequence_at_a_time(tiny_model_dir):
    """The batched scorer (right padding, logits only from the shortest prompt on) against the plainest
    reference: each sequence alone, all its logits, the entropy of the rows that predict completion tokens."""
    from qerl_lib.models.loader import load_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    lengths = [(9, 4), (3, 6), (14, 1), (5, 0), (7, 8)]  # (prompt, completion) of different shapes
    prompts = [torch.randint(0, 49152, (p,), generator=gen).tolist() for p, _ in lengths]
    completions = [torch.randint(0, 49152, (c,), generator=gen).tolist() for _, c in lengths]
    batched = token_entropies(model, prompts, completions, batch_size=3, temperature=0.7)
    for p, c, got in zip(prompts, completions, batched):
        assert got.shape == (len(c),)
        if not c:
            continue
        with torch.no_grad():
            logits = model(torch.tensor([p + c])).logits[0].float() / 0.7
        logp = torch.log_softmax(logits[len(p) - 1: len(p) + len(c) - 1], dim=-1)
        torch.testing.assert_close(got, -(logp.exp() * logp).sum(-1), atol=1e-4, rtol=0)


def test_packed_nvfp4_has_the_fake_quantized_weights(tiny_model_dir):
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    fake, report = load_format_model(tiny_model_dir, "nvfp4", "cpu", torch.bfloat16, nvfp4_backend="fake")
    packed, _ = load_format_model(tiny_model_dir, "nvfp4", "cpu", torch.bfloat16, nvfp4_backend="packed")
    layers = {n: m for n, m in packed.named_modules() if isinstance(m, NVFP4Linear)}
    assert len(layers) == len(report) == 14  # 7 projections x 2 layers; lm_head stays bf16
    for name, layer in layers.items():
        assert torch.equal(layer.dequantize(torch.bfloat16), fake.get_submodule(name).weight), name


def test_aqn_at_sigma_zero_is_the_unperturbed_model(tiny_model_dir):
    from qerl_lib.train.aqn import apply_norm_overrides, sample_norm_overrides

    model, _ = load_format_model(tiny_model_dir, "nvfp4", "cpu", torch.float32)
    prompts = [[5, 6, 7, 8], [9, 10]]
    items = [(0, [11, 12, 13]), (1, [14, 15])]
    clean = grouped_token_entropies(model, prompts, items)
    with apply_norm_overrides(model, sample_norm_overrides(model, 0.0, torch.Generator().manual_seed(0))):
        zero = grouped_token_entropies(model, prompts, items)
    with apply_norm_overrides(model, sample_norm_overrides(model, 1e-1, torch.Generator().manual_seed(0))):
        noisy = grouped_token_entropies(model, prompts, items)
    assert all(torch.equal(a, b) for a, b in zip(clean, zero))  # bit-identical: σ = 0 adds exactly nothing
    assert not all(torch.equal(a, b) for a, b in zip(clean, noisy))


def _diff(mean, low, high, n=10):
    return {"mean_diff": mean, "low": low, "high": high, "n": n}


def test_verdicts_follow_the_interval():
    assert direction(_diff(0.2, 0.1, 0.3)) == "higher"
    assert direction(_diff(-0.2, -0.3, -0.1)) == "lower"
    assert direction(_diff(0.1, -0.1, 0.3)) == "inconclusive"
    empty = paired_bootstrap([None, 0.5], [0.4, None])
    assert empty == {"mean_diff": None, "low": None, "high": None, "n": 0, "note": NO_PAIRS}
    assert direction(empty) == "inconclusive"
    diffs = {"entropy_own": _diff(0.2, 0.1, 0.3), "entropy_gold": _diff(0.05, 0.01, 0.09),
             "entropy_bf16_samples": _diff(0.1, -0.1, 0.3)}
    result = {"formats": {"bf16": {}, "nvfp4": {"diff_vs_bf16": diffs}}}
    lines = verdict_lines(result)
    assert lines[0].startswith("NVFP4 raises entropy vs BF16 on its own samples: yes (+0.2000 nats")
    assert "excludes 0" in lines[0] and "not shown" in lines[2] and "includes 0" in lines[2]
    assert paper_direction_holds(result) == "inconclusive"
    diffs["entropy_gold"] = empty
    assert verdict_lines(result)[1].endswith(f"not shown ({NO_PAIRS})")
    assert paper_direction_holds(result) == "inconclusive"
    diffs["entropy_gold"] = _diff(0.05, 0.01, 0.09)
    diffs["entropy_bf16_samples"] = _diff(0.1, 0.05, 0.2)
    assert paper_direction_holds(result) == "yes"
    diffs["entropy_gold"] = _diff(-0.1, -0.2, -0.05)
    assert paper_direction_holds(result) == "no"


def test_study_end_to_end_on_a_tiny_model(tiny_model_dir, tmp_path):
    from qerl_lib.plots.entropy import plot_entropy_study

    config = StudyConfig(model=str(tiny_model_dir), n_problems=3, samples=2, max_new_tokens=6,
                         sigmas=(0.0, 1e-2), aqn_draws=2, greedy_accuracy=True, n_boot=200, progress=False)
    m = run_entropy_study(config)
    assert list(m["formats"]) == ["bf16", "nvfp4", "mxfp4", "nf4"] and m["n_problems"] == 3
    bf16, nvfp4 = m["formats"]["bf16"], m["formats"]["nvfp4"]
    # bf16's own samples ARE the bf16_samples reference: the same tokens, the same numbers.
    assert bf16["entropy_own"] == bf16["entropy_bf16_samples"]
    assert bf16["per_problem_own"] == bf16["per_problem_bf16_samples"]
    for fmt in ("nvfp4", "mxfp4", "nf4"):
        row = m["formats"][fmt]
        assert set(row["diff_vs_bf16"]) == {"entropy_own", "entropy_gold", "entropy_bf16_samples",
                                            "pass@1_sampled", "pass@1_greedy"}
        d = row["diff_vs_bf16"]["entropy_gold"]
        mean = sum(b - a for a, b in zip(bf16["per_problem_gold"], row["per_problem_gold"])) / 3
        assert d["mean_diff"] == pytest.approx(mean) and d["low"] <= d["mean_diff"] <= d["high"]
        assert row["mean_layer_sqnr_db"] > 5  # a real 4-bit round trip, not a copy of the weights
    points = m["aqn"]["points"]
    assert [p["sigma"] for p in points] == [0.0, 1e-2] and points[1]["draws"] == 2
    assert points[0]["entropy_gold"] == nvfp4["entropy_gold"]
    assert len(points[1]["entropy_gold_per_draw"]) == 2
    assert points[1]["entropy_gold"] == pytest.approx(sum(points[1]["entropy_gold_per_draw"]) / 2)
    assert len(m["verdicts"]) == 9 and set(m["paper_direction_holds"]) == {"nvfp4", "mxfp4", "nf4"}

    path = write_json_atomic(tmp_path / "study.json", m)  # refuses NaN / Infinity
    assert strict_json(path)["n_problems"] == 3
    png = plot_entropy_study(path, tmp_path / "study.png")
    assert png.stat().st_size > 10_000
    # a difference with no pairs (null, with its note) is drawn as "n/a", in the bars and on the σ panel
    none = {"mean_diff": None, "low": None, "high": None, "n": 0, "note": NO_PAIRS}
    m["formats"]["mxfp4"]["diff_vs_bf16"]["entropy_gold"] = none
    m["aqn"]["points"][1]["diff_vs_bf16_gold"] = none
    path = write_json_atomic(tmp_path / "study_nulls.json", m)
    assert plot_entropy_study(path, tmp_path / "study_nulls.png").stat().st_size > 10_000


def test_nothing_to_score_is_null_with_a_note_never_nan(tiny_model_dir, tmp_path):
    """Empty completions have no entropy: the study writes null and says why, and the JSON stays valid."""
    from qerl_lib.models.loader import load_model

    model = load_model(tiny_model_dir, dtype=torch.float32)
    prompts = [[5, 6, 7], [8, 9]]
    refs = {"own": [(0, []), (1, [])],  # nothing at all to score
            "gold": [(0, [11, 12]), (1, [])],  # problem 1 has no tokens
            "bf16_samples": [(0, [13]), (0, []), (1, [14, 15])]}  # an empty sample beside a real one
    scored = _score(model, prompts, refs, n=2, chunk=4)
    assert scored["own"] == (None, [None, None])
    gold_mean, gold_per_problem = scored["gold"]
    assert gold_mean is not None and gold_per_problem[0] is not None and gold_per_problem[1] is None
    alone = _score(model, prompts, {"x": [(0, [13]), (1, [14, 15])]}, n=2, chunk=4)["x"]
    assert scored["bf16_samples"] == alone  # the empty sample is skipped, not counted as 0 or NaN

    def row(scores):
        out = {}
        for name, (mean, per_problem) in scores.items():
            _set_entropy(out, f"entropy_{name}", mean)
            out[f"per_problem_{name}"] = per_problem
        return out

    points = _aqn_curve(model, prompts, {"own": refs["own"], "gold": refs["gold"]}, row(scored),
                        StudyConfig(sigmas=(0.0, 0.1), aqn_draws=2, n_boot=50))
    for point in points:  # σ = 0 copies the row, σ > 0 averages the draws that have a value
        assert point["entropy_own"] is None and point["entropy_own_note"] == NO_TOKENS
        assert point["per_problem_own"] == [None, None] and point["per_problem_gold"][1] is None
        assert point["entropy_gold"] is not None and "entropy_gold_note" not in point
    assert points[1]["entropy_own_per_draw"] == [None, None]
    result = {"formats": {"bf16": row(scored), "nvfp4": row(scored)},
              "aqn": {"format": "nvfp4", "references": ["own", "gold"], "points": points}}
    _add_comparisons(result, StudyConfig(n_boot=50))
    assert points[1]["diff_vs_sigma0_own"]["n"] == 0 and points[1]["diff_vs_sigma0_gold"]["n"] == 1
    nvfp4 = result["formats"]["nvfp4"]
    assert nvfp4["diff_vs_bf16"]["entropy_own"] == {"mean_diff": None, "low": None, "high": None, "n": 0,
                                                    "note": NO_PAIRS}
    assert nvfp4["diff_vs_bf16"]["entropy_gold"]["n"] == 1 and nvfp4["diff_vs_bf16"]["entropy_gold"]["mean_diff"] == 0
    assert nvfp4["entropy_own_problem_mean_ci95"] == [None, None]
    assert nvfp4["entropy_own_problem_mean_ci95_note"] == NO_TOKENS
    assert None not in nvfp4["entropy_gold_problem_mean_ci95"]
    result["verdicts"] = verdict_lines(result)
    assert "not shown" in result["verdicts"][0]
    saved = strict_json(write_json_atomic(tmp_path / "m.json", result))
    assert saved["formats"]["nvfp4"]["entropy_own"] is None
    assert saved["formats"]["nvfp4"]["entropy_own_note"] == NO_TOKENS
    assert "entropy_gold_note" not in saved["formats"]["nvfp4"]


def test_plot_rejects_a_json_without_formats(tmp_path):
    from qerl_lib.plots.entropy import plot_entropy_study

    path = tmp_path / "bad.json"
    path.write_text("{}")
    with pytest.raises(ValueError, match="bf16"):
        plot_entropy_study(path, tmp_path / "bad.png")
