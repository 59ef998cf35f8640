"""The register-A NVFP4 GEMM in CUDA (``kernels/fp4_ra.py``): its configuration, its decode table's bit trick, what
NVRTC/ptxas make of every shipped launch shape (CPU), and its outputs against ``nvfp4.reference_matmul`` (CUDA)."""
import pytest
import torch

from qerl_lib.kernels import fp4_ra
from qerl_lib.quant.nvfp4 import GROUP_SIZE, decode_e2m1, dequantize, reference_matmul
from tests.conftest import assert_within_bf16_gemm_bound, bf16_gemm_bound, cuda_nvfp4_weights, nvrtc_or_none

SHAPES = [fp4_ra.RaConfig(256, 4), fp4_ra.RaConfig(128, 6), fp4_ra.RaConfig(128, 4), fp4_ra.RaConfig(64, 8)]


def test_config_validation_names_the_limit():
    with pytest.raises(ValueError, match="tok must be 64, 128 or 256"):
        fp4_ra.RaConfig(tok=192)
    with pytest.raises(ValueError, match="stages"):
        fp4_ra.RaConfig(stages=1)
    with pytest.raises(ValueError, match="shared memory"):
        fp4_ra.RaConfig(256, 5)  # 5 x 36 KB + the 64 KB table > 227 KB
    with pytest.raises(ValueError, match="schedule must be one of"):
        fp4_ra.RaConfig(schedule="stream")
    with pytest.raises(ValueError, match="min_split_steps"):
        fp4_ra.RaConfig(min_split_steps=0)
    with pytest.raises(ValueError, match="split_max_fill"):
        fp4_ra.RaConfig(split_max_fill=1.5)


def _steps_of_every_cta(s: fp4_ra.RaSchedule) -> list[int]:
    return [sum(ke - kb for _, kb, ke, _ in s.units(cta)) for cta in range(s.grid)]


@pytest.mark.parametrize("schedule", fp4_ra.SCHEDULES)
@pytest.mark.parametrize("m,n,k,tok,sms", [(1024, 18944, 3584, 256, 132), (1024, 3584, 18944, 256, 132),
                                           (1024, 512, 3584, 256, 132), (4096, 4608, 3584, 128, 132),
                                           (257, 264, 640, 256, 132), (100, 128, 64, 64, 132), (3000, 5120, 5120, 256, 114)])
def test_schedule_covers_every_k_step_of_every_tile_once(schedule, m, n, k, tok, sms):
    """The units of all CTAs cover each (tile, K-step) exactly once; a CTA has at most two split units, in slots 0
    and 1; the CTAs that share a split tile are those the kernel's summing loop visits (first..last, each with the
    slot it computes); and no CTA gets more than a tile's K-steps beyond the average."""
    cfg = fp4_ra.RaConfig(tok, 4 if tok == 256 else 6, schedule, min_split_steps=8)
    s = fp4_ra.plan_schedule(m, n, k, cfg, sms)
    assert s.grid <= (s.tiles if schedule == "one_tile" else sms)
    seen = {}
    sharing: dict[int, list[tuple[int, int]]] = {}
    for cta in range(s.grid):
        split = [(t, kb, ke, slot) for t, kb, ke, slot in s.units(cta) if (kb, ke) != (0, s.n_steps)]
        assert len(split) <= 2 and [slot for *_, slot in split] in ([], [0], [1], [0, 1])
        for t, kb, ke, slot in s.units(cta):
            assert 0 <= t < s.tiles and 0 <= kb < ke <= s.n_steps
            for step in range(kb, ke):
                assert (t, step) not in seen
                seen[t, step] = cta
            if (kb, ke) != (0, s.n_steps):
                assert t >= s.dp_tiles
                sharing.setdefault(t, []).append((cta, slot))
    assert len(seen) == s.tiles * s.n_steps
    for t, ctas in sharing.items():
        local = t - s.dp_tiles
        first, last = local * s.n_steps // s.sk_per, ((local + 1) * s.n_steps - 1) // s.sk_per
        assert ctas == [(j, 0 if j * s.sk_per // s.n_steps == local else 1) for j in range(first, last + 1)]
    steps = _steps_of_every_cta(s)
    assert max(steps) - s.tiles * s.n_steps / s.grid <= s.n_steps


def test_split_schedule_shortens_a_part_empty_last_wave():
    """7B down at M = 1024 on 132 SMs: 112 tiles of 296 K-steps; whole tiles leave the busiest CTA 296 steps, splitting
    them all ceil(112 * 296 / 132) = 252; a grid that fills whole waves is left whole, and so by default is a last wave
    more than half full."""
    whole = fp4_ra.plan_schedule(1024, 3584, 18944, fp4_ra.RaConfig(schedule="persistent"), 132)
    split = fp4_ra.plan_schedule(1024, 3584, 18944, fp4_ra.RaConfig(split_max_fill=1.0), 132)
    assert max(_steps_of_every_cta(whole)) == 296 and max(_steps_of_every_cta(split)) == 252
    assert split.split_tiles == 112 and split.grid == 132
    full = fp4_ra.plan_schedule(1024, 128 * 132, 3584, fp4_ra.RaConfig(), 132)  # 528 tiles: 4 whole waves
    assert full.sk_ctas == 0 and full.dp_tiles == 528
    crowded = fp4_ra.plan_schedule(1024, 3584, 18944, fp4_ra.RaConfig(), 132)  # 112 / 132 > the default 0.5
    assert crowded == whole
    tail = fp4_ra.plan_schedule(1024, 5120, 27648, fp4_ra.RaConfig(), 132)  # 32B down: 160 tiles, 28 left over
    assert tail.dp_tiles == 132 and tail.split_tiles == 28 and tail.sk_ctas == 132


def _natural_pair(b: int) -> int:
    """fp4_ra.cu's natural_pair(b, 0), transcribed: both nibbles of byte b as bf16 bits, low nibble in the low half."""
    both = (b & 0xF) | ((b << 12) & 0xF0000)
    return (both * 0x1040) & 0x81C081C0


def _bf16_value(bits: int) -> float:
    import struct

    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def test_table_entries_are_the_two_codes_of_every_byte():
    """Every byte value: the low half decodes to fp4(low nibble) * 2^-126, the high half to fp4(high nibble) * 2^-126
    (code 1 = 0.5 as a bf16 subnormal), i.e. code k%2 == 0 is the low nibble, as compressed-tensors packs K."""
    codes = torch.arange(16, dtype=torch.uint8)
    values = decode_e2m1(codes).tolist()
    for b in range(256):
        bits = _natural_pair(b)
        assert _bf16_value(bits & 0xFFFF) == values[b & 0xF] * 2.0 ** -126
        assert _bf16_value(bits >> 16) == values[b >> 4] * 2.0 ** -126


def test_table_addresses_put_a_lanes_byte_above_its_bank():
    """prmt(word, lane offset, 0x5504 | t << 4) as PTX defines it: byte t of the word at bits 8-15, the offset's low byte
    at 0-7, zeros above; so the address is 256 * byte + 4 * lane (+ 128 for the scale half)."""
    def prmt(a: int, b: int, sel: int) -> int:
        src = a.to_bytes(4, "little") + b.to_bytes(4, "little")
        return int.from_bytes(bytes(src[(sel >> (4 * i)) & 7] for i in range(4)), "little")

    word = 0x9C3A5E71
    for t in range(4):
        for lane in (0, 5, 31):
            for offset in (4 * lane, 128 + 4 * lane):
                assert prmt(word, offset, 0x5504 | (t << 4)) == 256 * ((word >> (8 * t)) & 0xFF) + offset


@pytest.mark.skipif(nvrtc_or_none() is None, reason="no libnvrtc here (CUDA builds of PyTorch ship it; or set QERL_NVRTC)")
@pytest.mark.parametrize("cfg", SHAPES, ids=lambda c: c.name)
def test_every_launch_shape_compiles_without_spills_or_serialized_wgmma(cfg):
    """ptxas must neither spill nor serialize the wgmmas (C7512/C7513/C7515: each MMA would wait for the one before,
    dev/LOG.md section 72); its report comes back through NVRTC's log."""
    log: list[str] = []
    cubin = fp4_ra.compile_cubin(cfg, log=log)
    assert cubin[:4] == b"\x7fELF"
    text = log[0]
    assert "C751" not in text, text
    assert "0 bytes spill stores, 0 bytes spill loads" in text, text


def test_linear_rejects_shapes_and_dtypes_it_cannot_run():
    w = torch.zeros(136, 64 // 8, dtype=torch.int32)
    s = torch.zeros(136, 64 // GROUP_SIZE, dtype=torch.uint8)
    gs = torch.ones(1)
    with pytest.raises(ValueError, match="K % 64 == 0"):
        fp4_ra.linear(torch.zeros(4, 48, dtype=torch.bfloat16), w[:, :6], s[:, :3], gs, None,
                      torch.zeros(4, 136, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="N % 8 == 0"):
        fp4_ra.linear(torch.zeros(4, 64, dtype=torch.bfloat16), w[:130], s[:130], gs, None,
                      torch.zeros(4, 130, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="must be bf16"):
        fp4_ra.linear(torch.zeros(4, 64, dtype=torch.float16), w, s, gs, None, torch.zeros(4, 136, dtype=torch.bfloat16))


CHECKS = [(128, 64, 100, False), (136, 192, 300, True), (264, 640, 257, False), (512, 3584, 1024, True),
          (4608, 3584, 33, False), (4608, 3584, 1024, True)]
# every launch shape with the default schedule (split), and the 256-row shape with each schedule and many-way splits
LAUNCHES = SHAPES + [fp4_ra.RaConfig(256, 4, "one_tile"), fp4_ra.RaConfig(256, 4, "persistent"),
                     fp4_ra.RaConfig(256, 4, min_split_steps=1, split_max_fill=1.0)]


def _launch_id(cfg: fp4_ra.RaConfig) -> str:
    return f"{cfg.name}_{cfg.schedule}{cfg.min_split_steps}"


@pytest.mark.cuda
@pytest.mark.skipif(not fp4_ra.available(), reason=f"fp4_ra cannot run here: {fp4_ra.unavailable_reason()}")
@pytest.mark.parametrize("cfg", LAUNCHES, ids=_launch_id)
@pytest.mark.parametrize("n,k,m,bias", CHECKS)
def test_matches_the_oracle_and_writes_only_its_output(cfg, n, k, m, bias):
    """Fresh random weights and x: mean relative error <= 1e-3 against the oracle and every element within the bf16
    rounding of an fp32 sum (the kernel sums exact products in fp32 in another order; ``conftest.bf16_gemm_bound``), every output written, nothing around it touched, two launches bit-equal."""
    q, w, gen = cuda_nvfp4_weights(n, k, seed=n * 7 + k * 3 + m)
    words, scales = w.words, w.scales
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16) if bias else None
    ref = reference_matmul(x, q, b).double()
    buf = torch.full((m + 2, n + 8), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buf[1:m + 1, :n]
    fp4_ra.linear(x, words, scales, q.weight_global_scale, b, out, cfg)
    err = ((out.double() - ref).abs().mean() / ref.abs().mean()).item()
    assert out.isfinite().all() and err <= 1e-3, err
    # elementwise: bf16 output rounding of a float32-accumulated sum in another order (one rounding before the
    # bias, one after): conftest.bf16_gemm_bound
    bound = bf16_gemm_bound(ref.float(), x, dequantize(q, torch.float32).t(), None if b is None else reference_matmul(x, q))
    assert_within_bf16_gemm_bound(out, ref.float(), bound, f"{_launch_id(cfg)} n={n} k={k} m={m} bias={bias} "
                                                           f"(seed {n * 7 + k * 3 + m})")
    assert buf[0].isnan().all() and buf[-1].isnan().all() and buf[1:m + 1, n:].isnan().all()
    again = torch.empty_like(out)
    fp4_ra.linear(x, words, scales, q.weight_global_scale, b, again, cfg)
    assert torch.equal(out, again)


@pytest.mark.parametrize("m,n,k,picked", [
    (1024, 18944, 3584, True), (2048, 37888, 3584, True), (1536, 27648, 5120, True), (2048, 55296, 5120, True),
    (1024, 3584, 18944, False), (2048, 5120, 27648, False), (1024, 7168, 5120, False),  # down, 32B fused q/k/v: not adopted
    (1024, 3584, 3584, False), (2048, 4608, 3584, False), (1024, 512, 3584, False), (1024, 5120, 5120, False),
    (1023, 37888, 3584, False), (2049, 37888, 3584, False), (4096, 3584, 18944, False),  # outside the measured rows
    (1024, 37888, 3600, False)])  # K not a multiple of 64
def test_rule_picks_the_register_a_kernel_only_where_it_measured_faster(m, n, k, picked):
    from qerl_lib.kernels.launch_rule import path_name, pick_ra_config, plan_launch

    assert (pick_ra_config(m, n, k) == fp4_ra.RaConfig()) == picked
    planned = plan_launch(m, n, k, gluon=True, producer_aligned=True, ra=True)
    assert isinstance(planned, fp4_ra.RaConfig) == picked
    assert not isinstance(plan_launch(m, n, k, gluon=True, producer_aligned=True, ra=False), fp4_ra.RaConfig)
    if picked:
        assert path_name(planned) == "cuda-register-a"


def test_rule_can_be_turned_off(monkeypatch):
    from qerl_lib.kernels.launch_rule import RA_ENV, pick_ra_config

    monkeypatch.setenv(RA_ENV, "0")
    assert pick_ra_config(1024, 18944, 3584) is None


@pytest.mark.cuda
@pytest.mark.skipif(not fp4_ra.available(), reason=f"fp4_ra cannot run here: {fp4_ra.unavailable_reason()}")
@pytest.mark.parametrize("misaligned_out", [False, True])
def test_fp4_linear_routes_to_it_and_matches_the_oracle(monkeypatch, misaligned_out):
    """At 1024 rows of a wide shape ``fp4_linear`` plans this kernel and its output matches the oracle; an output
    that is not 16-byte aligned falls back to the launch the rule gives without it; QERL_FP4_RA=0 plans another."""
    from qerl_lib.kernels.fp4_gemm import fp4_linear, planned_launch
    from qerl_lib.kernels.launch_rule import RA_ENV

    m, n, k = 1024, 16384, 512
    q, w, gen = cuda_nvfp4_weights(n, k, seed=11)
    x = torch.randn(m, k, device="cuda", generator=gen).to(torch.bfloat16)
    b = (torch.randn(n, device="cuda", generator=gen) * 0.1).to(torch.bfloat16)
    assert isinstance(planned_launch(m, w, x.device), fp4_ra.RaConfig)
    ref = reference_matmul(x, q, b).double()
    out = torch.empty(m * n + 1, device="cuda", dtype=torch.bfloat16)[1:].view(m, n) if misaligned_out else None
    y = fp4_linear(x, w, b, out=out)
    err = ((y.double() - ref).abs().mean() / ref.abs().mean()).item()
    assert y.isfinite().all() and err <= 1e-3, err
    monkeypatch.setenv(RA_ENV, "0")
    assert not isinstance(planned_launch(m, w, x.device), fp4_ra.RaConfig)
