"""notebooks/04's library: the norm/projection equivalence report, entropy vs σ, NVFP4 dequantization, the figure.

Everything runs on a tiny random Llama (2 layers, hidden 64) in float32: seconds on a CPU. Random
inputs are fresh every run; the seed is printed in failure messages and can be pinned with
QERL_TEST_SEED=<int>.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

from qerl_lib.studies.aqn_noise import (capture_norm_input, dequantize_nvfp4_linears_, entropy_vs_sigma,
                                equivalence_on_layer, verdict)
from qerl_lib.evals.entropy import NO_PAIRS, NO_TOKENS, mean_token_entropy, per_sequence_mean, token_entropies
from qerl_lib.io import write_json_atomic

SEED = int(os.environ.get("QERL_TEST_SEED", random.SystemRandom().randrange(2**31)))


def _tiny_llama(seed: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # norm weights of ones would make (1 + Z/w) trivial; spread them like a trained model's
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight"):
                p.copy_(torch.empty_like(p).uniform_(0.1, 1.5) * torch.where(torch.rand_like(p) < 0.2, -1.0, 1.0))
    return model


@pytest.fixture
def model():
    return _tiny_llama(SEED)


def _batch(seed: int, n: int = 3):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 96, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(n)]
    completions = [torch.randint(0, 96, (int(torch.randint(2, 6, (1,), generator=g)),), generator=g).tolist()
                   for _ in range(n)]
    return prompts, completions


def test_capture_norm_input_of_layer0_is_the_embedding(model):
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(SEED))
    captured = capture_norm_input(model, ids, 0)
    torch.testing.assert_close(captured, model.model.embed_tokens(ids), rtol=0, atol=0, msg=f"seed={SEED}")
    with pytest.raises(ValueError, match="layer_index"):
        capture_norm_input(model, ids, 2)


@pytest.mark.parametrize("layer_index", [0, 1], ids=["layer0", "layer1"])
def test_equivalence_is_rounding_only(model, layer_index):
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(SEED + 1))
    hidden = capture_norm_input(model, ids, layer_index)
    report = equivalence_on_layer(model, hidden, layer_index, sigma=0.05, seed=SEED)
    for proj, row in report["precisions"]["float32"].items():
        # float32 rounding of a 64-term dot product: ~64 * eps32 relative to the output scale, far below 1e-4
        assert row["diff_over_effect"] < 1e-4, (proj, row, f"seed={SEED}")
        assert row["max_abs_noise_effect"] > 0, (proj, f"seed={SEED}")
    for proj, row in report["precisions"]["float64"].items():
        # float64 everywhere: the gap must fall by ~1e9 with the precision; 1e-11 leaves ample margin
        assert row["diff_over_effect"] < 1e-11, (proj, row, f"seed={SEED}")
    # the module's own forward with the override vs (w + Z) ⊙ x̂ by hand: same float32 ops, a few ulp at most
    assert report["module_vs_by_hand_max_abs_diff"] < 1e-5, f"seed={SEED}"
    with pytest.raises(ValueError, match="sigma > 0"):
        equivalence_on_layer(model, hidden, layer_index, sigma=0.0)


def test_entropy_vs_sigma_pairs_against_the_clean_model_and_restores_it(model):
    prompts, completions = _batch(SEED)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    points = entropy_vs_sigma(model, prompts, completions, [0.3, 0.05], seed=SEED, n_boot=200)
    assert [p["sigma"] for p in points] == [0.0, 0.3, 0.05], "σ = 0 is prepended as the baseline"
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), f"{k} not restored (seed={SEED})"
    clean = token_entropies(model, prompts, completions)
    assert points[0]["entropy"] == mean_token_entropy(clean)
    assert points[0]["per_problem"] == per_sequence_mean(clean)
    assert points[0]["diff_vs_sigma0"]["mean_diff"] == 0.0 and points[0]["verdict"] == "no detectable change"
    big = points[1]
    assert big["entropy"] != points[0]["entropy"], f"σ = 0.3 left the entropy unchanged (seed={SEED})"
    # realized RMS of 2 layers x 2 norms x 64 draws of N(0, σ²): relative sd ≈ 1/sqrt(2·256) ≈ 4.4%; 25% is > 5 sd
    assert abs(big["realized_rms"] / 0.3 - 1) < 0.25, (big["realized_rms"], f"seed={SEED}")
    assert big["fraction_changed"] == 1.0
    diffs = [p - q for p, q in zip(big["per_problem"], points[0]["per_problem"])]
    assert big["diff_vs_sigma0"]["mean_diff"] == pytest.approx(sum(diffs) / len(diffs), abs=1e-12)


def test_nothing_to_score_is_null_with_a_note_and_valid_json(model, tmp_path):
    prompts, completions = _batch(SEED)
    completions[1] = []  # one empty completion: skipped in the pairs
    points = entropy_vs_sigma(model, prompts, completions, [0.3], seed=SEED, n_boot=50)
    assert points[1]["per_problem"][1] is None and points[1]["diff_vs_sigma0"]["n"] == 2, f"seed={SEED}"
    empty = entropy_vs_sigma(model, prompts, [[], [], []], [0.3], seed=SEED, n_boot=50)  # nothing at all
    for point in empty:
        assert point["entropy"] is None and point["entropy_note"] == NO_TOKENS
        assert point["per_problem"] == [None, None, None]
        assert point["diff_vs_sigma0"]["note"] == NO_PAIRS and point["verdict"] == "no data"
    hidden = capture_norm_input(model, torch.randint(0, 96, (1, 5), generator=torch.Generator().manual_seed(SEED)), 0)
    report = equivalence_on_layer(model, hidden, 0, sigma=1e-30, seed=SEED)  # noise below float32 resolution of w
    row = report["precisions"]["float32"]["q_proj"]
    assert row["max_abs_noise_effect"] == 0 and row["diff_over_effect"] is None and "diff_over_effect_note" in row
    path = write_json_atomic(tmp_path / "m.json", {"points": points, "empty": empty, "equivalence": report})
    saved = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"JSON holds {c}"))
    assert saved["empty"][0]["entropy"] is None


def test_entropy_vs_sigma_rejects_bad_sigmas(model):
    prompts, completions = _batch(SEED)
    with pytest.raises(ValueError, match="finite number >= 0"):
        entropy_vs_sigma(model, prompts, completions, [-1e-3])


@pytest.mark.parametrize("diff, expected", [
    ({"mean_diff": 0.1, "low": 0.02, "high": 0.2, "n": 8}, "raises"),
    ({"mean_diff": -0.1, "low": -0.2, "high": -0.01, "n": 8}, "lowers"),
    ({"mean_diff": 0.01, "low": -0.02, "high": 0.05, "n": 8}, "no detectable change"),
    ({"mean_diff": None, "low": None, "high": None, "n": 0, "note": "no pairs"}, "no data"),
], ids=["above0", "below0", "straddles0", "empty"])
def test_verdict(diff, expected):
    assert verdict(diff) == expected


def test_dequantized_linears_give_the_packed_models_logits(model):
    from qerl_lib.models.nvfp4_linear import NVFP4Linear
    from qerl_lib.models.loader import replace_linear_with_nvfp4

    replace_linear_with_nvfp4(model, impl="reference")
    ids = torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(SEED + 2))
    with torch.no_grad():
        packed = model(input_ids=ids).logits
        dequantize_nvfp4_linears_(model, torch.float32)
        dense = model(input_ids=ids).logits
    assert not any(isinstance(m, NVFP4Linear) for m in model.modules())
    # same float32 weight values, same F.linear: equal up to summation order, so a few float32 ulp
    torch.testing.assert_close(dense, packed, rtol=1e-5, atol=1e-5, msg=f"seed={SEED}")


def test_plot_entropy_vs_sigma_from_json(tmp_path):
    from qerl_lib.plots.aqn_study import plot_entropy_vs_sigma

    point = lambda s, d: {"sigma": s, "entropy": 1.0 + d,  # noqa: E731
                          "diff_vs_sigma0": {"mean_diff": d, "low": d - 0.01, "high": d + 0.01, "n": 4}}
    metrics = {"entropy": {"points": [point(0.0, 0.0), point(1e-3, 0.02)], "bf16": {"entropy": 0.9},
                           "nvfp4_minus_bf16": {"mean_diff": 0.1, "low": 0.05, "high": 0.15, "n": 4}}}
    path = tmp_path / "m.json"
    path.write_text(json.dumps(metrics))
    out = plot_entropy_vs_sigma(path, tmp_path / "fig.png")
    assert out.stat().st_size > 1000
    path.write_text(json.dumps({"entropy": {}}))
    with pytest.raises(ValueError, match="entropy.points"):
        plot_entropy_vs_sigma(path, tmp_path / "fig2.png")
    # nothing scored at one σ: null entropy and a null difference with its note are drawn as "n/a"
    empty = {"sigma": 2e-3, "entropy": None, "entropy_note": NO_TOKENS,
             "diff_vs_sigma0": {"mean_diff": None, "low": None, "high": None, "n": 0, "note": NO_PAIRS}}
    metrics["entropy"]["points"].append(empty)
    metrics["entropy"]["nvfp4_minus_bf16"] = empty["diff_vs_sigma0"]
    path.write_text(json.dumps(metrics))
    assert plot_entropy_vs_sigma(path, tmp_path / "fig3.png").stat().st_size > 1000
