"""qerl_lib.studies.quant_formats: the E2M1 table, the global-scale example, one block explained, the SQNR scan, the figures.

The format's test vectors (V1, V2, V5 of docs/nvfp4_format.md) pin the numbers
byte for byte; random weights are fresh every run and the seed is in every failure message
(pin it with QERL_TEST_SEED=<int>).
"""

from __future__ import annotations

import copy
import math
import os
import random

import pytest
import torch

from qerl_lib.quant import formats

from qerl_lib.quant import nvfp4

from qerl_lib.studies import quant_formats as quant_report
from qerl_lib.io import write_json_atomic

SEED = int(os.environ.get("QERL_TEST_SEED", random.SystemRandom().randrange(2**31)))
BF16 = torch.bfloat16

V1 = [0, 0.10009765625, -0.2001953125, 0.30078125, -0.44921875, 0.6015625, 0.75, -0.8984375, 1.046875, -1.203125,
      1.5, 1.796875, -2.09375, 2.40625, -2.703125, 3.0]
V2_BLOCK0 = [6, -5, 4, 3.5, 2.5, 1.75, 1.25, 0.75, 0.25, -0.25, 0.5, -1, 1.5, -2, 3, 0]
V2_BLOCK1 = [0.01, -0.02, 0.03, 0.04, -0.05, 0.06, 0.07, -0.08, 0.09, 0.10, 0.11, -0.12, 0.13, 0.14, 0.15, -0.16]


def _e2m1_oracle(y: float) -> int:
    """Python-float E2M1 code: nearest magnitude, ties to the even code, saturate at 6, sign bit if y < 0."""
    mag = min(abs(y), 6.0)
    code = min(range(8), key=lambda c: (abs(nvfp4.E2M1_VALUES[c] - mag), c % 2))
    return code | (8 if y < 0 else 0)


def _tiny_llama(layers: int = 2):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(SEED)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    return AutoModelForCausalLM.from_config(cfg).to(BF16).eval()


def test_e2m1_table_decodes_bits_like_the_library():
    table = quant_report.e2m1_table()
    assert [r["code"] for r in table] == list(range(16))
    for r, expected in zip(table, nvfp4.E2M1_VALUES):
        assert r["value"] == expected and math.copysign(1, r["value"]) == math.copysign(1, expected), r
        assert r["bits"] == f"{r['code'] >> 3}|{(r['code'] >> 1) & 3:02b}|{r['code'] & 1}"
    assert [r["code"] for r in table if r["subnormal"]] == [1, 9]  # +-0.5 are the only subnormals


def test_global_scale_example_is_spec_vector_v5():
    g = quant_report.global_scale_example()
    assert g["amax"] == 2.5 and g["reciprocal"] == 0.400390625 and g["reciprocal_times_2688"] == 1076.25
    assert g["global_scale"] == 1080.0 and g["single_rounding"] == 1072.0  # spec V5
    assert g["global_scale_fp32_bytes_le"] == "00 00 87 44"
    census = g["single_rounding_agreement"]
    # one rounding agrees with CT's two on ~72.6% of bf16 amax in [1e-4, 1e4] (docs/nvfp4_format.md); deterministic.
    assert census["count"] > 3000 and abs(census["fraction_equal"] - 0.726) < 0.001, census


@pytest.mark.parametrize("vector, block, gs, scale_byte, packed_hex", [
    ([V1], 0, 896.0, 0x7E, "00 19 2a c3 c4 65 6e 7f"),
    ([V2_BLOCK0 + V2_BLOCK1], 0, 448.0, 0x7E, "e7 66 44 22 80 a1 c3 05"),
    ([V2_BLOCK0 + V2_BLOCK1], 1, 448.0, 0x54, "91 32 4c d5 65 e6 76 f7"),
    ([list(quant_report.V5_WEIGHTS)], 0, 1080.0, 0x7E, "57 1b 80 f6 46 0d 92 f6"),
], ids=["V1", "V2-block0-ties", "V2-block1-small", "V5-double-rounding"])
def test_explain_block_reproduces_spec_vectors(vector, block, gs, scale_byte, packed_hex):
    ex = quant_report.explain_block(torch.tensor(vector, dtype=torch.float64).to(BF16), 0, block)
    assert ex["global_scale"] == gs
    assert ex["scale_byte"] == ex["library_scale_byte"] == scale_byte
    assert ex["packed_hex"] == packed_hex


def test_explain_block_v1_dequantizes_as_compressed_tensors():
    ex = quant_report.explain_block(torch.tensor([V1]).to(BF16), 0, 0)
    assert ex["dequantized"] == [0, 0, -0.25, 0.25, -0.5, 0.5, 0.75, -1, 1, -1, 1.5, 2, -2, 2, -3, 3]
    assert ex["effective_scale"] == 0.5 and ex["target"] == 0.5 and ex["scale_product"] == 448.0


@pytest.mark.parametrize("shared_gs", [False, True], ids=["own-global-scale", "fused-group-global-scale"])
def test_explain_block_agrees_with_whole_tensor_quantizer_and_python_oracle(shared_gs):
    gen = torch.Generator().manual_seed(SEED)
    n, k = 24, 96
    # heavy-tailed rows spanning 6 decades, plus an all-zero block and a block small enough for a subnormal scale
    spread = torch.logspace(-3, 1, n).unsqueeze(1) * torch.randn(n, k, generator=gen).exp()
    w = torch.randn(n, k, generator=gen) * spread
    w[3, 16:32] = 0.0
    w[5, 32:48] = 1e-5 * torch.randn(16, generator=gen)
    w = w.to(BF16)
    gs = nvfp4.global_scale(w, 4 * w) if shared_gs else nvfp4.global_scale(w)  # a fused partner with 4x the amax
    q = nvfp4.quantize(w, global_scale=gs)
    full_codes = nvfp4.unpack_fp4(q.weight_packed)
    full_dense = nvfp4.dequantize(q)
    rows, blocks = torch.randint(n, (6,), generator=gen).tolist(), torch.randint(k // 16, (6,), generator=gen).tolist()
    picks = [(3, 1), (5, 2), (0, 0), (n - 1, k // 16 - 1), *zip(rows, blocks)]
    for row, block in picks:
        where = f"seed={SEED} row={row} block={block}"
        ex = quant_report.explain_block(w, row, block, global_scale=gs)
        lo, hi = block * 16, block * 16 + 16
        # the step-by-step scalar path must give the vectorised quantizer's byte
        assert ex["scale_byte"] == int(q.weight_scale[row, block].view(torch.uint8)), where
        assert ex["library_scale_byte"] == ex["scale_byte"], where
        assert ex["codes"] == full_codes[row, lo:hi].tolist(), where
        assert ex["packed"] == q.weight_packed[row, lo // 2:hi // 2].tolist(), where
        assert ex["dequantized"] == full_dense[row, lo:hi].float().tolist(), where
        assert ex["codes"] == [_e2m1_oracle(y) for y in ex["scaled"]], where
        # every dequantized value is one of the block's levels (levels are exact, dequant is rounded to bf16)
        for d in ex["dequantized"]:
            assert min(abs(d - level) for level in ex["levels"]) <= abs(d) * 2**-8, where
        assert len(ex["row_scaled"]) == k and len(ex["levels"]) == 15, where
    assert quant_report.explain_block(w, 3, 1, global_scale=gs)["scale_byte"] == 0x20  # zero block -> 0.125 fallback


def test_explain_block_rejects_bad_indices():
    w = torch.randn(4, 32).to(BF16)
    with pytest.raises(ValueError, match=r"row must be in \[0, 4\) and block in \[0, 2\)"):
        quant_report.explain_block(w, 0, 2)
    with pytest.raises(ValueError, match="K % 16 == 0"):
        quant_report.explain_block(torch.randn(4, 24), 0, 0)


def test_storage_accounting_is_4_5_bits_plus_the_global_scale():
    q = nvfp4.quantize(torch.randn(48, 160).to(BF16))
    acc = quant_report.storage_accounting(q)
    assert acc["bytes"] == {"weight_packed": 48 * 80, "weight_scale": 48 * 10, "weight_global_scale": 4}
    assert acc["bits_per_weight"] == pytest.approx(4.5 + 32 / (48 * 160), rel=1e-12)
    assert acc["total_bytes"] == q.nbytes


def test_sqnr_scan_matches_model_fake_quantization_and_leaves_the_model_alone():
    model = _tiny_llama(layers=2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scan = quant_report.sqnr_scan(model, quant_report.SCAN_FORMATS, layers=2)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()), "sqnr_scan changed the model"
    assert len(scan["rows"]) == 2 * 7 and scan["layers_total"] == 2
    for fmt in scan["formats"]:
        # formats.fake_quantize_ is the independent path: whole model, in place, its own fused-group logic
        reference = {r["layer"]: r["sqnr_db"] for r in formats.fake_quantize_(copy.deepcopy(model), fmt)}
        for row in scan["rows"]:
            assert row["sqnr_db"][fmt] == reference["model." + row["name"]], f"seed={SEED} {fmt} {row['name']}"
        mean = sum(r["sqnr_db"][fmt] for r in scan["rows"]) / len(scan["rows"])
        assert scan["summary"]["mean"][fmt] == pytest.approx(mean, rel=1e-12)
        assert 10 < scan["summary"]["mean"][fmt] < 30, f"seed={SEED}: 4-bit SQNR should be near 20 dB"
    assert list(scan["summary"]["by_projection"]) == ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                      "down_proj"]
    one = quant_report.sqnr_scan(model, ("nvfp4",), layers=1)
    assert {r["layer"] for r in one["rows"]} == {0} and one["summary"]["layers"] == [0]


def test_layer_weight_returns_the_fused_group_global_scale():
    model = _tiny_llama(layers=1)
    attn = model.model.layers[0].self_attn
    weight, gs, name = quant_report.layer_weight(model, 0, "self_attn.k_proj")
    assert torch.equal(weight, attn.k_proj.weight)
    assert torch.equal(gs, nvfp4.global_scale(attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
    assert name == "layers.0.self_attn.k_proj"
    _, gs_o, _ = quant_report.layer_weight(model, 0, "self_attn.o_proj")  # not fused: its own scale
    assert torch.equal(gs_o, nvfp4.global_scale(attn.o_proj.weight))
    with pytest.raises(ValueError, match="choose one of"):
        quant_report.layer_weight(model, 0, "attn.q")
    with pytest.raises(ValueError, match=r"layer_index must be in \[0, 1\)"):
        quant_report.layer_weight(model, 1, "self_attn.q_proj")


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": 0}, "layers_to_scan must be between 1 and 2"),
    ({"layers": 3}, "layers_to_scan must be between 1 and 2"),
    ({"formats_to_scan": ("nvfp4", "int4")}, "non-empty subset"),
], ids=["zero-layers", "too-many-layers", "unknown-format"])
def test_sqnr_scan_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quant_report.sqnr_scan(_tiny_llama(layers=2), **kwargs)


def test_figures_are_drawn_from_the_metrics_json(tmp_path):
    from qerl_lib.plots.quant import plot_e2m1_and_block, plot_sqnr_by_layer

    model = _tiny_llama(layers=2)
    weight, gs, name = quant_report.layer_weight(model, 1, "mlp.down_proj")
    scan = quant_report.sqnr_scan(model, quant_report.SCAN_FORMATS, layers=2)
    scan["gaussian_reference"] = quant_report.gaussian_reference(scan["formats"], shape=(64, 128))
    metrics = {"layer": 1, "projection": "mlp.down_proj", "e2m1": quant_report.e2m1_table(),
               "block": quant_report.explain_block(weight, 2, 3, global_scale=gs), "sqnr": scan}
    path = write_json_atomic(tmp_path / "02_nvfp4_format.metrics.json", metrics)
    for plot, png in ((plot_e2m1_and_block, "02_e2m1_block.png"), (plot_sqnr_by_layer, "02_sqnr_by_layer.png")):
        out = plot(path, tmp_path / png)
        assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    bare = write_json_atomic(tmp_path / "bare.json", {"layer": 0})
    with pytest.raises(ValueError, match="missing"):
        plot_e2m1_and_block(bare, tmp_path / "x.png")
