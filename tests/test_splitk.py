"""Split-K partial sums (``kernels/splitk.py``): summed in the GEMM by each tile's last slice to finish, or by a
second launch (``QERL_FP4_SPLITK_IN_KERNEL``), with the same bits.

* CPU, Triton interpreter: ``fp4_linear`` with K-split Triton configs (generic and fragment paths, one and several
  row tiles, with and without a bias) gives the same bits both ways and the reference's; in-kernel, no reduction
  launch runs and the tile counters are all zero afterwards; a launch whose counter was left non-zero (as a
  kernel whose tickets went wrong would leave it) sums nothing, so the check of the zeros can fail.
* CPU: the switch refuses other values with a message; the counter buffer grows and keeps what it outgrew.
* CUDA: on Qwen2.5-7B shapes at the decode rows whose launches split K (Triton fragment kernel on q/k/v and o, the
  producer-warp Gluon kernel on down), in-kernel equals the reduction launch bit for bit on every one of several
  calls (a race between the slices would show as a difference), also replayed from a CUDA graph, and leaves the
  counters at zero.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from qerl_lib.kernels import fp4_wgmma, splitk
from tests.conftest import run_triton_interpreter

# (name, M, N, K, KernelConfig fields, bias)
CASES = [
    ("generic_split3_bias", 3, 130, 208, dict(block_m=16, block_n=64, block_k=32, split_k=3), True),
    ("fragment_split2", 17, 130, 256, dict(block_m=32, block_n=128, block_k=128, split_k=2, fragment=True), False),
    ("fragment_3_row_tiles_bias", 150, 77, 256, dict(block_m=64, block_n=64, block_k=128, split_k=2, fragment=True), True),
    ("fragment_split4_uneven", 5, 200, 896, dict(block_m=16, block_n=64, block_k=128, split_k=4, fragment=True), True),
]

SCRIPT = textwrap.dedent("""
    import json, os, sys, zlib
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.quant import nvfp4
    from qerl_lib.kernels import fp4_gemm, splitk
    from qerl_lib.kernels.fp4_gemm import KernelConfig, fp4_linear, prepare_fp4_weights
    launches = []
    real = fp4_gemm.reduce_splits
    fp4_gemm.reduce_splits = lambda *job: (launches.append(1), real(*job))
    results = {}
    for name, m, n, k, cfg, use_bias in json.loads(sys.argv[1]):
        gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
        q = nvfp4.quantize(torch.randn(n, k, generator=gen).to(torch.bfloat16))
        x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
        bias = torch.randn(n, generator=gen).to(torch.bfloat16) if use_bias else None
        prep = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
        outs, counts = {}, {}
        for mode in ("1", "0"):
            os.environ["QERL_FP4_SPLITK_IN_KERNEL"] = mode
            launches.clear()
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
            fp4_linear(x, prep, bias, impl="triton", out=out, config=KernelConfig(**cfg))
            outs[mode], counts[mode] = out, len(launches)
        counters = splitk._COUNTERS[("cpu", None)]
        zero_after = int(counters.abs().sum()) == 0
        counters[:64] = 1000  # a counter a broken launch left behind: no slice draws the last ticket
        os.environ["QERL_FP4_SPLITK_IN_KERNEL"] = "1"
        stale = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        fp4_linear(x, prep, bias, impl="triton", out=stale, config=KernelConfig(**cfg))
        counters.zero_()
        results[name] = {"equal": torch.equal(outs["1"], outs["0"]),
                         "equal_reference": torch.equal(outs["1"], nvfp4.reference_matmul(x, q, bias)),
                         "nan": int(torch.isnan(outs["1"]).sum()), "launches": counts, "zero_after": zero_after,
                         "stale_counter_unsummed": int(torch.isnan(stale).sum())}
    print("RESULTS " + json.dumps(results))
""")


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(SCRIPT, CASES, timeout=300)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_interpreted_in_kernel_sums_equal_the_reduction_launch(interpreted, case):
    r = interpreted[case[0]]
    assert r["nan"] == 0, "output elements never written"
    assert r["equal"], "in-kernel sums differ from the reduction launch"
    assert r["equal_reference"], "in-kernel sums differ from nvfp4.reference_matmul"
    assert r["launches"] == {"1": 0, "0": 1}, r["launches"]
    assert r["zero_after"], "a launch left a tile counter non-zero"


def test_interpreted_a_stale_counter_leaves_its_tiles_unsummed(interpreted):
    for name, r in interpreted.items():
        assert r["stale_counter_unsummed"] > 0, name  # the zero check above is one that can fail


def test_switch_refuses_other_values(monkeypatch):
    monkeypatch.setenv(splitk.IN_KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match="QERL_FP4_SPLITK_IN_KERNEL must be 0 or 1"):
        splitk.in_kernel()
    monkeypatch.setenv(splitk.IN_KERNEL_ENV, "0")
    assert not splitk.in_kernel()
    monkeypatch.delenv(splitk.IN_KERNEL_ENV)
    assert splitk.in_kernel()


def test_counter_buffer_grows_and_keeps_what_it_outgrew(monkeypatch):
    monkeypatch.setattr(splitk, "_COUNTERS", {})
    monkeypatch.setattr(splitk, "_OUTGROWN", [])
    dev = torch.device("cpu")
    first = splitk.tile_counters(dev, 10)
    assert first.numel() >= 10 and first.dtype == torch.int32 and int(first.abs().sum()) == 0
    assert splitk.tile_counters(dev, first.numel()) is first
    bigger = splitk.tile_counters(dev, first.numel() + 1)
    assert bigger.numel() > first.numel() and splitk._OUTGROWN == [first]


# ---------------------------------------------------------------------------------- CUDA
HAS_GLUON_GPU = torch.cuda.is_available() and fp4_wgmma.available()


def _cuda_weight(n, k, seed):
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = quantize((torch.randn(n, k, generator=g, device="cuda") * 0.02).to(torch.bfloat16))
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_GLUON_GPU, reason="needs a Hopper GPU (sm_90) and Triton's Gluon (the launch rule's paths)")
@pytest.mark.parametrize("rows,n,k,bias", [(16, 4608, 3584, True), (24, 4608, 3584, True), (32, 4608, 3584, True),
                                            (32, 3584, 3584, False), (24, 3584, 18944, False), (32, 3584, 18944, False),
                                            (64, 3584, 18944, False)],
                         ids=["qkv16", "qkv24", "qkv32", "o32", "down24", "down32", "down64"])
def test_cuda_in_kernel_sums_equal_the_reduction_launch(monkeypatch, rows, n, k, bias):
    from qerl_lib.kernels.fp4_gemm import fp4_linear, planned_launch

    w = _cuda_weight(n, k, rows + n)
    g = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, k, generator=g, device="cuda").to(torch.bfloat16)
    b = torch.randn(n, generator=g, device="cuda").to(torch.bfloat16) if bias else None
    assert planned_launch(rows, w, x.device).split_k > 1, "the case must be one whose launch splits K"
    monkeypatch.setenv(splitk.IN_KERNEL_ENV, "0")
    launched = fp4_linear(x, w, b)
    monkeypatch.setenv(splitk.IN_KERNEL_ENV, "1")
    for _ in range(5):
        assert torch.equal(fp4_linear(x, w, b), launched)
    counters = splitk._COUNTERS[("cuda", x.device.index)]
    torch.cuda.synchronize()
    assert int(counters.abs().sum()) == 0
    out = torch.empty_like(launched)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fp4_linear(x, w, b, out=out)
    for _ in range(3):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, launched)
    assert int(counters.abs().sum()) == 0
