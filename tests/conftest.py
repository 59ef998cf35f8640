"""Shared pytest fixtures and markers.

Markers (declared in pyproject.toml): `slow` (deselected by default), `cuda` (needs a GPU,
skipped with a visible reason otherwise), `notebooks`.
"""

from __future__ import annotations

import os

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")


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
    JSON in argv[1]; the script prints one line "RESULTS <json>", which is returned. Skips with the
    reason when this Triton's interpreter cannot run here."""
    import json
    import subprocess
    import sys

    reason = _interpreter_incompatible()
    if reason:
        pytest.skip(reason)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", script, json.dumps(payload)], env=env, cwd=repo,
                          capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, f"interpreter subprocess failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULTS "):])


def _interpreter_incompatible() -> str | None:
    """Triton < 3.9's interpreter turns program ids into 1-element arrays and calls int() on them for
    runtime loop bounds, which numpy >= 2.5 rejects ("only 0-dimensional arrays can be converted").
    Seen on the GPU image (Triton 3.6, numpy 2.5.2); reproduced here with Triton 3.6 under
    -W error::DeprecationWarning. Triton 3.9 (this kit's CPU environment) is unaffected."""
    import numpy
    try:
        import triton
    except ImportError:
        return "triton is not installed"
    version = lambda v: tuple(int(p) for p in v.split(".")[:2] if p.isdigit())  # noqa: E731
    if version(triton.__version__) < (3, 9) and version(numpy.__version__) >= (2, 5):
        return f"Triton {triton.__version__}'s interpreter is incompatible with numpy {numpy.__version__} (use Triton >= 3.9)"
    return None


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
