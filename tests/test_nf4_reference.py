"""NF4 against a plain-torch reference written from its definition (QLoRA, Dettmers et al. 2023, section 3 and
appendix E), on fresh seeded random weights.

The kit's NF4 paths run through bitsandbytes (CPU here): ``quant.formats.nf4_roundtrip`` (the entropy study:
blocksize 64, fp32 absmax, no double quantization) and ``models.nf4.to_nf4`` (QLoRA's base: ``Linear4bit`` with
double quantization). The reference, independent of bitsandbytes:

* the 16 NF4 levels: the paper's published table (appendix E), checked against its construction (normal quantiles
  q_i = Φ^-1(p_i), 8 for p in linspace(0.9677083, 0.5, 9)[:-1], 7 negated for linspace(0.9677083, 0.5, 8)[:-1],
  plus an exact 0, divided by the largest) to 2e-7;
* quantization: the weight flattened row-major into blocks of 64 (the last one zero-padded), each block divided by
  its fp32 absmax and snapped to the nearest level (an all-zero block stays 0); dequantization: level × absmax in
  fp32, then cast to the weight's dtype.

``nf4_roundtrip`` must equal it bit for bit (values, for bf16 / fp16 / fp32, with outliers, a partial last block and
an all-zero block), and ``to_nf4``'s packed codes must be the reference's indices (the double quantization compresses
only the absmax, after the codes are chosen), its dequantized weight level × (its dequantized absmax).
"""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `quant` extra) not installed")

from qerl_lib.quant import formats  # noqa: E402

# QLoRA appendix E (float32)
NF4_LEVELS = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                           -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                           0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                           0.7229568362236023, 1.0], dtype=torch.float32)
BLOCK = 64
SEEDS = [0, 1, 2, 3]


def reference_nf4_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(level index per element [blocks, 64], fp32 absmax per block [blocks, 1]) of ``w`` flattened row-major."""
    flat = w.detach().float().flatten()
    pad = (-flat.numel()) % BLOCK
    blocks = torch.cat([flat, flat.new_zeros(pad)]).reshape(-1, BLOCK)
    absmax = blocks.abs().amax(-1, keepdim=True)
    normed = blocks / torch.where(absmax > 0, absmax, torch.ones_like(absmax))  # an all-zero block stays 0
    index = (normed[..., None] - NF4_LEVELS).abs().argmin(-1)
    return index, absmax


def reference_nf4_roundtrip(w: torch.Tensor) -> torch.Tensor:
    index, absmax = reference_nf4_codes(w)
    values = (NF4_LEVELS[index] * absmax).flatten()[:w.numel()]
    return values.reshape(w.shape).to(w.dtype)


def test_levels_are_the_normal_quantile_construction():
    offset = 0.9677083
    positive = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    negative = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([positive, torch.zeros(1, dtype=torch.float64), negative]).sort().values
    levels = levels / levels.abs().max()
    assert (levels - NF4_LEVELS.double()).abs().max() < 2e-7
    assert NF4_LEVELS[7] == 0 and NF4_LEVELS[0] == -1 and NF4_LEVELS[-1] == 1


def _weight(seed: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 3  # per-row scales
    w.view(-1)[torch.randint(0, w.numel(), (3,), generator=g)] *= 40  # outliers
    if shape[0] > 2:
        w[1] = 0  # all-zero blocks
    return w.to(dtype)


@pytest.mark.parametrize("seed", SEEDS, ids=lambda s: f"seed{s}")
@pytest.mark.parametrize("shape", [(96, 320), (3, 100), (5, 64)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_nf4_roundtrip_is_the_reference_bit_for_bit(seed, shape, dtype):
    w = _weight(seed, shape, dtype)
    got = formats.nf4_roundtrip(w)
    want = reference_nf4_roundtrip(w)
    assert got.dtype == w.dtype and got.shape == w.shape
    bad = got.view(-1) != want.view(-1)
    assert not bool(bad.any()), (f"seed {seed}, {dtype}, {shape}: {int(bad.sum())} of {bad.numel()} elements differ "
                                 f"from NF4's definition, first at flat index {int(bad.nonzero()[0])}")


@pytest.mark.parametrize("seed", SEEDS[:2], ids=lambda s: f"seed{s}")
def test_to_nf4_codes_are_the_reference_and_dequantize_with_its_absmax(seed):
    import bitsandbytes.functional as bnb_functional
    import transformers

    from qerl_lib.models.nf4 import to_nf4

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    dense = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    model = to_nf4(model, torch.device("cpu"), torch.bfloat16)
    checked = 0
    for name, module in model.named_modules():
        if not isinstance(module, bnb.nn.Linear4bit):
            continue
        packed, state = module.weight.data, module.weight.quant_state
        assert state.quant_type == "nf4" and state.blocksize == BLOCK and state.nested, \
            f"{name}: QLoRA's default is NF4, blocks of 64, double quantization"
        codes = torch.stack([(packed.flatten() >> 4) & 15, packed.flatten() & 15], -1).flatten().long()  # high nibble first
        index, _ = reference_nf4_codes(dense[name])
        assert torch.equal(codes, index.flatten()), f"{name} (seed {seed}): NF4 codes differ from the nearest levels"
        absmax = (bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset).float()
        want = (NF4_LEVELS[index] * absmax[:, None]).reshape(dense[name].shape).to(torch.bfloat16)
        assert torch.equal(bnb_functional.dequantize_4bit(packed, state), want), f"{name} (seed {seed})"
        checked += 1
    assert checked == 7 and "lm_head" not in {n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
