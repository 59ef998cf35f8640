"""Data-parallel training through `accelerate launch` on a CPU (gloo): the distributed path CI can run.

The embedded-model preset runs 2 steps in 2 processes; bad splits of a step over the processes fail in one
line before any model loads. (Multi-GPU speed and trajectory equality are GPU benchmarks, not tests.)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from qerl_lib.errors import UserError
from qerl_lib.train.grpo import accumulation_steps, world
from qerl_lib.train.presets import make_config

REPO = Path(__file__).resolve().parents[1]


def test_two_processes_train_two_steps_and_write_once(tmp_path, embedded_model_dir):
    """~75 s on 2 cores: two processes each load the embedded model and run their own rollout engine."""
    out = tmp_path / "run"
    command = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
               "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
               "-m", "qerl_lib", "train", "--preset", "smollm2-arith-cpu", "--mode", "lora", "--steps", "2",
               "--prompts-per-step", "2", "--micro-batch", "2", "--save-steps", "1", "--out", str(out)]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2], "metrics must come from one process, one line per step"
    assert (out / "adapter" / "adapter_config.json").is_file() and (out / "summary.json").is_file()
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("checkpoint-"))
    assert proc.stdout.count("done: 2 steps") == 1, "only the first process reports"


@pytest.mark.parametrize("world_size, overrides, message", [
    (2, dict(prompts_per_step=1), "2 processes but 1 prompt"),
    (2, dict(prompts_per_step=2, num_generations=3, micro_batch=2), "do not split into micro-batches of 2 on 2"),
    (4, dict(prompts_per_step=4, num_generations=4, micro_batch=8), "do not split into micro-batches of 8 on 4"),
])
def test_a_step_that_does_not_split_over_the_processes_is_one_line(monkeypatch, world_size, overrides, message):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    config = make_config("smollm2-arith-cpu", mode="lora", device="cpu", **overrides)
    with pytest.raises(UserError, match=message):
        accumulation_steps(config)


def test_the_global_batch_does_not_change_with_the_number_of_processes(monkeypatch):
    config = make_config("smollm2-arith-cpu", mode="lora", device="cpu", prompts_per_step=4, num_generations=4,
                         micro_batch=2)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert world() == (0, 1) and accumulation_steps(config) == 8
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert accumulation_steps(config) * config.micro_batch * 2 == config.completions_per_step == 16
