"""The warp-specialized NVFP4 GEMM for training sizes (qerl_lib/kernels/fp4_wgmma_ws.py; no launch rule uses it).

Without a GPU: the launch configuration's checks, which problems and tensors the kernel takes, and, where
Triton's Gluon and ptxas are installed, an offline compile for sm_90a of both layouts (no spills, four wgmma per
K-step, the scale bytes read by TMA rather than by the decode warps). On a Hopper GPU the kernel runs, forward
with and without bias and backward, against the plain-torch oracles on fresh random weights.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from qerl_lib.kernels import fp4_wgmma_ws as ws
from qerl_lib.kernels.fp4_wgmma_ws import WsConfig
from qerl_lib.quant.nvfp4 import dequantize, reference_grad_input, reference_matmul
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, cuda_nvfp4_weights, sm90_ptxas

HAS_WS = ws.available()


# ============================================================================ configuration
def test_config_rejects_bad_values_with_a_clear_message():
    with pytest.raises(ValueError, match="stages must be 2..8"):
        WsConfig(stages=1)
    with pytest.raises(ValueError, match="decoded_stages must be 2..4"):
        WsConfig(decoded_stages=1)  # one decoded tile would deadlock: the MMA frees it only after the next
    with pytest.raises(ValueError, match="decode_registers must be a multiple of 8"):
        WsConfig(decode_registers=100)
    with pytest.raises(ValueError, match="max_registers must be a multiple of 8 in 160..168"):
        WsConfig(max_registers=176)  # 12 warps x 176 > 64K registers
    with pytest.raises(ValueError, match="shared memory .* use fewer stages"):
        WsConfig(stages=6)  # 6 x 28 KB of loads + 2 x 32 KB of decoded tiles > 227 KB
    assert WsConfig(5, 2).stages == 5


def test_shared_memory_bytes_counts_loads_scale_boxes_decoded_tiles_and_barriers():
    # per stage: activations 128 x 64 bf16 (16 KB), words 256 x 64 codes (8 KB), scale box 256 x 16 bytes (4 KB),
    # two 8-byte mbarriers; per decoded stage: 256 x 64 bf16 (32 KB) and two mbarriers
    assert ws.shared_memory_bytes(4, 2) == 4 * (16384 + 8192 + 4096 + 16) + 2 * (32768 + 16)
    assert ws.shared_memory_bytes(4, 3) <= ws.SHARED_MEMORY_BYTES < ws.shared_memory_bytes(6, 2)


@pytest.mark.parametrize("n, k, direction, ok", [
    (37888, 3584, "fwd", True), (37888, 3584, "bwd", True), (3584, 18944, "bwd", True),
    (1000, 1024, "fwd", True), (1000, 1024, "bwd", False),  # backward reduces over N: whole steps of 64
    (4608, 3600, "fwd", False), (896, 896, "fwd", False),  # K not a multiple of 256 (scale rows by TMA)
    (0, 256, "fwd", False)])
def test_supported_problem(n, k, direction, ok):
    assert ws.supported_problem(n, k, direction) is ok


def test_supported_problem_names_the_directions():
    with pytest.raises(ValueError, match="direction must be one of"):
        ws.supported_problem(256, 256, "backward")


def test_aligned_wants_16_byte_starts_and_row_strides():
    t = torch.zeros(64, 64, dtype=torch.uint8)
    assert ws.aligned(t, t[16:], t.view(torch.int32))
    assert not ws.aligned(t[:, 1:])  # start 1 byte in
    assert not ws.aligned(torch.zeros(64, 40, dtype=torch.uint8)[:, :16])  # rows 40 bytes apart


# ============================================================================ offline compile (no GPU)
@pytest.mark.skipif(ws.gluon is None or sm90_ptxas() is None,
                    reason="needs Triton's Gluon and its bundled ptxas to compile for sm_90a offline")
@pytest.mark.parametrize("direction", ["fwd", "bwd"])
def test_offline_compile_fits_the_registers_and_reads_scales_by_tma(tmp_path, direction):
    """Both layouts compile for sm_90a within 168 registers without spills; each K-step issues four wgmma
    m64n256k16 and three TMA copies (activations, words, scale box); the only global loads left are the
    epilogue's global scale (the decode warps read nothing from global memory)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    tr = direction == "bwd"
    box = [64, 32] if tr else [256, 8]
    words_layout = ws.WORDS_BWD_SMEM_LAYOUT if tr else ws.WORDS_SMEM_LAYOUT
    names = ["a_desc", "w_desc", "s_desc", "gs_ptr", "bias_ptr", "out_ptr", "M", "N_out", "stride_om", "k_steps",
             "tiles_m", "tiles_n"]
    types = [f"tensordesc<bf16[128, 64],{ws.A_SMEM_LAYOUT!r}>", f"tensordesc<i32[{box[0]}, {box[1]}],{words_layout!r}>",
             f"tensordesc<u8[{box[0]}, 16],{ws.SCALES_SMEM_LAYOUT!r}>", "*fp32", "*bf16", "*bf16"] + ["i32"] * 6
    cfg = WsConfig()
    consts = {"TRANSPOSED": tr, "HAS_BIAS": False, "STAGES": cfg.stages, "DSTAGES": cfg.decoded_stages,
              "DECODE_REGS": cfg.decode_registers}
    signature = {**dict(zip(names, types)), **{c: "constexpr" for c in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in
             ("N_out", "stride_om")}
    src = GluonASTSource(ws._fp4_ws_kernel, signature, consts, attrs)
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": ws.MMA_WARPS, "maxnreg": cfg.max_registers}).asm["ptx"]
    assert len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n256k16", ptx)) == 4
    # three copies per stage: the STAGES of the prologue and the one refill in the loop
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 3 * (cfg.stages + 1)
    assert len(re.findall(r"ld\.global", ptx)) == 1  # 1/gs in the epilogue
    (tmp_path / "k.ptx").write_text(ptx)
    res = subprocess.run([sm90_ptxas(), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    log = res.stderr + res.stdout
    assert " 0 bytes spill stores" in log
    assert int(re.search(r"Used (\d+) registers", log).group(1)) <= cfg.max_registers


# ============================================================================ CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WS, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k", [(1, 256, 256), (77, 320, 512), (129, 1000, 1024), (300, 4608, 3584),
                                     (257, 3584, 18944)])
@pytest.mark.parametrize("cfg", [WsConfig(), WsConfig(2, 2), WsConfig(4, 3, 64), WsConfig(5, 2)],
                         ids=lambda c: f"st{c.stages}d{c.decoded_stages}r{c.decode_registers}")
def test_cuda_kernel_matches_the_oracles(m, n, k, cfg):
    """Forward (with and without bias) against ``reference_matmul`` and backward against
    ``reference_grad_input`` at mean relative error < 1e-3 and elementwise within the bf16 rounding of an fp32 sum
    in another order (``conftest.bf16_gemm_bound``), every output written (NaN-poisoned), the same bits twice."""
    q, w, g = cuda_nvfp4_weights(n, k, seed=m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    no_bias = reference_matmul(x, q)
    w32 = dequantize(q, torch.float32)  # [N, K]
    # elementwise: bf16 output rounding of a float32-accumulated sum in another order (conftest.bf16_gemm_bound):
    # forward x @ W.T (K terms; one rounding before the bias, one after), backward dy @ W (N terms)
    with_bias = reference_matmul(x, q, bias)
    cases = [("fwd", x, None, no_bias, bf16_gemm_bound(no_bias, x, w32.t())),
             ("fwd", x, bias, with_bias, bf16_gemm_bound(with_bias, x, w32.t(), no_bias))]
    if ws.supported_problem(n, k, "bwd"):
        ref_bwd = reference_grad_input(dy, q)
        cases.append(("bwd", dy, None, ref_bwd, bf16_gemm_bound(ref_bwd, dy, w32)))
    for direction, a, b, ref, bound in cases:
        outs = []
        for _ in range(2):
            out = torch.full(ref.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
            ws.launch(a, w.words, w.scales, w.global_scale, b, out, direction, cfg)
            outs.append(out)
        torch.cuda.synchronize()
        assert not torch.isnan(outs[0]).any(), direction
        rel = float((outs[0].float() - ref.float()).abs().mean() / ref.float().abs().mean())
        assert rel < 1e-3, (direction, rel)
        assert_within_bf16_gemm_bound(outs[0], ref, bound, f"{direction} {cfg} m={m} n={n} k={k} bias={b is not None} "
                                                           f"(seed {m + n + k})")
        assert torch.equal(outs[0], outs[1]), direction


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_WS, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
def test_cuda_launch_refuses_what_tma_cannot_read():
    q, w, g = cuda_nvfp4_weights(256, 512, seed=1)
    x = torch.randn(8, 520, device="cuda", generator=g).to(torch.bfloat16)[:, 1:513]  # starts 2 bytes in
    out = torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="must start on 16 bytes"):
        ws.launch(x, w.words, w.scales, w.global_scale, None, out, "fwd")
    with pytest.raises(ValueError, match="takes no bias"):
        ws.launch(torch.zeros(8, 256, dtype=torch.bfloat16, device="cuda"), w.words, w.scales, w.global_scale,
                  torch.zeros(512, dtype=torch.bfloat16, device="cuda"), torch.empty(8, 512, dtype=torch.bfloat16,
                                                                                     device="cuda"), "bwd")
