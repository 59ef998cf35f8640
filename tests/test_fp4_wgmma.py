"""The Gluon NVFP4 GEMM (qerl_lib/kernels/fp4_wgmma.py).

Without a GPU: the launch configuration's checks; the kernel's arithmetic emulated in torch step by
step (the same bit formulas, the same reshapes and permutes of the K relabeling) against the
plain-torch oracle on fresh random weights; and, where Triton's Gluon and ptxas are installed, an
offline compile for sm_90a that must keep the MMAs asynchronous (one wgmma group left in flight, no
ptxas serialization). The layouts themselves are checked by the compiler (``assert_trivial``).
On a Hopper GPU the kernel runs against the oracle.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from qerl_lib.kernels import fp4_wgmma
from qerl_lib.kernels.fp4_wgmma import WgmmaConfig, k_slices
from qerl_lib.quant.nvfp4 import dequantize, quantize, reference_matmul
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, check_gemm_after_norm_in_a_graph, sm90_ptxas

HAS_WGMMA = fp4_wgmma.available()


# ============================================================================ configuration
def test_config_rejects_bad_values_with_a_clear_message():
    with pytest.raises(ValueError, match="block_m must be one of"):
        WgmmaConfig(48)
    with pytest.raises(ValueError, match="warpgroups must be one of"):
        WgmmaConfig(64, warpgroups=3)
    with pytest.raises(ValueError, match="split_k must be >= 1"):
        WgmmaConfig(64, split_k=0)
    with pytest.raises(ValueError, match="stages must be 2..8"):
        WgmmaConfig(64, stages=1)
    with pytest.raises(ValueError, match="max_registers must be None or a multiple of 8"):
        WgmmaConfig(64, max_registers=100)
    with pytest.raises(ValueError, match="shared memory .* use fewer stages"):
        WgmmaConfig(128, 2, stages=6)  # 6 x (32 KB of x + 8 KB of words) > 227 KB
    with pytest.raises(ValueError, match="shared memory .* use fewer stages"):
        WgmmaConfig(256, 2, stages=4)  # 4 x (64 KB of x + 8 KB of words) > 227 KB; 3 stages fit
    assert WgmmaConfig(256, 2, stages=3).block_n == 128
    cfg = WgmmaConfig(32, 2, 4)
    assert (cfg.block_n, cfg.num_warps) == (128, 8)
    assert WgmmaConfig(64, 4, stages=6).num_warps == 16


def test_shared_memory_bytes_counts_x_tiles_words_and_barriers():
    # 64 rows of x: 16 KB per stage; 4 warpgroups: 256 rows x 64 bytes of words; 8 bytes of mbarrier
    assert fp4_wgmma.shared_memory_bytes(64, 4, 6) == 6 * (16384 + 16384 + 8)
    assert fp4_wgmma.shared_memory_bytes(128, 1, 4) == 4 * (32768 + 4096 + 8)


@pytest.mark.parametrize("k, split, expected", [(3584, 1, (28, 1)), (3584, 4, (7, 4)), (3584, 5, (6, 5)),
                                                (18944, 30, (5, 30)), (256, 8, (1, 2)), (384, 2, (2, 2))])
def test_k_slices_cover_every_step_once_and_none_empty(k, split, expected):
    per, slices = k_slices(k, split)
    assert (per, slices) == expected
    steps = k // 128
    assert (slices - 1) * per < steps <= slices * per


def test_supported_problem_needs_whole_k_steps():
    assert fp4_wgmma.supported_problem(3584) and fp4_wgmma.supported_problem(128)
    assert not fp4_wgmma.supported_problem(200) and not fp4_wgmma.supported_problem(0)


@pytest.mark.parametrize("m, n, k, block_m, slots, plan", [
    (64, 37888, 3584, 64, 396, [(0, 25344, 1), (25344, 12544, 2)]),  # 7B gate/up: 592 tiles = 396 + 196 x 2
    (128, 37888, 3584, 128, 264, [(0, 33792, 1), (33792, 4096, 4)]),  # 528 + 64 x 4
    (64, 37888, 3584, 64, 0, [(0, 37888, 1)]),  # balancing off
    (64, 25344, 3584, 64, 396, [(0, 25344, 1)]),  # whole waves already
    (64, 3584, 3584, 64, 396, [(0, 3584, 1)]),  # fewer tiles than slots
    (65, 37888, 3584, 64, 396, [(0, 37888, 1)]),  # two row tiles of x: not balanced
    (64, 37888, 256, 64, 396, [(0, 37888, 1)]),  # 2 K-steps: a slice would be a single step
    (64, 26000, 3584, 64, 396, [(0, 25344, 1), (25344, 656, 14)]),  # 11 tiles left: slices capped at K-steps / 2
])
def test_wave_plan_runs_the_overflowing_tiles_in_k_slices(m, n, k, block_m, slots, plan):
    got = fp4_wgmma.wave_plan(m, n, k, WgmmaConfig(block_m, 1, wave_slots=slots))
    assert got == plan
    assert sum(rows for _, rows, _ in got) == n and all(r0 == sum(r for _, r, _ in got[:i]) for i, (r0, _, _) in
                                                        enumerate(got))
    assert fp4_wgmma.wave_plan(m, n, k, WgmmaConfig(block_m, 1, split_k=2, wave_slots=slots)) == [(0, n, 2)]


def test_linear_writes_each_launch_into_its_columns(monkeypatch):
    """``linear`` on a wave plan, the kernel replaced by a torch stand-in with the same contract (bf16 output
    or fp32 partials per K-slice, rows ``out.stride(0)`` apart): every column written once, bias sliced with
    the weights, the tail's partials summed into its column slice; equal to one unsplit launch's output."""
    n, k, m = 5000, 1024, 3
    q = quantize(torch.randn(n, k).to(torch.bfloat16) * 0.02)
    x = torch.randn(m, k).to(torch.bfloat16)
    w = dequantize(q, dtype=torch.float32)
    words = q.weight_packed.view(torch.int32)
    calls = []

    def fake_launch(xp, wd, sc, gs, b, out, ws, cfg, permuted=False, pdl=None):
        assert pdl is None  # linear's default, passed on: the launch decides
        rows = wd.shape[0]
        r0 = (wd.data_ptr() - words.data_ptr()) // words.stride(0) // 4
        assert permuted and sc.shape[0] == rows and out.shape == (m, rows) and (b is None or b.shape == (rows,))
        calls.append((r0, rows, cfg.split_k))
        per, slices = k_slices(k, cfg.split_k)
        parts = torch.stack([x.float()[:, j * per * 128:(j + 1) * per * 128] @ w[r0:r0 + rows, j * per * 128:
                                                                              (j + 1) * per * 128].T
                             for j in range(slices)])
        if ws is None:
            y = parts.sum(0).to(torch.bfloat16)
            out.copy_(y if b is None else (y.float() + b.float()).to(torch.bfloat16))
        else:
            ws.copy_(parts)

    def fake_reduce(ws, gs, b, out):
        y = ws.sum(0).to(torch.bfloat16)
        out.copy_(y if b is None else (y.float() + b.float()).to(torch.bfloat16))

    monkeypatch.setattr(fp4_wgmma, "launch", fake_launch)
    monkeypatch.setattr(fp4_wgmma, "permute_x", lambda t: t)
    bias = torch.randn(n).to(torch.bfloat16)
    for b in (None, bias):
        calls.clear()
        balanced = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        fp4_wgmma.linear(x, words, q.weight_scale, q.weight_global_scale, b, balanced,
                         WgmmaConfig(64, 1, wave_slots=32), fake_reduce)
        assert calls == [(0, 4096, 1), (4096, 904, 2)] and not torch.isnan(balanced).any()
        whole = torch.empty(m, n, dtype=torch.bfloat16)
        fp4_wgmma.linear(x, words, q.weight_scale, q.weight_global_scale, b, whole, WgmmaConfig(64, 1), fake_reduce)
        torch.testing.assert_close(balanced.float(), whole.float(), rtol=1e-2, atol=1e-3)


# ============================================================================ torch emulation
def _code_pair(q: torch.Tensor, i: int) -> torch.Tensor:
    """``_code_pair`` before the scale multiply, in int64 with 32-bit wrap-around."""
    m32 = 0xFFFFFFFF
    if i == 0:
        p = ((q & 0x000F000F) * ((1 << 12) + (1 << 6))) & m32 & 0x81C081C0
    elif i == 1:
        p = ((q & 0x00F000F0) * ((1 << 8) + (1 << 2))) & m32 & 0x81C081C0
    elif i == 2:
        p = (((q >> 2) & 0x03C003C0) * ((1 << 6) + 1)) & m32 & 0x81C081C0
    else:
        p = (q & 0x80008000) | ((q >> 6) & 0x01C001C0)
    return p


def _bf16_half(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns (int64) -> their bfloat16 values as float64 (subnormals exact)."""
    return (bits.to(torch.int32) << 16).view(torch.float32).double()


def _emulated_weight(words: torch.Tensor, scales: torch.Tensor, step: int) -> torch.Tensor:
    """W' [N, 128] of K-step ``step`` in the kernel's relabeled K order, following ``_decode``: codes I and
    I + 4 of each word, times ``s * 2^118`` (the bf16x2 multiply is exact, so float64 stands in), joined
    [n, word, z, x, y], reshaped [n, t, j, z, x, y], permuted to [n, j, x, y, t, z]."""
    q = words[:, 16 * step:16 * step + 16].to(torch.int64) & 0xFFFFFFFF
    s = scales[:, 8 * step:8 * step + 8].view(torch.float8_e4m3fn).double() * 2.0**118
    s_word = torch.stack([s, s], dim=-1).reshape(-1, 16)  # word w is in group w // 2
    pairs = []
    for i in range(4):
        p = _code_pair(q, i)
        pairs.append(torch.stack([_bf16_half(p & 0xFFFF), _bf16_half(p >> 16)], dim=-1) * s_word[..., None])
    lo = torch.stack([pairs[0], pairs[1]], dim=-1)  # [n, word, z, x], y = 0
    hi = torch.stack([pairs[2], pairs[3]], dim=-1)
    w = torch.stack([lo, hi], dim=-1).reshape(-1, 4, 4, 2, 2, 2)
    return w.permute(0, 2, 4, 5, 1, 3).reshape(-1, 128)


def _emulated_x(x: torch.Tensor, step: int) -> torch.Tensor:
    """K-step ``step`` of ``fp4_wgmma.permute_x(x)``, the copy of x the kernel's TMA reads."""
    return fp4_wgmma.permute_x(x)[:, 128 * step:128 * step + 128].double()


@pytest.mark.parametrize("m, n, k, seed", [(3, 40, 256, 0), (17, 64, 384, 1), (8, 130, 1024, 2)])
def test_emulated_kernel_matches_the_oracle(m, n, k, seed):
    """The decode formulas and both K relabelings (the weights' in the kernel, x's in ``permute_x``) give the
    oracle's product:
    the fp32-exact sum agrees to float64 rounding before the epilogue's single bf16 rounding."""
    g = torch.Generator().manual_seed(seed)
    dense = (torch.randn(n, k, generator=g) * 0.05).to(torch.bfloat16)
    q = quantize(dense)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    words, scales = q.weight_packed.view(torch.int32), q.weight_scale.view(torch.uint8)
    acc = sum(_emulated_x(x, st) @ _emulated_weight(words, scales, st).T for st in range(k // 128))
    factor = torch.tensor(256.0, dtype=torch.float32) / q.weight_global_scale.float()
    out = (acc.float() * factor).to(torch.bfloat16)
    ref = reference_matmul(x, q)
    mismatched = (out != ref).float().mean().item()
    assert mismatched <= 0.01, f"{mismatched:.2%} of outputs differ from the oracle"
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2 * ref.float().abs().max().item())


def test_emulation_notices_a_wrong_relabeling():
    """The check above can fail: the natural-order x against the relabeled weights is far off."""
    g = torch.Generator().manual_seed(3)
    q = quantize((torch.randn(32, 256, generator=g) * 0.05).to(torch.bfloat16))
    x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
    words, scales = q.weight_packed.view(torch.int32), q.weight_scale.view(torch.uint8)
    wrong = sum(x[:, 128 * st:128 * st + 128].double() @ _emulated_weight(words, scales, st).T for st in range(2))
    ref = reference_matmul(x, q).double() * q.weight_global_scale.double() / 256.0
    assert (wrong - ref).abs().mean() > 0.3 * ref.abs().mean()


# ============================================================================ offline compile (no GPU)
@pytest.mark.skipif(fp4_wgmma.gluon is None or sm90_ptxas() is None,
                    reason="needs Triton's Gluon and its bundled ptxas to compile for sm_90a offline")
@pytest.mark.parametrize("block_m, wg, split, stages, pdl", [(64, 2, True, 4, True), (128, 2, False, 4, False),
                                                         (64, 4, False, 6, True), (256, 2, False, 3, True)])
def test_offline_compile_keeps_the_mma_in_flight(tmp_path, block_m, wg, split, stages, pdl):
    """The point of the kernel: one wgmma group stays in flight across the loop (wait_group 1), and ptxas
    does not serialize the MMAs (its C7515 notice), which a change to the loop or epilogue can cause.
    (That the A registers of an MMA in flight are not rewritten is a property of the loop's structure,
    checked on the GPU: the PTX cannot show it.) Under PDL, the first stages' weight copies come before the one
    grid-dependency wait and every x copy after it."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    x_layout, w_layout = fp4_wgmma.X_SMEM_LAYOUT, fp4_wgmma.W_SMEM_LAYOUT
    names = ["x_desc", "w_desc", "s_ptr", "gs_ptr", "bias_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "stride_sn",
             "stride_om", "iters_per_split"]
    types = [f"tensordesc<bf16[{block_m}, 128],{x_layout!r}>", f"tensordesc<i32[{64 * wg}, 16],{w_layout!r}>",
             "*u8", "*fp32", "*bf16", "*bf16", "*fp32"] + ["i32"] * 6
    consts = {"BLOCK_M": block_m, "WG": wg, "SPLIT": split, "HAS_BIAS": not split, "STAGES": stages, "PDL": pdl}
    signature = {**dict(zip(names, types)), **{c: "constexpr" for c in consts}}
    aligned = {"N", "K", "stride_sn", "stride_om"}  # as the runtime marks them
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in aligned}
    src = GluonASTSource(fp4_wgmma._fp4_wgmma_kernel, signature, consts, attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4 * wg})
    ptx = compiled.asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # 8 MMAs of k16 per K-step of 128; three K-steps in the code (the loop unrolled by two, and the tail)
    assert len(re.findall(r"wgmma\.mma_async", ptx)) == 24
    assert ptx.count("griddepcontrol.wait;") == ptx.count("griddepcontrol.launch_dependents;") == int(pdl)
    if pdl:
        assert len(re.findall(r"cp\.async\.bulk\.tensor", ptx[:ptx.index("griddepcontrol.wait;")])) == stages - 1
    (tmp_path / "k.ptx").write_text(ptx)
    res = subprocess.run([sm90_ptxas(), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    assert "C7515" not in res.stderr + res.stdout, res.stderr
    assert int(re.search(r"Used (\d+) registers", res.stderr + res.stdout).group(1)) <= 255


# ============================================================================ CUDA
def _make(m, n, k, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    return q, torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WGMMA, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k", [(1, 200, 256), (33, 3584, 3584), (100, 1000, 18944), (300, 4608, 1024)])
@pytest.mark.parametrize("cfg", [WgmmaConfig(16, 1), WgmmaConfig(32, 2, 3), WgmmaConfig(64, 2, 4), WgmmaConfig(128, 2),
                                 WgmmaConfig(64, 4, 1, 6), WgmmaConfig(32, 4, 2, 3), WgmmaConfig(64, 2, 2, 3, 128),
                                 WgmmaConfig(128, 1, 1, 2), WgmmaConfig(256, 2, 1, 3), WgmmaConfig(256, 1, 3, 2)],
                         ids=lambda c: f"m{c.block_m}wg{c.warpgroups}s{c.split_k}st{c.stages}r{c.max_registers or 0}")
def test_cuda_kernel_matches_the_oracle(m, n, k, cfg):
    """Against ``reference_matmul`` at mean relative error < 1e-3 and elementwise within the bf16 rounding of an
    fp32 sum in another order (``conftest.bf16_gemm_bound``), with and without bias, every output written (NaN-poisoned), deterministic."""
    _check_against_the_oracle(m, n, k, cfg, seed=m + n)


def _check_against_the_oracle(m, n, k, cfg, seed):
    from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights

    q, x = _make(m, n, k, seed=seed)
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    bias = torch.randn(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 1)
                       ).to(torch.bfloat16)
    w_t = dequantize(q, torch.float32).t()
    no_bias = reference_matmul(x, q)
    for b in (None, bias):
        ref = reference_matmul(x, q, b).float()
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        fp4_linear(x, prep, b, out=out, config=cfg)
        assert not torch.isnan(out).any()
        rel = float((out.float() - ref).abs().mean() / ref.abs().mean())
        assert rel < 1e-3, rel
        # elementwise: bf16 output rounding of a float32-accumulated sum in another order (one rounding before
        # the bias, one after): conftest.bf16_gemm_bound
        bound = bf16_gemm_bound(ref, x, w_t, None if b is None else no_bias)
        assert_within_bf16_gemm_bound(out, ref, bound, f"{cfg} m={m} n={n} k={k} bias={b is not None} (seed {seed})")
        assert torch.equal(out, fp4_linear(x, prep, b, config=cfg))


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WGMMA, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m", [1, 40, 64])
def test_cuda_wave_balanced_launches_match_the_oracle(m):
    """``wave_slots`` = 32 on 79 tiles (the last one partial): 64 tiles unsplit, then 15 in 2 K-slices
    writing into a column slice of ``out``; against the oracle as above, with and without bias."""
    n, k = 5000, 1024
    cfg = WgmmaConfig(64, 1, wave_slots=32)
    assert fp4_wgmma.wave_plan(m, n, k, cfg) == [(0, 4096, 1), (4096, 904, 2)]
    _check_against_the_oracle(m, n, k, cfg, seed=m)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WGMMA, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, k, row_pad", [(1, 128, 0), (31, 256, 0), (77, 3584, 0), (300, 18944, 0), (65, 512, 64)])
def test_cuda_permute_kernel_is_the_torch_permute(m, k, row_pad):
    """``permute_x``'s Triton kernel makes the same copy as the torch view it replaces (rows not a multiple of the
    kernel's 32, and rows further apart than K)."""
    x = torch.randn(m, k + row_pad, device="cuda").to(torch.bfloat16)[:, :k]
    expected = x.reshape(m, k // 128, 4, 4, 2, 2, 2).permute(0, 1, 3, 6, 5, 2, 4).reshape(m, k)
    got = fp4_wgmma.permute_x(x)
    assert got.is_contiguous() and torch.equal(got, expected)


def test_permute_off_cuda_is_the_documented_relabeling():
    """Position ``32j + 16x + 8y + 2t + z`` of each 128 columns holds natural column ``32t + 8j + 4z + 2y + x``."""
    x = torch.arange(2 * 256, dtype=torch.float32).reshape(2, 256)
    got = fp4_wgmma.permute_x(x)
    for p in range(128):
        j, xx, y, t, z = p // 32, (p // 16) % 2, (p // 8) % 2, (p // 2) % 4, p % 2
        n = 32 * t + 8 * j + 4 * z + 2 * y + xx
        assert torch.equal(got[:, 128 + p], x[:, 128 + n])


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WGMMA, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
def test_cuda_kernel_refuses_k_not_whole_steps():
    from qerl_lib.kernels.fp4_gemm import fp4_linear, prepare_fp4_weights

    q, x = _make(4, 64, 208, seed=0)
    prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    with pytest.raises(ValueError, match="multiple of 128"):
        fp4_linear(x, prep, config=WgmmaConfig(16, 1))


# ============================================================================ launch rule
def test_rule_picks_the_gluon_kernel_where_it_measured_faster():
    from qerl_lib.kernels.launch_rule import pick_wgmma_config

    gate_up, down, qkv = (37888, 3584), (3584, 18944), (4608, 3584)
    for n, k in (gate_up, down, qkv):  # 65-128 rows: every shape, 128-row tiles, one warpgroup
        for m in (65, 100, 128):
            cfg = pick_wgmma_config(m, n, k)
            assert cfg is not None and (cfg.block_m, cfg.warpgroups) == (128, 1)
    assert pick_wgmma_config(64, *gate_up).block_m == 64  # 33-64 rows: >= 50M weights only
    assert pick_wgmma_config(64, *down).block_m == 64 and pick_wgmma_config(64, *qkv) is None
    assert pick_wgmma_config(32, *gate_up).block_m == 32  # 25-32 rows: >= 100M weights only
    assert pick_wgmma_config(32, *down) is None and pick_wgmma_config(25, 55296, 5120).block_m == 32
    for m in (1, 8, 16, 24, 129, 1024):  # elsewhere the Triton rule (or mma.sync, cuBLAS) runs
        assert pick_wgmma_config(m, *gate_up) is None
    assert pick_wgmma_config(64, *gate_up).stages == 3
    assert pick_wgmma_config(64, *gate_up, num_sms=132).wave_slots == 396  # 3 programs per SM at 64 rows
    assert pick_wgmma_config(128, *gate_up, num_sms=132).wave_slots == 264
    assert pick_wgmma_config(100, 4608, 3600) is None  # K not whole 128-steps
    cfg = pick_wgmma_config(128, *down, num_sms=132)  # ~2 programs per SM: 56 tiles x 5 slices
    assert cfg.split_k == 5 and k_slices(18944, cfg.split_k)[1] == 5


def test_rule_wave_balancing_switches_off_by_environment(monkeypatch):
    from qerl_lib.kernels.launch_rule import WAVE_SPLIT_ENV, pick_wgmma_config

    monkeypatch.setenv(WAVE_SPLIT_ENV, "0")
    assert pick_wgmma_config(64, 37888, 3584).wave_slots == 0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WGMMA, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k, cfg", [(128, 4608, 3584, WgmmaConfig(128, 1, 4, 3, None, 264)),  # q/k/v at 128 rows
                                          (128, 37888, 3584, WgmmaConfig(128, 1, 1, 3, None, 264)),  # gate/up: waves
                                          (100, 3584, 18944, WgmmaConfig(128, 1, 5, 3, None, 264))])
def test_cuda_pdl_launches_after_a_glue_kernel_in_a_graph(m, n, k, cfg):
    """The permute of x and the GEMM, each launched with PDL right after the engine's norm kernel (which lets its
    successor launch at once), then the split-K sum, replayed in a CUDA graph on new inputs: every replay equals
    the GEMM launched without PDL bit for bit, and the oracle on that replay's rows (a kernel that read its input
    before its grid-dependency wait would see the previous replay's)."""
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights, reduce_splits

    q, _ = _make(1, n, k, seed=m + n)
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    check_gemm_after_norm_in_a_graph(
        q, m, lambda h, out, early: fp4_wgmma.linear(h, w.words, w.scales, w.global_scale, None, out, cfg,
                                                     reduce_splits, pdl=early),
        torch.Generator(device="cuda").manual_seed(k))
