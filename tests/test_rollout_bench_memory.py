"""`qerl bench rollout`'s `weights_gib` on a GPU: what building the model allocated, whatever an earlier build of
the same process left allocated."""

from __future__ import annotations

import pytest
import torch


def _tensor_bytes(model) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total


@pytest.mark.cuda
def test_weights_gib_is_the_models_own_memory_in_a_second_sweep_of_the_process():
    from qerl_lib.bench.rollout import RolloutBenchConfig, load_bench_model, run_rollout_bench

    expected = _tensor_bytes(load_bench_model("smollm2-shape", "bf16", torch.device("cpu"))) / 2**30
    cfg = RolloutBenchConfig(models=("smollm2-shape",), weights=("bf16",), batches=(1,), lora_ranks=(0,),
                             prompt_len=8, gen_len=4, repeats=1, hf_baseline=False)
    for _ in range(2):  # the second sweep starts with whatever the first left allocated
        (row,) = run_rollout_bench(cfg, log=lambda *a: None)["rows"]
        assert row["error"] is None, row["error"]
        assert row["weights_gib"] == pytest.approx(expected, rel=0.02), (row["weights_gib"], expected)
