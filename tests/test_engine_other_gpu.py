"""An engine whose model sits on a GPU other than the current one (one process driving two GPUs).

Triton, the NVRTC kernels and CUDA graph capture launch on the current device's stream, so the engine makes its
model's GPU current for each call (`engine/rollout._on_model_gpu`) and leaves the caller's device as it was.
CPU: the decorator's bookkeeping with torch.cuda's device context recorded. CUDA, with two visible GPUs: the samples.
"""

from __future__ import annotations

import contextlib
import copy
from types import SimpleNamespace

import pytest
import torch

from qerl_lib.engine.rollout import RolloutEngine, _on_model_gpu

from test_engine import PROMPTS, tiny_cuda_model


def test_engine_calls_run_inside_their_models_gpu_context(monkeypatch):
    entered = []

    @contextlib.contextmanager
    def device_context(device):
        entered.append(("enter", device))
        yield
        entered.append(("exit", device))

    class Engine:
        @_on_model_gpu
        def generate(self, value, scale=1):
            entered.append(("call", value * scale))
            return value * scale

    monkeypatch.setattr(torch.cuda, "device", device_context)
    engine = Engine()
    engine._view = SimpleNamespace(device=torch.device("cuda", 1))
    assert engine.generate(3, scale=2) == 6
    assert entered == [("enter", torch.device("cuda", 1)), ("call", 6), ("exit", torch.device("cuda", 1))]
    entered.clear()
    engine._view = SimpleNamespace(device=torch.device("cpu"))  # off CUDA: no device context at all
    assert engine.generate(4) == 4 and entered == [("call", 4)]
    # and the engine's two entry points that launch kernels carry it
    assert [getattr(RolloutEngine, name).__wrapped__.__name__ for name in ("generate", "warmup")] == ["generate", "warmup"]


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (one process on a multi-GPU machine)")
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_an_engine_on_another_gpu_than_the_current_one_samples_there(weights):
    torch.cuda.set_device(0)
    first_graph, counter = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda:0")
    with torch.cuda.graph(first_graph):  # PyTorch's default capture stream now lives on cuda:0
        counter.add_(1)
    model = tiny_cuda_model(weights)  # on cuda:0, the current device
    other = copy.deepcopy(model).to("cuda:1")
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=[41, 42, 43, 44])
    here = RolloutEngine(model, length_step=16).generate(PROMPTS, 40, **kw)
    engine = RolloutEngine(other, length_step=16)
    engine.warmup(len(PROMPTS), 8, 40)  # warm-up and graph captures on cuda:1 too
    there = engine.generate(PROMPTS, 40, **kw)
    assert torch.cuda.current_device() == 0  # the caller's device, restored
    assert engine.cache.k.device == torch.device("cuda", 1)
    engine.release()
    # the same GPU model, kernels and seeds: the same samples, bit for bit
    assert [(c.token_ids, c.logprobs) for c in there] == [(c.token_ids, c.logprobs) for c in here]
