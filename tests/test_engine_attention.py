"""The split-KV decode-attention kernel (qerl_lib.engine.attention) against its float32 oracle.

* CPU, Triton interpreter (a subprocess, since TRITON_INTERPRET=1 must be set before triton is
  imported): awkward shapes -- odd group sizes (7 and 5 query heads per KV head, as Qwen2.5-7B and
  -32B; 3 as SmolLM2), cache lengths not a multiple of the 64-column block, left padding that
  empties whole slices, a column early in a long cache view, the current column at the first and
  last cache position, 1 to 9 slices.
  Float32 inputs (the interpreter mishandles bf16 dots), tolerance 1e-5 absolute on outputs of
  magnitude ~1: only the summation order differs from the oracle.
  ``rope_and_cache`` against the engine's torch RoPE and ``index_copy_``. Also the engine end to end
  with ``decode_attention="kernel"`` (both kernels): same greedy tokens as SDPA.
* CPU: bad shapes are refused with a message; the slice count rule.
* CUDA: bf16 inputs vs the float32 oracle within bf16 rounding (2^-7 relative + 1e-2 absolute).
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from qerl_lib.engine.attention import (DEFAULT_LAUNCH, MANY_PAIRS_LAUNCH, AttentionLaunch, decode_attention, merge_width,
                                       num_splits, pick_launch, reference_decode_attention)
from tests.conftest import requires_triton, run_triton_interpreter

INTERP_TOL = 1e-5

# (B, H, KV, L, D, column, max pad, splits or None for the rule)
CASES = [
    (3, 7, 1, 100, 16, 57, 20, None),
    (2, 14, 2, 130, 32, 129, 100, 3),   # heavy padding: the first slices are empty for some rows
    (4, 9, 3, 64, 64, 0, 0, 1),         # first column only
    (2, 10, 2, 200, 16, 199, 5, 9),     # 5 heads per KV head, more slices than needed
    (1, 4, 4, 70, 128, 69, 1, 2),       # no grouping, head_dim 128
    (2, 7, 1, 512, 16, 130, 70, 4),     # a column early in a long bucket: slices cut from [pad, column]
]

INTERP_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.engine.attention import decode_attention, reference_decode_attention
    out = {}
    for i, (b, h, kv, length, d, col, max_pad, splits) in enumerate(json.loads(sys.argv[1])):
        g = torch.Generator().manual_seed(i)
        q, k, v = (torch.randn(*s, generator=g) for s in ((b, h, d), (b, kv, length, d), (b, kv, length, d)))
        pad = torch.randint(0, max_pad + 1, (b,), generator=g).clamp(max=col)
        got = decode_attention(q, k, v, pad, torch.tensor([col]), 0.125, splits=splits)
        ref = reference_decode_attention(q, k, v, pad, col, 0.125)
        out[i] = float((got - ref).abs().max())
    # RoPE + cache write vs the engine's torch RoPE and index_copy_ (q/k/v as views of one fused output)
    from qerl_lib.engine.attention import rope_and_cache
    from qerl_lib.engine.reference_ops import apply_rope
    g = torch.Generator().manual_seed(99)
    b, h, kv, d, length, col = 3, 14, 2, 32, 40, 23
    fused = torch.randn(b, 1, (h + 2 * kv) * d, generator=g)
    q = fused[..., :h * d].view(b, 1, h, d).transpose(1, 2)
    k = fused[..., h * d:(h + kv) * d].view(b, 1, kv, d).transpose(1, 2)
    v = fused[..., (h + kv) * d:].view(b, 1, kv, d).transpose(1, 2)
    cos, sin = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    kc, vc = torch.zeros(b, kv, length, d), torch.zeros(b, kv, length, d)
    q_rot = rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([col]))
    kr = apply_rope(k, cos, sin)[:, :, 0]
    out["rope_q"] = float((q_rot - apply_rope(q, cos, sin)[:, :, 0]).abs().max())
    out["rope_k"] = float((kc[:, :, col] - kr).abs().max())
    out["rope_v_exact"] = bool(torch.equal(vc[:, :, col], v[:, :, 0]))
    kc[:, :, col] = 0
    vc[:, :, col] = 0
    out["rope_other_columns_untouched"] = bool(kc.abs().sum() == 0 and vc.abs().sum() == 0)
    # RoPE + cache write + attention in one kernel vs the two calls: same output and cache bits
    from qerl_lib.engine.attention import decode_attention, rope_cache_attention
    g = torch.Generator().manual_seed(7)
    b, h, kv, d, length, col = 3, 14, 2, 32, 150, 97
    fused = torch.randn(b, 1, (h + 2 * kv) * d, generator=g)
    q = fused[..., :h * d].view(b, 1, h, d).transpose(1, 2)
    k = fused[..., h * d:(h + kv) * d].view(b, 1, kv, d).transpose(1, 2)
    v = fused[..., (h + kv) * d:].view(b, 1, kv, d).transpose(1, 2)
    cos, sin = torch.randn(b, 1, d, generator=g), torch.randn(b, 1, d, generator=g)
    pad = torch.tensor([0, 5, 40])
    kc1, vc1 = torch.randn(b, kv, length, d, generator=g), torch.randn(b, kv, length, d, generator=g)
    kc2, vc2 = kc1.clone(), vc1.clone()
    column = torch.tensor([col])
    two = decode_attention(rope_and_cache(q, k, v, cos, sin, kc1, vc1, column), kc1[:, :, :col + 30],
                           vc1[:, :, :col + 30], pad, column, 0.2, splits=3)
    one_launch = []
    for splits in (1, 3):
        kc2.copy_(kc1), vc2.copy_(vc1)
        kc2[:, :, col], vc2[:, :, col] = 9.0, 9.0  # stale values the kernel must overwrite, not read
        got = rope_cache_attention(q, k, v, cos, sin, kc2[:, :, :col + 30], vc2[:, :, :col + 30], pad, column, 0.2,
                                   splits=splits)
        one_launch.append(float((got - two).abs().max()))
        out[f"fused_cache_equal_{splits}"] = bool(torch.equal(kc2, kc1) and torch.equal(vc2, vc1))
    out["fused_vs_two_calls"] = max(one_launch)
    # another launch shape (explicit argument): the same attention, other block and slice sizes
    from qerl_lib.engine.attention import AttentionLaunch
    other = decode_attention(rope_and_cache(q, k, v, cos, sin, kc1, vc1, column), kc1[:, :, :col + 30],
                             vc1[:, :, :col + 30], pad, column, 0.2, launch=AttentionLaunch(block=32, programs=12))
    out["other_launch_shape"] = float((other - two).abs().max())
    # the relabeled second output (the FP4 GEMM's K relabeling): permute_x of the output, bit for bit; D = 32
    # puts four heads in one 128-column block, so stores cross heads
    from qerl_lib.kernels.fp4_wgmma import permute_x
    g = torch.Generator().manual_seed(8)
    b, h, kv, d, length, col = 2, 8, 2, 32, 150, 97
    q, k, v = torch.randn(b, h, d, generator=g), torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
    relabeled = []
    for h, kv, d in ((8, 2, 32), (7, 1, 128)):  # D = 128: each head one block, permuted in registers
        q, k, v = torch.randn(b, h, d, generator=g), torch.randn(b, kv, length, d), torch.randn(b, kv, length, d)
        for splits in (1, 3):
            o_r = torch.full((b, h * d), float("nan"))
            o = decode_attention(q, k, v, torch.tensor([0, 9]), torch.tensor([col]), 0.2, splits=splits,
                                 out_relabeled=o_r)
            relabeled.append(bool(torch.equal(o_r, permute_x(o.reshape(b, h * d)))))
    out["relabeled_equal"] = relabeled
    # the engine with the kernel vs the engine with SDPA, float32 tiny Qwen2 model
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_engine import PROMPTS, tiny_model
    model = tiny_model("qwen2")
    a = RolloutEngine(model, decode_attention="kernel").generate(PROMPTS, 6, temperature=0, stop_token_ids=[])
    b = RolloutEngine(model, decode_attention="sdpa").generate(PROMPTS, 6, temperature=0, stop_token_ids=[])
    out["engine_tokens_equal"] = [c.token_ids for c in a] == [c.token_ids for c in b]
    out["engine_logprob_diff"] = max(abs(x - y) for c, e in zip(a, b) for x, y in zip(c.logprobs, e.logprobs))
    print("RESULTS " + json.dumps(out))
""")


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(INTERP_SCRIPT, CASES, timeout=600)


def test_interpreted_kernel_writes_the_relabeled_copy_bit_for_bit(interpreted):
    # D = 32 (scattered stores) and D = 128 (whole blocks), one slice (the kernel stores) and three (the merge does)
    assert interpreted["relabeled_equal"] == [True, True, True, True]


def test_relabeled_output_of_the_wrong_shape_is_refused():
    q, k = torch.zeros(2, 8, 32), torch.zeros(2, 2, 64, 32)
    with pytest.raises(ValueError, match="out_relabeled must be a contiguous \\[2, 256\\]"):
        decode_attention(q, k, k, torch.zeros(2, dtype=torch.long), torch.tensor([3]), 0.2,
                         out_relabeled=torch.zeros(2, 255))


@pytest.mark.parametrize("i", range(len(CASES)), ids=lambda i: "B{}_H{}_KV{}_L{}_D{}_col{}_pad{}_splits{}".format(*CASES[i]))
def test_interpreted_kernel_matches_the_oracle(interpreted, i):
    assert interpreted[str(i)] <= INTERP_TOL


def test_interpreted_rope_and_cache_write(interpreted):
    # float32 both ways, same operations: equal up to fused multiply-add rounding
    assert interpreted["rope_q"] <= 1e-6 and interpreted["rope_k"] <= 1e-6
    assert interpreted["rope_v_exact"] and interpreted["rope_other_columns_untouched"]


def test_interpreted_rope_cache_attention_equals_the_two_calls(interpreted):
    # one slice and three: the slice holding the column rotates, writes and uses the new key/value
    assert interpreted["fused_cache_equal_1"] and interpreted["fused_cache_equal_3"]
    assert interpreted["fused_vs_two_calls"] <= 1e-6
    assert interpreted["other_launch_shape"] <= 1e-5  # float32 sums split and grouped differently


def test_engine_with_the_kernel_matches_sdpa(interpreted):
    assert interpreted["engine_tokens_equal"]
    assert interpreted["engine_logprob_diff"] <= 1e-4


def test_reference_masks_padding_and_future_columns():
    torch.manual_seed(0)
    q, k, v = torch.randn(2, 4, 16), torch.randn(2, 2, 10, 16), torch.randn(2, 2, 10, 16)
    pad = torch.tensor([0, 3])
    out = reference_decode_attention(q, k, v, pad, 5, 0.25)
    k2, v2 = k.clone(), v.clone()
    k2[1, :, :3], v2[1, :, :3] = 99.0, 99.0  # padding of row 1
    k2[:, :, 6:], v2[:, :, 6:] = -99.0, -99.0  # columns after the current one
    assert torch.allclose(out, reference_decode_attention(q, k2, v2, pad, 5, 0.25))


def test_slice_rule():
    assert num_splits(8, 4, 2304) == 17  # 32 (row, KV head) pairs -> ~528 programs
    assert num_splits(64, 3, 2304) == 3
    assert num_splits(8, 4, 10) == 1  # never more slices than 64-column blocks
    assert num_splits(512, 8, 4096) == 1


def test_merge_width_covers_every_length_of_a_batch():
    """The merge's tile (a compile-time constant) must not follow the cache length: at Qwen2.5-7B's batch 8 every
    slice count a length bucket can give (2-17) shares one width, so a longer bucket compiles no second merge."""
    programs = DEFAULT_LAUNCH.programs
    widths = {merge_width(num_splits(8, 4, length), 8, 4, programs) for length in range(128, 4097, 64)}
    assert widths == {32}
    assert merge_width(3, 16, 4, programs) == 16  # 64 pairs: at most 9 slices
    assert merge_width(100, 1, 4, programs) == 128  # a few rows, a long cache: past the cap the width follows
    assert merge_width(9, 2, 2, programs) >= 9


@requires_triton
def test_merge_split_count_is_a_plain_argument():
    """The CPU half of the CUDA test below: the slice count is neither a constant nor specialized on."""
    from qerl_lib.engine import attention

    assert attention.triton is not None, "triton is installed but qerl_lib.engine.attention did not import it"
    kernel = attention._merge_splits_kernel
    assert [p.name for p in kernel.params if p.do_not_specialize] == ["SPLITS"]
    assert not next(p for p in kernel.params if p.name == "SPLITS").is_constexpr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_a_longer_bucket_compiles_no_new_merge():
    """Batch 8 at Qwen2.5-7B's heads over cache lengths of 256-1280 columns (4, 8, 12, 16, 17 slices): one merge kernel
    compiled in all (a new one mid-rollout cost ~0.13 s, dev/LOG.md 120), outputs within bf16 rounding of the oracle."""
    from qerl_lib.engine import attention

    b, h, kv, d = 8, 28, 4, 128
    g = torch.Generator(device="cuda").manual_seed(1)
    cache = attention._merge_splits_kernel.device_caches[torch.cuda.current_device()][0]
    sizes = []
    for length in (256, 512, 768, 1024, 1280):
        q, k, v = (torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
                   for s in ((b, h, d), (b, kv, length, d), (b, kv, length, d)))
        pad = torch.randint(0, 40, (b,), generator=g, device="cuda")
        col = length - 3
        out = decode_attention(q, k, v, pad, torch.tensor([col], device="cuda"), d ** -0.5)
        torch.cuda.synchronize()
        sizes.append(len(cache))
        ref = reference_decode_attention(q, k, v, pad, col, d ** -0.5)
        torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=1e-2)
    assert sizes[1:] == sizes[:1] * 4, sizes


def test_launch_rule_by_row_kv_pairs():
    assert pick_launch(8, 4) is DEFAULT_LAUNCH  # Qwen2.5-7B at batch 8: 32 pairs
    assert pick_launch(31, 4) is DEFAULT_LAUNCH
    assert pick_launch(32, 4) is MANY_PAIRS_LAUNCH  # 128 pairs
    assert pick_launch(16, 8) is MANY_PAIRS_LAUNCH  # 8 KV heads (14B, 32B)
    assert MANY_PAIRS_LAUNCH != DEFAULT_LAUNCH
    assert num_splits(64, 4, 2048, MANY_PAIRS_LAUNCH.block, MANY_PAIRS_LAUNCH.programs) == 1
    assert num_splits(32, 4, 2048, MANY_PAIRS_LAUNCH.block, MANY_PAIRS_LAUNCH.programs) == 2


@pytest.mark.parametrize("bad", [dict(block=48), dict(block=8), dict(warps=3), dict(stages=0), dict(programs=0)])
def test_bad_launch_shapes_are_refused(bad):
    with pytest.raises(ValueError, match="AttentionLaunch"):
        AttentionLaunch(**bad)


@pytest.mark.parametrize("shapes", [((2, 7, 16), (2, 2, 10, 16)), ((2, 8, 24), (2, 2, 10, 24)), ((2, 8, 16), (3, 2, 10, 16))],
                         ids=["heads_not_multiple", "head_dim_not_pow2", "batch_mismatch"])
def test_bad_shapes_are_refused(shapes):
    qs, ks = shapes
    with pytest.raises(ValueError, match="decode_attention"):
        decode_attention(torch.randn(*qs), torch.randn(*ks), torch.randn(*ks), torch.zeros(qs[0], dtype=torch.long),
                         torch.tensor([3]), 0.1)


def _cuda_new_token(g, b, h, kv, d):
    """A decode step's new q, k, v (bf16 views of one fused q/k/v output, as the engine has them)
    and the RoPE cos/sin of random angles."""
    fused = torch.randn(b, 1, (h + 2 * kv) * d, generator=g, device="cuda").to(torch.bfloat16)
    q = fused[..., :h * d].view(b, 1, h, d).transpose(1, 2)
    k = fused[..., h * d:(h + kv) * d].view(b, 1, kv, d).transpose(1, 2)
    v = fused[..., (h + kv) * d:].view(b, 1, kv, d).transpose(1, 2)
    angle = torch.rand(b, 1, d, generator=g, device="cuda") * 6.3
    return q, k, v, angle.cos().to(torch.bfloat16), angle.sin().to(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_rope_and_cache_matches_torch():
    from qerl_lib.engine.attention import rope_and_cache
    from qerl_lib.engine.reference_ops import apply_rope

    g = torch.Generator(device="cuda").manual_seed(0)
    b, h, kv, d, length, col = 8, 28, 4, 128, 300, 257
    q, k, v, cos, sin = _cuda_new_token(g, b, h, kv, d)
    kc = torch.zeros(b, kv, length, d, dtype=torch.bfloat16, device="cuda")
    vc = torch.zeros_like(kc)
    q_rot = rope_and_cache(q, k, v, cos, sin, kc, vc, torch.tensor([col], device="cuda"))
    exact = lambda t: apply_rope(t.float(), cos.float(), sin.float())[:, :, 0]  # noqa: E731
    torch.testing.assert_close(q_rot.float(), exact(q), rtol=2.0**-8, atol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(kc[:, :, col].float(), exact(k), rtol=2.0**-8, atol=1e-2)
    assert torch.equal(vc[:, :, col], v[:, :, 0])


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("b,h,kv,length,d,col", [(8, 28, 4, 2304, 128, 1500), (8, 40, 8, 512, 128, 300),
                                                 (64, 9, 3, 768, 64, 700), (3, 7, 1, 100, 128, 0),
                                                 (32, 28, 4, 1280, 128, 1100)])  # many pairs: 2 slices
def test_cuda_bf16_matches_the_oracle(b, h, kv, length, d, col):
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(*s, generator=g, device="cuda").to(torch.bfloat16)
               for s in ((b, h, d), (b, kv, length, d), (b, kv, length, d)))
    pad = torch.randint(0, max(1, col // 2), (b,), generator=g, device="cuda").clamp(max=col)
    out = torch.full((b, h, d), float("nan"), dtype=torch.bfloat16, device="cuda")
    decode_attention(q, k, v, pad, torch.tensor([col], device="cuda"), d ** -0.5, out=out)
    ref = reference_decode_attention(q, k, v, pad, col, d ** -0.5)
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref, rtol=2.0**-7, atol=1e-2)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
@pytest.mark.parametrize("b", [8, 32])  # the few-rows and the many-pairs launch shape
def test_cuda_rope_cache_attention_equals_the_two_calls(b):
    from qerl_lib.engine.attention import rope_and_cache, rope_cache_attention

    g = torch.Generator(device="cuda").manual_seed(3)
    h, kv, d, length, col = 28, 4, 128, 1536, 1300
    q, k, v, cos, sin = _cuda_new_token(g, b, h, kv, d)
    kc1 = torch.randn(b, kv, length, d, generator=g, device="cuda").to(torch.bfloat16)
    vc1 = torch.randn_like(kc1)
    kc2, vc2 = kc1.clone(), vc1.clone()
    pad, column = torch.randint(0, 200, (b,), generator=g, device="cuda"), torch.tensor([col], device="cuda")
    two = decode_attention(rope_and_cache(q, k, v, cos, sin, kc1, vc1, column), kc1, vc1, pad, column, d ** -0.5)
    one = rope_cache_attention(q, k, v, cos, sin, kc2, vc2, pad, column, d ** -0.5)
    # same formulas; the compiler may contract multiply-adds differently in the two kernels, so the
    # rotated key and the output may differ by one bf16 rounding step (in practice they are equal)
    assert torch.equal(vc1, vc2)
    others = torch.ones(length, dtype=torch.bool, device="cuda")
    others[col] = False
    assert torch.equal(kc1[:, :, others], kc2[:, :, others])
    torch.testing.assert_close(kc2[:, :, col].float(), kc1[:, :, col].float(), rtol=2.0**-7, atol=1e-3)
    torch.testing.assert_close(one.float(), two.float(), rtol=2.0**-7, atol=1e-3)
