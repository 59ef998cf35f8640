"""Shared pytest fixtures and markers.

Markers (declared in pyproject.toml): `slow` (deselected by default), `cuda` (needs a GPU,
skipped with a visible reason otherwise), `notebooks`.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
# the kit's kernel modules set `triton = None` when it does not import; tests that need the kernels defined use this
requires_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                     reason="needs the triton package (not installed here: the kernels are not defined)")


def pytest_collection_modifyitems(config, items):
    # Every test marked `cuda` is skipped, with a reason, when no GPU is present.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def embedded_model_dir():
    """The embedded SmolLM2-135M-Instruct as a Hugging Face folder (converted once, cached)."""
    from qerl_lib.models.embedded import prepare_embedded_model

    return prepare_embedded_model(quiet=True)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Tests compare numbers; keep intra-op threading fixed so reductions are repeatable.
    torch.set_num_threads(int(os.environ.get("QERL_TEST_THREADS", "2")))
    yield


@pytest.fixture
def one_torch_thread():
    """One intra-op thread: the tiny models' 64-wide matrices run faster so (see tests/test_grpo.py)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """tests/test_grpo.py's tiny random Llama (hidden 64, 2 layers), saved once per module."""
    from test_grpo import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("tiny-llama"), hidden=64, layers=2, heads=4, kv_heads=2)


@pytest.fixture(scope="module")
def verifier():
    """A math-verify worker with the default time limit (as training uses); closed after the module."""
    from qerl_lib.tasks.verifier import MathVerifier

    v = MathVerifier()
    v.start()
    yield v
    v.close()


@pytest.fixture(scope="module")
def quick_verifier():
    """A math-verify worker with a 1 s limit, for the slow-input cases."""
    from qerl_lib.tasks.verifier import MathVerifier

    v = MathVerifier(timeout_s=1.0)
    v.start()
    yield v
    v.close()


def run_triton_interpreter(script: str, payload, timeout: int = 300) -> dict:
    """Run ``script`` in a fresh Python with TRITON_INTERPRET=1 (it must be set before triton is
    imported, and another test module may have imported triton already), passing ``payload`` as
    JSON in argv[1]; the script prints one line "RESULTS <json>", which is returned.

    Skips only where the interpreter really cannot run: without the triton package (an optional
    dependency), or where a probe kernel reproduces the known Triton < 3.9 / numpy >= 2.5 clash (see
    ``_interpreter_incompatible``); that skip also raises a warning, so pytest's summary prints it
    even without ``-rs``. Any other interpreter failure fails the test."""
    import json
    import subprocess
    import sys
    import warnings

    pytest.importorskip("triton", reason="triton is not installed (the Triton-interpreter tests need it)")
    reason = _interpreter_incompatible()
    if reason:
        warnings.warn(f"Triton-interpreter test skipped: {reason}", pytest.PytestWarning, stacklevel=2)
        pytest.skip(reason)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(payload)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, f"interpreter subprocess failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULTS "):])


# numpy >= 2.5's error for int() of a 1-element, 1-D array (deprecated since numpy 1.25)
_NUMPY_CLASH_TEXT = "only 0-dimensional arrays can be converted"

# A runtime loop bound taken from a program id: Triton < 3.9's interpreter calls int() on the id's
# 1-element array there, which numpy >= 2.5 rejects with _NUMPY_CLASH_TEXT.
_INTERPRETER_PROBE = """
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
import triton
import triton.language as tl

@triton.jit
def _probe(out_ptr):
    pid = tl.program_id(0)
    acc = 0
    for _ in range(0, pid + 1):
        acc += 1
    tl.store(out_ptr + pid, acc)

out = torch.zeros(3, dtype=torch.int32)
_probe[(3,)](out)
assert out.tolist() == [1, 2, 3], out.tolist()
print("PROBE OK")
"""


@functools.lru_cache(maxsize=None)
def _interpreter_incompatible() -> str | None:
    """The reason this Triton's interpreter cannot run the kernels here, or None.

    Triton < 3.9's interpreter turns program ids into 1-element arrays and calls int() on them for
    runtime loop bounds, which numpy >= 2.5 rejects ("only 0-dimensional arrays can be converted").
    Seen on the GPU image (Triton 3.6, numpy 2.5.2); Triton 3.9 (this kit's CPU environment) is
    unaffected. The versions alone do not decide it: on those versions a probe kernel runs in the
    interpreter (once per session) and only that exact error counts as the clash. Any other probe
    failure fails the calling test loudly, with the probe's output, instead of skipping."""
    import subprocess
    import sys

    import numpy
    import triton

    version = lambda v: tuple(int(p) for p in v.split(".")[:2] if p.isdigit())  # noqa: E731
    if not (version(triton.__version__) < (3, 9) and version(numpy.__version__) >= (2, 5)):
        return None
    proc = subprocess.run([sys.executable, "-c", _INTERPRETER_PROBE], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, TRITON_INTERPRET="1"))
    if proc.returncode == 0 and "PROBE OK" in proc.stdout:
        return None  # these versions work after all: run the tests
    if _NUMPY_CLASH_TEXT in proc.stderr:
        return (f"Triton {triton.__version__}'s interpreter is incompatible with numpy {numpy.__version__} "
                f"(probe kernel failed with {_NUMPY_CLASH_TEXT!r}; use Triton >= 3.9 or numpy < 2.5)")
    pytest.fail(f"the Triton interpreter probe failed for another reason than the known numpy clash "
                f"(Triton {triton.__version__}, numpy {numpy.__version__}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


def nvrtc_or_none():
    """libnvrtc as ``kernels/mma.py`` finds it, or None: the offline NVRTC compile tests of the CUDA kernels skip
    without it."""
    from qerl_lib.kernels import mma

    try:
        return mma._nvrtc()
    except OSError:
        return None


def sm90_ptxas() -> str | None:
    """The ptxas Triton itself uses for sm_90 (its bundled binaries differ between versions), or None without
    Triton's NVIDIA backend: the offline-compile tests of the Gluon kernels run it on the PTX they get."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        path = get_ptxas(90).path
    except Exception:  # no Triton, or no NVIDIA backend in it
        return None
    return path if path and os.path.exists(path) else None


def cuda_nvfp4_weights(n: int, k: int, seed: int):
    """A fresh random bf16 ``[n, k]`` weight quantized to NVFP4 on the GPU: ``(NVFP4Weight, its
    ``prepare_fp4_weights`` view, the seeded CUDA generator for the test's inputs)``."""
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    return q, prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale), g


def check_gemm_after_norm_in_a_graph(q, m: int, gemm, g, relabeled: bool = False) -> None:
    """The engine's norm kernel (a PDL launch that lets its successor launch at once) on ``x [m, K]``, then
    ``gemm(h, out, early)`` on its output (``relabeled``: the norm's relabeled copy), captured in a CUDA graph and
    replayed on three new inputs drawn from ``g``, with ``early`` False and True. Every replay's output must be
    equal bit for bit between the two, and within 1e-3 mean relative error of ``reference_matmul(h, q)`` on that
    replay's normed rows (a kernel that read its input before its grid-dependency wait would see the previous
    replay's). ``q``: the NVFP4 weight ``[N, K]``."""
    from qerl_lib.engine import glue
    from qerl_lib.kernels import pdl
    from qerl_lib.quant.nvfp4 import reference_matmul

    assert pdl.use_for(torch.device("cuda")), "PDL must be on for this test (QERL_PDL unset or 1)"
    n, k = q.weight_packed.shape[0], q.weight_packed.shape[1] * 2
    norm_w = torch.ones(k, dtype=torch.bfloat16, device="cuda")
    x = torch.empty(m, k, dtype=torch.bfloat16, device="cuda")
    inputs = [torch.randn(m, k, generator=g, device="cuda").to(torch.bfloat16) * (i + 1) for i in range(3)]
    outs = {}
    for early in (False, True):
        out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")

        def step():
            if relabeled:
                h, hr = glue.rms_norm(x, norm_w, 1e-6, relabeled=True)
            else:
                h = hr = glue.rms_norm(x, norm_w, 1e-6)
            gemm(hr, out, early)
            return h

        x.copy_(inputs[0])
        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h = step()
        got = []
        for new_x in inputs:
            x.copy_(new_x)
            graph.replay()
            got.append((out.clone(), h.clone()))
        outs[early] = got
    torch.cuda.synchronize()
    for (plain, _), (early_out, h) in zip(outs[False], outs[True]):
        assert torch.equal(plain, early_out)
        ref = reference_matmul(h, q)
        rel = float((early_out.float() - ref.float()).abs().mean() / ref.float().abs().mean())
        assert rel < 1e-3, rel


# ------------------------------------------------------------------ elementwise bound of a bf16 GEMM
BF16_EPS = torch.finfo(torch.bfloat16).eps  # 2^-7: one bf16 step (ulp) at 1.0, i.e. two half-ulp roundings


def bf16_gemm_bound(ref: torch.Tensor, a: torch.Tensor, w: torch.Tensor,
                    ref_before_bias: torch.Tensor | None = None) -> torch.Tensor:
    """Elementwise bound on ``|out - ref|`` for a GEMM ``a @ w`` whose output is the bf16 rounding of a
    float32-accumulated sum of exact products, computed by two routes that differ only in the fp32 summation order.

    ``a``: ``[..., T]`` (T terms per output), ``w``: ``[T, C]`` float32 (the dequantized weight, oriented so that
    ``a @ w`` is the output). The two fp32 sums differ by at most ``T * 2^-24 * (|a| @ |w|)`` (the standard
    ``gamma_T`` bound on the magnitudes' sum, not on the possibly cancelling sum itself; observed far below). Each
    route then rounds to bf16 once (round to nearest: at most 2^-8 relative each), so the two outputs can land
    one bf16 step apart: ``eps_bf16 * |value|``. A bias is added after that cast and rounded again: the first step
    is then relative to the value before the bias (``ref_before_bias``), the second to the result. Without a bias
    this is ``2 * eps_bf16 * |ref| + T * 2^-24 * (|a| @ |w|)``, the bound of
    ``tests/test_fp4_kernel_mma.py::test_kernel_matches_oracle_on_gpu``."""
    terms = a.shape[-1]
    first = ref if ref_before_bias is None else ref_before_bias
    mags = (a.reshape(-1, terms).float().abs() @ w.float().abs()).reshape(ref.shape)
    return BF16_EPS * (first.float().abs() + ref.float().abs()) + terms * 2.0**-24 * mags


def assert_within_bf16_gemm_bound(out: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    """Every element of ``out`` within ``bound`` of ``ref`` (see ``bf16_gemm_bound``); names the worst element."""
    assert out.shape == ref.shape == bound.shape, (what, out.shape, ref.shape, bound.shape)
    assert not torch.isnan(out).any(), f"{what}: NaN in the output (poisoned elements never written?)"
    err = (out.float() - ref.float()).abs()
    bad = err > bound
    if bool(bad.any()):
        worst = int(torch.argmax(err / bound.clamp_min(1e-30)))
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), out.shape))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {bad.numel()} elements outside the bf16-rounding bound; worst at {idx}: "
            f"out {float(out.flatten()[worst]):.6g}, ref {float(ref.flatten()[worst]):.6g}, "
            f"|diff| {float(err.flatten()[worst]):.3g} > bound {float(bound.flatten()[worst]):.3g}")


@pytest.fixture
def fp32_cublas_sums():
    """TF32 off (the oracle's fp32 matmul must be fp32) and cuBLAS's bf16 split-K reductions off.

    torch allows cuBLAS, by default, to reduce split-K partial sums of a bf16 GEMM in bf16
    (``allow_bf16_reduced_precision_reduction``): a dequantize + cuBLAS route can then round more than once,
    which ``bf16_gemm_bound`` (one fp32 sum, one bf16 rounding) does not cover. Tests that bound such a route
    elementwise run with both off, and restore them after."""
    matmul = torch.backends.cuda.matmul
    previous = (matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction)
    matmul.allow_tf32 = False
    matmul.allow_bf16_reduced_precision_reduction = False
    yield
    matmul.allow_tf32, matmul.allow_bf16_reduced_precision_reduction = previous


@pytest.fixture
def single_torch_thread():
    """One intra-op thread for the test (tiny matrices: a second thread only adds OpenMP synchronisation, which on a
    loaded 2-core machine made the GRPO runs 5x slower, 4 s vs 28 s a run); the setting is restored after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
