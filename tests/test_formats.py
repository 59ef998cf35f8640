"""Comparison formats: MXFP4 (OCP), NF4 (bitsandbytes) and in-place fake quantization of a model.

Random inputs are fresh every run; the seed is in every failure message (pin it with
QERL_TEST_SEED=<int>).
"""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

from qerl_lib.quant import formats

from qerl_lib.quant import nvfp4
from qerl_lib.quant.formats import FORMAT_BITS, e8m0_to_float32, fake_quantize_, mxfp4_dequantize, mxfp4_quantize

SEED = int(os.environ.get("QERL_TEST_SEED", random.SystemRandom().randrange(2**31)))
BF16 = torch.bfloat16


def test_mxfp4_roundtrip_exact_on_representable_values():
    # Each 32-block holds every E2M1 value twice (permuted) times 2^e; its absmax 6 * 2^e gives
    # shared exponent floor(log2(6 * 2^e)) - 2 = e, so every element is representable.
    gen = torch.Generator().manual_seed(SEED)
    values = torch.tensor(nvfp4.E2M1_VALUES * 2)
    exps = torch.randint(-30, 30, (6, 5), generator=gen)
    w = torch.stack([torch.cat([values[torch.randperm(32, generator=gen)] * 2.0 ** int(e) for e in row]) for row in exps])
    w = w.to(BF16)
    q = mxfp4_quantize(w)
    assert torch.equal(q.scale_e8m0, (exps + 127).to(torch.uint8)), f"seed={SEED}"
    assert torch.equal(mxfp4_dequantize(q), w), f"seed={SEED}"
    assert q.shape == (6, 160) and q.packed.shape == (6, 80)


def _mx_oracle(block: list[float]) -> tuple[int, list[float]]:
    """Python-float OCP MXFP4 for one block: shared exp and dequantized values (RNE, saturate)."""
    amax = max(abs(v) for v in block)
    exp = -127 if amax == 0 else max(-127, math.frexp(amax)[1] - 1 - 2)
    scale = 2.0**exp
    out = []
    for v in block:
        mag = min(abs(v) / scale, 6.0)
        code = min(range(8), key=lambda c: (abs(nvfp4.E2M1_VALUES[c] - mag), c % 2))
        out.append(math.copysign(nvfp4.E2M1_VALUES[code], v) * scale)
    return exp, out


def test_mxfp4_matches_python_oracle_and_scales_are_powers_of_two():
    gen = torch.Generator().manual_seed(SEED)
    w = (torch.randn(8, 128, generator=gen) * torch.logspace(-6, 2, 8).unsqueeze(1)).to(BF16)
    w[0, :32] = 0.0  # all-zero block -> exponent -127 (byte 0)
    q = mxfp4_quantize(w)
    scales = e8m0_to_float32(q.scale_e8m0)
    mantissa, _ = torch.frexp(scales)
    assert torch.all(mantissa == 0.5), "every E8M0 scale must be an exact power of two"
    assert q.scale_e8m0[0, 0].item() == 0 and scales[0, 0].item() == 2.0**-127
    dense = mxfp4_dequantize(q).float()
    for r in range(w.shape[0]):
        for b in range(w.shape[1] // 32):
            exp, expected = _mx_oracle(w[r, 32 * b : 32 * b + 32].float().tolist())
            assert q.scale_e8m0[r, b].item() == exp + 127, f"seed={SEED} row={r} block={b}"
            assert dense[r, 32 * b : 32 * b + 32].tolist() == expected, f"seed={SEED} row={r} block={b}"


def test_mxfp4_rejects_bad_input_naming_layer():
    with pytest.raises(ValueError, match=r"up_proj.*K = 48 must be a multiple of 32"):
        mxfp4_quantize(torch.randn(4, 48, dtype=BF16), name="up_proj")
    w = torch.randn(4, 64, dtype=BF16)
    w[1, 1] = float("nan")
    with pytest.raises(ValueError, match=r"down_proj.*NaN or Inf"):
        mxfp4_quantize(w, name="down_proj")


def test_sqnr_ordering_on_gaussian():
    # Calibrated on 256x1024 bf16 randn: nvfp4 20.41-20.44 dB, mxfp4 18.79-18.82 dB, nf4
    # 20.71-20.76 dB. NVFP4's finer blocks (16) and non-power-of-two scales must beat MXFP4.
    w = torch.randn(256, 1024, generator=torch.Generator().manual_seed(SEED)).to(BF16)
    nv = nvfp4.sqnr_db(w, nvfp4.dequantize(nvfp4.quantize(w)))
    mx = nvfp4.sqnr_db(w, mxfp4_dequantize(mxfp4_quantize(w)))
    assert nv > mx + 1.0, f"seed={SEED} nvfp4 {nv:.2f} dB vs mxfp4 {mx:.2f} dB"
    assert 19.5 < nv < 23.0 and 17.8 < mx < 21.0, f"seed={SEED} nvfp4 {nv:.2f} mxfp4 {mx:.2f}"


def test_nf4_roundtrip_via_bitsandbytes_on_cpu():
    pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `quant` extra) not installed")
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(SEED)).to(BF16)
    out = formats.nf4_roundtrip(w)
    assert out.shape == w.shape and out.dtype == w.dtype and out.device == w.device
    # A real 4-bit codebook: each block of 64 takes at most 16 distinct values.
    distinct = [len(set(block.tolist())) for block in out.float().reshape(-1, formats.NF4_BLOCK_SIZE)]
    assert max(distinct) <= 16, f"seed={SEED}"
    assert 19.5 < nvfp4.sqnr_db(w, out) < 23.0, f"seed={SEED}"  # calibrated 20.7 dB on randn


def test_format_bits_match_storage():
    w = torch.randn(64, 256, dtype=BF16)
    q = nvfp4.quantize(w)
    assert q.nbytes * 8 / w.numel() == pytest.approx(FORMAT_BITS["nvfp4"], abs=32 / w.numel())
    mx = mxfp4_quantize(w)
    mx_bits = (mx.packed.numel() + mx.scale_e8m0.numel()) * 8 / w.numel()
    assert mx_bits == FORMAT_BITS["mxfp4"]
    assert FORMAT_BITS["nf4"] == 4 + 32 / formats.NF4_BLOCK_SIZE  # fp32 absmax per 64, no double quant


# ----------------------------------------------------------------------------- model round trip
@pytest.fixture(scope="module")
def tiny_llama_state():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
    )
    torch.manual_seed(SEED)
    model = transformers.AutoModelForCausalLM.from_config(config).to(BF16)
    return config, {k: v.clone() for k, v in model.state_dict().items()}


def _fresh_model(tiny_llama_state):
    import transformers

    config, state = tiny_llama_state
    model = transformers.AutoModelForCausalLM.from_config(config).to(BF16)
    model.load_state_dict(state)
    return model


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "nf4"])
def test_fake_quantize_changes_linears_only(tiny_llama_state, fmt):
    if fmt == "nf4":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `quant` extra) not installed")
    _, before = tiny_llama_state
    model = _fresh_model(tiny_llama_state)
    report = fake_quantize_(model, fmt)
    after = model.state_dict()
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head"]
    quantized = {f"{n}.weight" for n in linears}
    assert len(linears) == 14 and [row["layer"] for row in report] == linears  # 2 layers x 7 projections
    for key, value in after.items():
        if key in quantized:
            assert not torch.equal(value, before[key]), f"{fmt}: {key} unchanged"
        else:  # lm_head, embeddings, norms: bit-identical
            assert torch.equal(value.view(torch.int16), before[key].view(torch.int16)), f"{fmt}: {key} changed"
    assert all(10.0 < row["sqnr_db"] < 30.0 for row in report), report


def test_fake_quantize_nvfp4_uses_fused_global_scales(tiny_llama_state):
    model = _fresh_model(tiny_llama_state)
    prefix = "model.layers.1.self_attn"
    with torch.no_grad():  # make k_proj's absmax dominate, so the shared scale differs from q's and v's own
        model.get_submodule(f"{prefix}.k_proj").weight.mul_(4)
    qkv = [model.get_submodule(f"{prefix}.{p}").weight.detach().clone() for p in ("q_proj", "k_proj", "v_proj")]
    shared = nvfp4.global_scale(*qkv)
    assert not torch.equal(nvfp4.global_scale(qkv[0]), shared) and not torch.equal(nvfp4.global_scale(qkv[2]), shared)
    fake_quantize_(model, "nvfp4")
    for proj, w in zip(("q_proj", "k_proj", "v_proj"), qkv):
        expected = nvfp4.dequantize(nvfp4.quantize(w, global_scale=shared))
        assert torch.equal(model.get_submodule(f"{prefix}.{proj}").weight, expected), proj


def test_fake_quantize_bf16_is_identity_and_rejects_unknown(tiny_llama_state):
    _, before = tiny_llama_state
    model = _fresh_model(tiny_llama_state)
    report = fake_quantize_(model, "bf16")
    assert all(row["sqnr_db"] == float("inf") for row in report)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"unknown format 'int3'.*nvfp4"):
        fake_quantize_(model, "int3")
