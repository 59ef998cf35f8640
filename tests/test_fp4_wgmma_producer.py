"""The register-A NVFP4 GEMM with a producer warp (qerl_lib/kernels/fp4_wgmma_producer.py) and its launch rule.

Without a GPU: the launch configuration's checks, which problems and tensors the kernel takes, where the rule
picks it, and, where Triton's Gluon and ptxas are installed, an offline compile for sm_90a: no spills, and no
ptxas warning that it serialized the wgmmas (C75xx: the kernel's design depends on one wgmma in flight while
the next step decodes, and a too-tight register budget or a wgmma in a worker partition silently loses it). On
a Hopper GPU the kernel runs against the plain-torch oracle and against ``fp4_wgmma`` (the same per-warpgroup
instructions: the same bits), and ``fp4_linear`` is checked to route the rule's problems to it.
"""

from __future__ import annotations

import re
import subprocess

import pytest
import torch

from qerl_lib.kernels import fp4_wgmma_producer as pc
from qerl_lib.kernels.fp4_wgmma_producer import ProducerConfig
from qerl_lib.kernels.launch_rule import PRODUCER_ENV, pick_producer_config, plan_launch, producer_block_m
from qerl_lib.quant.nvfp4 import dequantize, reference_matmul
from tests.conftest import (assert_within_bf16_gemm_bound, bf16_gemm_bound, check_gemm_after_norm_in_a_graph,
                            cuda_nvfp4_weights, sm90_ptxas)

HAS_PC = pc.available()


def _config_id(c: ProducerConfig) -> str:
    return f"m{c.block_m}st{c.stages}r{c.producer_registers}wg{c.warpgroups}p{c.programs_per_sm}"


# ============================================================================ configuration and rule
def test_config_rejects_bad_values_with_a_clear_message():
    with pytest.raises(ValueError, match="block_m must be one of"):
        ProducerConfig(block_m=48)
    with pytest.raises(ValueError, match="warpgroups must be one of"):
        ProducerConfig(64, warpgroups=4)
    with pytest.raises(ValueError, match="programs_per_sm must be 1..4"):
        ProducerConfig(64, programs_per_sm=5)
    with pytest.raises(ValueError, match="split_k must be 1..16"):
        ProducerConfig(64, split_k=0)
    with pytest.raises(ValueError, match="2 program.* use fewer stages, programs or rows of x"):
        ProducerConfig(64, 6, warpgroups=1, programs_per_sm=2)  # 2 x 6 x (16 + 4 + 1) KB > 227 KB
    with pytest.raises(ValueError, match="stages must be 2..8"):
        ProducerConfig(stages=1)
    with pytest.raises(ValueError, match="producer_registers must be a multiple of 8 in 24..56"):
        ProducerConfig(producer_registers=64)  # the consumers' 216 registers: ptxas serializes the wgmmas (C7512)
    with pytest.raises(ValueError, match="shared memory .* use fewer stages"):
        ProducerConfig(256, 4)  # 4 x (64 + 8 + 2) KB > 227 KB
    assert ProducerConfig(128, 5).stages == 5


def test_shared_memory_bytes_counts_x_words_scale_boxes_and_barriers():
    # per stage: x 256 x 128 bf16 (64 KB), words 128 x 16 int32 (8 KB), scale box 128 x 16 bytes (2 KB), 2 mbarriers
    assert pc.shared_memory_bytes(256, 3) == 3 * (65536 + 8192 + 2048 + 16)
    assert pc.shared_memory_bytes(256, 3) <= pc.SHARED_MEMORY_BYTES < pc.shared_memory_bytes(256, 4)
    # one warpgroup: 64 weight rows' words (4 KB) and scale boxes (1 KB)
    assert pc.shared_memory_bytes(64, 5, warpgroups=1) == 5 * (16384 + 4096 + 1024 + 16)


@pytest.mark.parametrize("warpgroups, programs, registers", [(1, 1, None), (1, 2, 128), (1, 3, 80), (2, 2, 80)])
def test_max_registers_fit_the_programs_in_one_register_file(warpgroups, programs, registers):
    cfg = ProducerConfig(64, 2, 24, warpgroups, programs)
    assert cfg.max_registers == registers
    assert cfg.block_n == 64 * warpgroups
    if registers is not None:  # consumers plus the producer's (padded) warpgroup, times the programs: <= 64K
        assert programs * 128 * (warpgroups + 1) * registers <= 65536


@pytest.mark.parametrize("k, split_k, per, slices", [(18944, 4, 38, 4), (3584, 3, 10, 3), (256, 4, 2, 1),
                                                     (27648, 5, 44, 5), (3584, 1, 28, 1), (512, 16, 2, 2)])
def test_k_slices_start_on_even_steps_and_hold_an_even_number_of_them(k, split_k, per, slices):
    assert pc.k_slices(k, split_k) == (per, slices)
    steps = k // 128
    lengths = [min(per, steps - i * per) for i in range(slices)]
    assert sum(lengths) == steps and all(n >= 2 and n % 2 == 0 for n in lengths)


@pytest.mark.parametrize("k, ok", [(3584, True), (18944, True), (256, True), (128, False), (3712, False), (0, False)])
def test_supported_problem_needs_k_in_whole_256s(k, ok):
    assert pc.supported_problem(k) is ok


def test_aligned_wants_16_byte_starts_and_row_strides():
    t = torch.zeros(64, 64, dtype=torch.uint8)
    assert pc.aligned(t, t[16:], t.view(torch.int32))
    assert not pc.aligned(t[:, 1:])
    assert not pc.aligned(torch.zeros(64, 40, dtype=torch.uint8)[:, :16])


@pytest.mark.parametrize("m, n, k, picked", [
    (1024, 37888, 3584, ProducerConfig()), (2048, 55296, 5120, ProducerConfig()),  # gate/up, where it was faster
    (512, 37888, 3584, ProducerConfig()), (768, 27648, 5120, ProducerConfig()), (193, 55296, 5120, ProducerConfig()),
    (384, 37888, 3584, ProducerConfig(128, 4)),  # 256-row tiles would leave half a tile empty
    (256, 3584, 18944, ProducerConfig(128, 4)), (512, 3584, 18944, ProducerConfig(128, 4)),  # long-K down: 128 rows
    (512, 5120, 27648, ProducerConfig()),  # fill the SMs, 256 rows where 128 would not fill them better
    (192, 37888, 3584, None), (2049, 37888, 3584, None), (4096, 37888, 3584, None),  # outside the measured M range
    (1024, 3584, 18944, None), (256, 4608, 3584, None), (256, 3584, 3584, None),  # q/k/v, o; down from 1024 rows
    (1024, 37888, 3712, None),  # K not in whole 256s
    # decode batch sizes (LOG 37): one consumer warpgroup, two programs per SM
    (24, 37888, 3584, ProducerConfig(32, 5, 40, 1, 2)), (32, 55296, 5120, ProducerConfig(32, 5, 40, 1, 2)),
    (33, 4608, 3584, ProducerConfig(64, 5, 40, 1, 2)), (64, 3584, 3584, ProducerConfig(64, 5, 40, 1, 2)),
    (65, 37888, 3584, ProducerConfig(32, 5, 40, 1, 2)), (96, 7168, 5120, ProducerConfig(32, 5, 40, 1, 2)),
    (23, 37888, 3584, None), (97, 37888, 3584, None), (128, 37888, 3584, None),  # outside the measured spans
    (24, 4608, 3584, None), (24, 7168, 5120, None), (32, 8192, 8192, None),  # below 25 rows; a 72B-sized o
    # q/k/v and o at 25-32 rows, x relabeled (LOG 39): three programs per SM, the most of 4 / 2 / 1 K-slices in a wave
    (32, 4608, 3584, ProducerConfig(32, 4, 24, 1, 3, 4)), (25, 3584, 3584, ProducerConfig(32, 4, 24, 1, 3, 4)),
    (32, 7168, 5120, ProducerConfig(32, 4, 24, 1, 3, 2)), (32, 5120, 5120, ProducerConfig(32, 4, 24, 1, 3, 4)),
    # long-K down: K-slices filling one wave of 2 x 132 slots, at most 4 (7B: 56 tiles x 4, 32B: 80 x 3)
    (64, 3584, 18944, ProducerConfig(64, 5, 40, 1, 2, 4)), (48, 5120, 27648, ProducerConfig(64, 5, 40, 1, 2, 3)),
    (24, 3584, 18944, ProducerConfig(32, 5, 40, 1, 2, 4)), (65, 3584, 18944, None), (23, 5120, 27648, None),
    (64, 512, 3584, None), (48, 1024, 5120, None), (80, 1024, 5120, None), (64, 1024, 18944, None)])  # k / v: few tiles
def test_rule_picks_the_kernel_only_where_it_measured_faster(m, n, k, picked):
    assert pick_producer_config(m, n, k) == picked
    planned = plan_launch(m, n, k, gluon=True, producer_aligned=True)
    assert planned == picked if picked is not None else not isinstance(planned, ProducerConfig)
    assert not isinstance(plan_launch(m, n, k, gluon=True, producer_aligned=False), ProducerConfig)
    assert not isinstance(plan_launch(m, n, k, gluon=False, producer_aligned=True), ProducerConfig)


def test_tile_height_weighs_empty_rows_idle_sms_and_128_row_speed():
    assert producer_block_m(4096, 37888) == 256  # both fill the GPU: 256-row tiles are faster per output
    assert producer_block_m(384, 37888) == 128  # 2 x 256 rows for 384: a quarter of the work is padding
    assert producer_block_m(512, 3584) == 128  # 56 programs of 256 rows would leave 76 of 132 SMs idle
    assert producer_block_m(512, 3584, num_sms=56) == 256  # ... unless there are only 56 SMs


def test_narrow_span_can_be_turned_off(monkeypatch):
    from qerl_lib.kernels.launch_rule import PRODUCER_NARROW_ENV

    assert pick_producer_config(32, 4608, 3584) is not None
    monkeypatch.setenv(PRODUCER_NARROW_ENV, "0")
    assert pick_producer_config(32, 4608, 3584) is None
    assert pick_producer_config(32, 37888, 3584) is not None  # gate/up keeps its span


def test_rule_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(PRODUCER_ENV, "0")
    assert pick_producer_config(1024, 37888, 3584) is None
    monkeypatch.setenv(PRODUCER_ENV, "1")
    assert pick_producer_config(1024, 37888, 3584) is not None
    assert pick_producer_config(64, 37888, 3584) is not None
    monkeypatch.setenv(PRODUCER_ENV, "0")
    assert pick_producer_config(64, 37888, 3584) is None


# ============================================================================ offline compile (no GPU)
@pytest.mark.skipif(pc.gluon is None or sm90_ptxas() is None,
                    reason="needs Triton's Gluon and its bundled ptxas to compile for sm_90a offline")
@pytest.mark.parametrize("cfg", [ProducerConfig(256, 3, 40), ProducerConfig(128, 4, 40), ProducerConfig(256, 3, 56),
                                 ProducerConfig(256, 2, 24), ProducerConfig(64, 5, 40, 1, 2),
                                 ProducerConfig(32, 5, 40, 1, 2), ProducerConfig(64, 3, 24, 1, 3)],
                         ids=_config_id)
def test_offline_compile_keeps_one_wgmma_in_flight(tmp_path, cfg):
    """sm_90a, as the launch compiles it: no spills, no C75xx 'wgmma serialized' warning, waits that leave one
    wgmma group in flight, four TMA copies per step in the producer (the x tile's only after the PDL wait), and
    register budgets set per partition."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    names = ["x_desc", "w_desc", "s_desc", "gs_ptr", "bias_ptr", "out_ptr", "ws_ptr", "M", "N", "K", "stride_om",
             "has_bias", "per", "slices", "early"]
    types = [f"tensordesc<bf16[{cfg.block_m}, 128],{pc.X_SMEM_LAYOUT!r}>",
             f"tensordesc<i32[{cfg.block_n}, 16],{pc.W_SMEM_LAYOUT!r}>",
             f"tensordesc<u8[{cfg.block_n}, {pc.SCALE_BOX}],{pc.SCALES_SMEM_LAYOUT!r}>",
             "*fp32", "*bf16", "*bf16", "*fp32"] + ["i32"] * 8
    consts = {"BLOCK_M": cfg.block_m, "STAGES": cfg.stages, "PRODUCER_REGS": cfg.producer_registers,
              "WG": cfg.warpgroups}
    signature = {**dict(zip(names, types)), **{c: "constexpr" for c in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n.endswith("_ptr") or n in
             ("N", "K", "stride_om")}
    src = GluonASTSource(pc._fp4_wgmma_producer_kernel, signature, consts, attrs)
    options = {"num_warps": 4 * cfg.warpgroups, **({"maxnreg": cfg.max_registers} if cfg.max_registers else {})}
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # per step: x in two 64-column halves (the 128-byte swizzle's width), the words, the scale box; and under PDL
    # the first stages' words and scale boxes once more, before the one grid-dependency wait (x only after it)
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", ptx)) == 6
    assert ptx.count("griddepcontrol.wait;") == 1 and ptx.count("griddepcontrol.launch_dependents;") == 1
    before_wait = ptx[:ptx.index("griddepcontrol.wait;")]
    assert len(re.findall(r"cp\.async\.bulk\.tensor\.2d", before_wait)) == 2
    assert re.search(rf"setmaxnreg\.(inc|dec)\.sync\.aligned\.u32\s+{cfg.producer_registers};", ptx)  # the producer's
    (tmp_path / "k.ptx").write_text(ptx)
    res = subprocess.run([sm90_ptxas(), "-arch=sm_90a", "-v", str(tmp_path / "k.ptx"), "-o", str(tmp_path / "k.cubin")],
                         capture_output=True, text=True, check=True)
    log = res.stderr + res.stdout
    assert " 0 bytes spill stores" in log
    assert not re.search(r"C75\d\d", log), log  # e.g. C7512 / C7515: wgmma.mma_async instructions are serialized
    if cfg.max_registers:  # the cap that lets programs_per_sm programs share an SM's register file holds
        assert int(re.search(r"Used (\d+) registers", log).group(1)) <= cfg.max_registers


# ============================================================================ CUDA
@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
def test_cuda_a_new_row_count_compiles_nothing():
    """A prefill's token count changes with its prompts (4 x 252 rows one step, 4 x 251 the next): a count that is,
    or stops being, a multiple of 16 must reuse the compiled kernels, the permute's and the GEMM's (a second
    variant compiled in the middle of a rollout cost 2.7 s on an H200, dev/LOG.md 118), and stay exact."""
    from qerl_lib.kernels import fp4_wgmma

    device = torch.cuda.current_device()
    caches = [kernel.device_caches[device][0] for kernel in (fp4_wgmma._permute_x_kernel,
                                                              pc._fp4_wgmma_producer_kernel)]
    q, w, g = cuda_nvfp4_weights(1024, 512, seed=3)
    compiled = []
    for m in (1008, 1004, 1016, 1000, 1):
        x = torch.randn(m, 512, device="cuda", generator=g).to(torch.bfloat16)
        out = torch.empty(m, 1024, dtype=torch.bfloat16, device="cuda")
        pc.linear(x, w.words, w.scales, w.global_scale, None, out, ProducerConfig())
        torch.cuda.synchronize()
        compiled.append([len(cache) for cache in caches])
        ref = reference_matmul(x, q, None)
        assert float((out.float() - ref.float()).abs().mean() / ref.float().abs().mean()) < 1e-3, m
    assert compiled[1:] == compiled[:1] * 4, compiled


@pytest.mark.skipif(pc.gluon is None, reason="Triton's Gluon is not installed here: the kernels are not defined")
def test_row_counts_are_left_unspecialized():
    """The CPU half of the test above: both kernels take M without Triton's divisibility specialization."""
    from qerl_lib.kernels import fp4_wgmma

    for kernel in (fp4_wgmma._permute_x_kernel, pc._fp4_wgmma_producer_kernel):
        assert [p.name for p in kernel.params if p.do_not_specialize] == ["M"], kernel


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k", [(1, 128, 256), (77, 320, 512), (129, 1000, 1024), (300, 4608, 3584),
                                     (257, 3584, 18944), (513, 200, 768), (1024, 512, 3584)])
@pytest.mark.parametrize("cfg", [ProducerConfig(), ProducerConfig(256, 2), ProducerConfig(128, 4),
                                 ProducerConfig(128, 2, 56), ProducerConfig(64, 5, 40, 1, 2),
                                 ProducerConfig(32, 5, 40, 1, 2), ProducerConfig(64, 3, 24, 1, 3)],
                         ids=_config_id)
def test_cuda_kernel_matches_the_oracle_and_fp4_wgmma(m, n, k, cfg):
    """With and without bias: against ``reference_matmul`` at mean relative error < 1e-3 (fp32 sums in another
    order, one bf16 rounding), every output written (NaN-poisoned), the same bits twice, and the same bits as
    ``fp4_wgmma`` with 256 rows and two warpgroups (each warpgroup runs the same instructions on the same data)."""
    from qerl_lib.kernels.fp4_gemm import fp4_linear
    from qerl_lib.kernels.fp4_wgmma import WgmmaConfig

    q, w, g = cuda_nvfp4_weights(n, k, seed=m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    w_t, no_bias = dequantize(q, torch.float32).t(), reference_matmul(x, q)
    for b in (None, bias):
        ref = reference_matmul(x, q, b)
        outs = []
        for _ in range(2):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            pc.linear(x, w.words, w.scales, w.global_scale, b, out, cfg)
            outs.append(out)
        wg = fp4_linear(x, w, b, config=WgmmaConfig(256, 2, 1, 3))
        torch.cuda.synchronize()
        assert not torch.isnan(outs[0]).any()
        rel = float((outs[0].float() - ref.float()).abs().mean() / ref.float().abs().mean())
        assert rel < 1e-3, rel
        # elementwise: bf16 output rounding of a float32-accumulated sum in another order (conftest.bf16_gemm_bound)
        assert_within_bf16_gemm_bound(outs[0], ref, bf16_gemm_bound(ref, x, w_t, None if b is None else no_bias),
                                      f"{cfg} m={m} n={n} k={k} bias={b is not None} (seed {m + n + k})")
        assert torch.equal(outs[0], outs[1])
        assert torch.equal(outs[0], wg)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("batch, rows, config", [(4, 256, ProducerConfig()), (3, 128, ProducerConfig(128, 4)),
                                                (2, 32, ProducerConfig(64, 5, 40, 1, 2)),
                                                (4, 7, ProducerConfig(32, 5, 40, 1, 2))])
def test_cuda_fp4_linear_routes_the_rules_problems_to_the_kernel(monkeypatch, batch, rows, config):
    """A gate/up-shaped call at M = 1024 (and at 384, with 128-row tiles; at the decode batch sizes 64 and 28)
    gives the kernel's bits through ``fp4_linear``; with the rule turned off it gives the path before's
    (dequantize + cuBLAS, or the one-warpgroup ``fp4_wgmma`` with K-slices: same values to ~1e-6, other
    summation order)."""
    from qerl_lib.kernels.fp4_gemm import fp4_linear
    from qerl_lib.kernels.launch_rule import RA_ENV

    monkeypatch.setenv(RA_ENV, "0")  # at 1024 rows the register-A CUDA kernel (fp4_ra) comes first in the rule
    m = batch * rows
    q, w, g = cuda_nvfp4_weights(16384, 512, seed=5)
    x = torch.randn(batch, m // batch, 512, device="cuda", generator=g).to(torch.bfloat16)  # a 3-D batch
    assert pick_producer_config(m, 16384, 512) == config
    direct = torch.empty(m, 16384, dtype=torch.bfloat16, device="cuda")
    pc.linear(x.reshape(m, 512), w.words, w.scales, w.global_scale, None, direct, config)
    routed = fp4_linear(x, w)
    assert routed.shape == (batch, m // batch, 16384)
    assert torch.equal(routed.reshape(m, 16384), direct)
    monkeypatch.setenv(PRODUCER_ENV, "0")
    other = fp4_linear(x, w)
    rel = float((other.float() - routed.float()).abs().mean() / routed.float().abs().mean())
    assert rel < 1e-3


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k, cfg", [(24, 3584, 18944, ProducerConfig(32, 5, 40, 1, 2, 4)),
                                          (64, 5120, 27648, ProducerConfig(64, 5, 40, 1, 2, 3)),
                                          (77, 320, 3584, ProducerConfig(32, 5, 40, 1, 2, 5)),
                                          (1, 200, 512, ProducerConfig(64, 2, 40, 1, 2, 16)),
                                          (32, 7168, 5120, ProducerConfig(32, 4, 24, 1, 3, 2)),  # the narrow span
                                          (25, 5120, 5120, ProducerConfig(32, 4, 24, 1, 3, 4)),
                                          (32, 4608, 3584, ProducerConfig(32, 4, 24, 1, 3, 4))])
def test_cuda_k_slices_match_the_oracle(m, n, k, cfg):
    """K-slices: fp32 partials summed by ``fp4_gemm``'s fixed-order reduction; every output written, within 1e-3
    mean relative error of ``reference_matmul`` with and without bias, the same bits twice, and the same values
    as the unsplit launch to fp32 rounding."""
    import dataclasses

    from qerl_lib.kernels.fp4_gemm import reduce_splits

    q, w, g = cuda_nvfp4_weights(n, k, seed=m + n + k)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    assert pc.k_slices(k, cfg.split_k)[1] > 1
    w_t, no_bias = dequantize(q, torch.float32).t(), reference_matmul(x, q)
    for b in (None, bias):
        ref = reference_matmul(x, q, b)
        outs = []
        for c in (cfg, cfg, dataclasses.replace(cfg, split_k=1)):
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            pc.linear(x, w.words, w.scales, w.global_scale, b, out, c, reduce_splits=reduce_splits)
            outs.append(out)
        torch.cuda.synchronize()
        assert not torch.isnan(outs[0]).any()
        rel = float((outs[0].float() - ref.float()).abs().mean() / ref.float().abs().mean())
        assert rel < 1e-3, rel
        # elementwise, split and unsplit: the K-slices' fp32 partials are summed in fp32 and rounded once before
        # the bias, so the bound is still bf16 output rounding of a float32-accumulated sum (conftest.bf16_gemm_bound)
        bound = bf16_gemm_bound(ref, x, w_t, None if b is None else no_bias)
        for what, got in (("split", outs[0]), ("unsplit", outs[2])):
            assert_within_bf16_gemm_bound(got, ref, bound, f"{what} {cfg} m={m} n={n} k={k} bias={b is not None} "
                                                           f"(seed {m + n + k})")
        assert torch.equal(outs[0], outs[1])
        unsplit = float((outs[0].float() - outs[2].float()).abs().mean() / outs[2].float().abs().mean())
        assert unsplit < 1e-3, unsplit
    with pytest.raises(ValueError, match="needs reduce_splits"):
        pc.linear(x, w.words, w.scales, w.global_scale, None, torch.empty(m, n, dtype=torch.bfloat16, device="cuda"),
                  cfg)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
def test_cuda_linear_refuses_what_it_cannot_run():
    q, w, g = cuda_nvfp4_weights(256, 512, seed=1)
    out = torch.empty(8, 256, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="K must be a positive multiple of 256"):
        q2, w2, _ = cuda_nvfp4_weights(256, 384, seed=2)
        pc.linear(torch.zeros(8, 384, dtype=torch.bfloat16, device="cuda"), w2.words, w2.scales, w2.global_scale,
                  None, out)
    scales = torch.zeros(256, 48, dtype=torch.uint8, device="cuda")[:, 8:40]  # starts 8 bytes into each row
    with pytest.raises(ValueError, match="must start on 16 bytes"):
        pc.linear(torch.zeros(8, 512, dtype=torch.bfloat16, device="cuda"), w.words, scales, w.global_scale, None, out)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_PC, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")
@pytest.mark.parametrize("m, n, k, cfg", [(32, 4608, 3584, ProducerConfig(32, 4, 24, 1, 3, 4)),  # q/k/v, 4 slices
                                          (32, 37888, 3584, ProducerConfig(32, 5, 40, 1, 2)),  # 2 tiles a program
                                          (64, 3584, 18944, ProducerConfig(64, 5, 40, 1, 2, 4)),
                                          (48, 1024, 256, ProducerConfig(64, 5, 40, 1, 2))])  # 2 steps < 5 stages
def test_cuda_pdl_launch_after_a_glue_kernel_in_a_graph(m, n, k, cfg):
    """Launched with PDL right after the engine's norm kernel (which lets its successor launch at once) and
    replayed in a CUDA graph on new inputs: the weights go out before the grid-dependency wait and x after it,
    so every replay equals the launch without PDL bit for bit and the oracle on that replay's rows (a kernel
    that read x before the wait would see the previous replay's)."""
    from qerl_lib.kernels.fp4_gemm import reduce_splits

    q, w, g = cuda_nvfp4_weights(n, k, seed=m + n)
    check_gemm_after_norm_in_a_graph(
        q, m, lambda hr, out, early: pc.linear(hr, w.words, w.scales, w.global_scale, None, out, cfg, permuted=True,
                                               reduce_splits=reduce_splits, pdl=early),
        g, relabeled=True)
