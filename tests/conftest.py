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
    from qerl_lib.embedded import prepare_embedded_model

    return prepare_embedded_model(quiet=True)


@pytest.fixture(autouse=True)
def _deterministic_threads():
    # Tests compare numbers; keep intra-op threading fixed so reductions are repeatable.
    torch.set_num_threads(int(os.environ.get("QERL_TEST_THREADS", "2")))
    yield


@pytest.fixture(scope="module")
def verifier():
    """A math-verify worker with the default time limit (as training uses); closed after the module."""
    from qerl_lib.verifier import MathVerifier

    v = MathVerifier()
    v.start()
    yield v
    v.close()


@pytest.fixture(scope="module")
def quick_verifier():
    """A math-verify worker with a 1 s limit, for the slow-input cases."""
    from qerl_lib.verifier import MathVerifier

    v = MathVerifier(timeout_s=1.0)
    v.start()
    yield v
    v.close()
