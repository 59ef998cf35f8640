"""Data-parallel training through `accelerate launch` on a CPU (gloo): the distributed path CI can run.

The embedded-model preset runs in 2 processes and matches the same global batch on one process (rewards and
token counts exactly, losses to float rounding), and a one-process checkpoint resumes on 2 processes to the
same end; bad splits of a step over the processes fail in one line before any model loads. (Multi-GPU speed
is a GPU benchmark, not a test.)
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.train.grpo import accumulation_steps, world
from qerl_lib.train.metrics import PICKLED_ARGS, SIDE_STATE, checkpoint_problem
from qerl_lib.train.presets import make_config

REPO = Path(__file__).resolve().parents[1]


# the calibrated task at its easiest level (the bf16 base gets some right, so groups have a reward spread; the
# NVFP4 base rarely does at this size), AQN noise on the rollouts (σ > 0 from the second rollout on), rollouts
# of 2 prompts x 8 completions of <= 32 tokens in micro-batches of 4, μ = 2: 4 optimizer steps = 2 rollouts
TRAIN = ["train", "--preset", "smollm2-expr", "--level", "1", "--base", "bf16", "--aqn", "rollout", "--steps", "4",
         "--prompts-per-step", "2", "--micro-batch", "4", "--save-steps", "2", "--save-total-limit", "2"]
LAUNCH_2 = [sys.executable, "-m", "accelerate.commands.launch", "--cpu", "--num_processes", "2",
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no", "-m", "qerl_lib"]


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def _adapter(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "adapter" / "adapter_model.safetensors"))


def test_two_processes_sample_and_learn_what_one_process_does(tmp_path, embedded_model_dir):
    """~3.5 min on 2 cores. The same global batch on 1 and on 2 processes (gloo): every completion samples
    from its own seeded stream, so both draw the same rollouts, TRL gathers the same rewards for the group
    advantages, and the all-reduced gradient equals the one-process accumulated one up to float rounding.
    Then the one-process run's step-2 checkpoint resumes on 2 processes and ends where the one-process run
    ended."""
    one, two = tmp_path / "one", tmp_path / "two"
    single = subprocess.run([sys.executable, "-m", "qerl_lib", *TRAIN, "--out", str(one)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    assert single.returncode == 0, single.stderr[-3000:]
    proc = subprocess.run([*LAUNCH_2, *TRAIN, "--out", str(two)], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]

    rows = _metrics(two)
    assert [r["step"] for r in rows] == [1, 3], "metrics must come from one process, one line per rollout (μ = 2)"
    assert (two / "adapter" / "adapter_config.json").is_file() and (two / "summary.json").is_file()
    checkpoints = sorted(p for p in (two / "checkpoints").iterdir() if p.name.startswith("checkpoint-"))
    assert checkpoints
    for checkpoint in checkpoints:  # process 0's marker waited for process 1's files (RunMetrics.on_save)
        assert checkpoint_problem(checkpoint) is None, checkpoint
        listed = json.loads((checkpoint / SIDE_STATE).read_text())["files"]
        rng = {p.name for p in checkpoint.iterdir() if p.name.startswith("rng_state")}  # one a process on GPUs
        assert rng and rng <= set(listed), (sorted(rng), sorted(listed))
        assert not (checkpoint / PICKLED_ARGS).exists(), "a pickle nothing reads"
    assert proc.stdout.count("done: 4 steps (2 rollouts)") == 1, "only the first process reports"
    summary = json.loads((two / "summary.json").read_text())
    assert (summary["steps"], summary["rollouts"]) == (4, 2)

    reference = _metrics(one)
    assert any(r["reward_std"] > 0 for r in reference), "the comparison needs groups with a reward spread"
    assert reference[-1]["sigma"] > 0, "and AQN noise in a rollout"
    assert any(r["grad_norm"] > 0 for r in reference), "and a gradient (the logged on-policy loss is 0.0)"
    for a, b in zip(reference, rows):
        step = a["step"]
        # the same tokens: exact counts and rewards (the rollouts match token for token)
        for key in ("reward", "reward_std", "accuracy", "completion_length", "num_tokens", "truncated_rate"):
            assert a[key] == pytest.approx(b[key], abs=1e-6), (step, key, a[key], b[key])
        # the same losses up to float32 summation order (batch 16 vs 2 x 8 matmuls, all-reduce vs accumulation)
        for key in ("entropy", "loss", "grad_norm", "logprob_mismatch"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-5), (step, key, a[key], b[key])

    # resume on another number of processes: the one-process run's checkpoint-2, continued by two processes
    resumed = tmp_path / "resumed"
    shutil.copytree(one, resumed)
    shutil.rmtree(resumed / "checkpoints" / "checkpoint-4")
    proc = subprocess.run([*LAUNCH_2, *TRAIN, "--out", str(resumed), "--resume"], cwd=REPO, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming from checkpoint-2" in proc.stdout + proc.stderr
    for a, b in zip(reference, _metrics(resumed), strict=True):
        for key in ("reward", "completion_length", "num_tokens", "sigma", "learning_rate"):
            assert a[key] == pytest.approx(b[key], abs=1e-9), (a["step"], key, a[key], b[key])
        assert a["entropy"] == pytest.approx(b["entropy"], rel=1e-3), a["step"]
    final, continued = _adapter(one), _adapter(resumed)
    assert final.keys() == continued.keys()
    for name, tensor in final.items():
        torch.testing.assert_close(continued[name], tensor, rtol=1e-4, atol=1e-6, msg=name)


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


@pytest.mark.parametrize("local_rank, expected", [(None, "cuda"), ("0", "cuda:0"), ("1", "cuda:1")])
def test_each_launched_process_takes_its_own_gpu_before_the_model_loads(monkeypatch, local_rank, expected):
    """Under `accelerate launch` the model is built before TRL's accelerator exists: `resolve_device` must already
    name (and make current) the process's GPU, or every process builds its model on GPU 0."""
    from qerl_lib.train import grpo

    made_current = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", made_current.append)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    config = make_config("smollm2-arith", mode="lora", device="cuda", optim="adamw_torch")
    device = grpo.resolve_device(config)
    assert str(device) == expected
    assert made_current == ([] if local_rank is None else [device])


def test_a_launch_with_more_processes_than_gpus_is_one_line(monkeypatch):
    from qerl_lib.train import grpo

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: pytest.fail("no device should be made current"))
    monkeypatch.setenv("LOCAL_RANK", "1")
    config = make_config("smollm2-arith", mode="lora", device="cuda", optim="adamw_torch")
    with pytest.raises(UserError, match="--num-gpus at most the GPU count"):
        grpo.resolve_device(config)


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (one process on a multi-GPU machine)")
def test_one_process_on_a_machine_with_several_gpus_trains_on_one(tmp_path, monkeypatch):
    """Without a launcher, transformers' `Trainer` counts every visible GPU and would wrap the model in
    nn.DataParallel, which TRL's GRPO trainer refuses at construction: a one-GPU run on a 2-GPU machine failed so."""
    from qerl_lib.train.trainer import grpo_args

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    config = make_config("smollm2-arith", mode="lora", device="cuda")
    args = grpo_args(config, tmp_path / "checkpoints", torch.device("cuda"), [1.0])
    assert args.n_gpu == 1 and args.device == torch.device("cuda", 0)


def test_the_rollout_phase_is_the_slowest_processs():
    """With several processes `rollout_seconds` is the longest engine time (the others wait for it at the rewards'
    gather), so `train_seconds` holds no wait; one process reports its own time and gathers nothing."""
    from types import SimpleNamespace

    from qerl_lib.train.grpo import slowest_process

    sent = []
    two = SimpleNamespace(num_processes=2, device=torch.device("cpu"),
                          gather=lambda t: sent.append(t) or torch.tensor([t.item(), 3.5], dtype=t.dtype))
    assert slowest_process(1.25, two) == 3.5 and sent[0].dtype == torch.float64 and sent[0].item() == 1.25
    sent.clear()
    assert slowest_process(4.0, two) == 4.0
    one = SimpleNamespace(num_processes=1, gather=lambda t: pytest.fail("one process gathers nothing"))
    assert slowest_process(1.25, one) == 1.25
