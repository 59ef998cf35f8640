"""`qerl sweep` on a CPU with the tiny random Llama of tests/test_grpo.py (no GPU, no network).

Covers: a 2-arm x 2-seed sweep run through the CLI, killed with SIGTERM mid-run and run again,
finishing every run without rewriting (or relaunching) the finished one; the ablation flags (bf16
base + AQN on the rollout) reaching the trainer's rollout, with every RMSNorm weight left as
loaded; and the concurrency-vs-GPU-memory check and CLI spec errors as one line before anything
runs. Spec validation of `plan_runs` itself is in tests/test_claims_task.py.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.studies import sweep
from test_grpo import read_lines, tiny_config  # shared tiny-model helpers

REPO = Path(__file__).resolve().parents[1]
RUNS = {"lora-s0", "lora-s1", "qerl-s0", "qerl-s1"}


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):  # conftest.py
    yield


def write_spec(path: Path, model_dir: Path) -> Path:
    common = dict(model=str(model_dir), steps=2, n_train=4, max_prompt_tokens=1024, prompts_per_step=2,
                  num_generations=2, micro_batch=2, max_completion_length=6, save_steps=1, device="cpu",
                  optim="adamw_torch")
    spec = {"name": "tiny", "preset": "smollm2-arith", "seeds": [0, 1], "concurrency": 1,
            "common": common, "eval": {"n": 4, "samples": 2},
            "arms": [{"name": "lora", "mode": "lora"}, {"name": "qerl", "mode": "qerl"}]}
    path.write_text(json.dumps(spec))
    return path


# ------------------------------------------------------------------------------------------ resumable sweep
def test_sweep_runs_is_killed_and_resumes_without_rerunning(tiny_dir, tmp_path):
    """30-40 s on 2 cores: two CLI invocations of a 4-run sweep (2 steps per run, tiny model)."""
    spec, out = write_spec(tmp_path / "spec.json", tiny_dir), tmp_path / "sweep"
    command = [sys.executable, "-m", "qerl_lib", "sweep", str(spec), "--out", str(out), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}  # two workers on two cores
    runs = out / "runs"

    def finished() -> set[str]:
        return {p.parent.name for p in runs.glob("*/result.json")}

    # 1. one run at a time; SIGTERM to the sweep once lora-s0 has finished and the next run has started
    #    training (its run.json is written, a second before its first checkpoint)
    proc = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not ((runs / "lora-s0" / "result.json").is_file() and (runs / "lora-s1/train/run.json").is_file()):
            assert proc.poll() is None and time.monotonic() < deadline, "the sweep stopped before its second run"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    for _ in range(50):  # the sweep took its worker down with it
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("a worker outlived the killed sweep")
    assert finished() == {"lora-s0"}, "lora-s1 finished before the kill: nothing was interrupted"
    kept = {name: ((runs / name / "result.json").stat().st_mtime_ns, (runs / name / "result.json").read_bytes(),
                   (runs / name / "log.txt").read_bytes()) for name in finished()}

    # 2. the same command again, two at once: the rest finish; the finished one is neither rerun nor rewritten
    last = subprocess.run(command + ["--concurrency", "2"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert last.returncode == 0, last.stderr[-2000:]
    assert finished() == RUNS
    for name, (mtime, data, log) in kept.items():
        result = runs / name / "result.json"
        assert (result.stat().st_mtime_ns, result.read_bytes(), (runs / name / "log.txt").read_bytes()) == \
            (mtime, data, log), f"{name} was rerun or rewritten"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n_runs_finished"] == summary["n_runs_planned"] == 4
    assert {(r["arm"], r["seed"]) for r in summary["runs"]} == {("lora", 0), ("lora", 1), ("qerl", 0), ("qerl", 1)}
    assert all(isinstance(r["heldout_pass1"], float) and r["steps"] == 2 for r in summary["runs"])
    for name in RUNS:
        train = runs / name / "train"
        assert [r["step"] for r in read_lines(train)] == [1, 2], f"{name}: killed run did not restart cleanly"
        assert not (train / "checkpoints").exists() and not (train / "adapter").exists(), f"{name} kept weights"


# ------------------------------------------------------------------------------------------ ablation flags
def test_ablation_flags_reach_the_trainer(tiny_dir, tmp_path, monkeypatch):
    """bf16 + AQN on the rollout: the step-2 rollout (σ = 1e-2; stage 0 is clean by design) samples with
    noisy RMSNorm weights, so its log-probs differ from the same seed's run without AQN, while step 1's are
    identical. Either way every norm weight of the trained model is the one on disk."""
    from safetensors.torch import load_file

    from qerl_lib.engine.rollout import RolloutEngine
    from qerl_lib.train.grpo import build_trainer

    calls: list = []
    generate = RolloutEngine.generate

    def recording(self, *args, **kwargs):
        completions = generate(self, *args, **kwargs)
        calls.append((sorted(kwargs.get("norm_overrides") or {}), [list(c.token_ids) for c in completions],
                      [list(c.logprobs) for c in completions]))
        return completions

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    on_disk = {k: v for k, v in load_file(tiny_dir / "model.safetensors").items() if "norm" in k}
    assert len(on_disk) == 5  # 2 layers x (input, post-attention) + the final norm
    seen = {}
    for target in ("rollout", "off"):
        config = tiny_config(tiny_dir, None, base_format="bf16", aqn_target=target)
        assert config.base == "bf16" and config.noise_target == target
        calls.clear()
        trainer = build_trainer(config, tmp_path / target, quiet=True)
        trainer.train()
        params = dict(trainer.model.named_parameters())
        for key, weight in on_disk.items():
            (live,) = [p for n, p in params.items() if n.endswith(key)]
            assert torch.equal(live.detach(), weight), f"aqn {target}: {key} differs from the loaded model"
        lines = read_lines(tmp_path / target)
        assert [r["sigma"] for r in lines] == ([0.0, 1e-2] if target == "rollout" else [0.0, 0.0])
        assert (lines[1]["noise_rms"] > 0) == (target == "rollout")
        assert len(calls) == 2, "one rollout per step expected"
        seen[target] = list(calls)
    noisy, clean = seen["rollout"], seen["off"]
    assert noisy[0][0] == [] and clean[0][0] == clean[1][0] == []  # no overrides without noise
    assert noisy[1][0] and all("layernorm" in name for name in noisy[1][0])
    assert noisy[0][1:] == clean[0][1:], "step 1 (σ = 0) must sample identically in both runs"
    assert noisy[1][1:] != clean[1][1:], "AQN on the rollout left the step-2 rollout unchanged"


# ------------------------------------------------------------------------------------------ errors up front
def test_concurrency_above_gpu_memory_is_one_clear_line(tiny_dir, tmp_path, monkeypatch, capsys):
    from qerl_lib.cli import main

    monkeypatch.setattr(sweep, "_gpu_memory_gib", lambda: 80.0)
    cpu_raw = json.loads(write_spec(tmp_path / "spec.json", tiny_dir).read_text())
    raw = {**cpu_raw, "common": {k: v for k, v in cpu_raw["common"].items() if k != "device"}}  # device "auto"
    spec = sweep.parse_spec({**raw, "concurrency": 12, "run_memory_gib": 7.5})
    with pytest.raises(UserError, match=r"concurrency 12 x run_memory_gib 7.5 GiB .* 80 GiB: use concurrency <= 9"):
        sweep.resolve_concurrency(spec, 4)
    assert sweep.resolve_concurrency(spec, 4, device="cpu") == 12  # no GPU memory to check on a CPU
    assert sweep.resolve_concurrency(sweep.parse_spec({**cpu_raw, "concurrency": 12, "run_memory_gib": 7.5}), 4) == 12
    assert sweep.resolve_concurrency(sweep.parse_spec({**raw, "concurrency": "auto", "run_memory_gib": 7.5}), 20) == 8
    assert sweep.resolve_concurrency(sweep.parse_spec({**raw, "concurrency": 9, "run_memory_gib": 7.5}), 4) == 9

    # the CLI: one line on stderr, exit 2, and nothing written or loaded
    import qerl_lib.train.grpo as grpo

    monkeypatch.setattr(grpo, "load_base", lambda *a, **k: pytest.fail("a model was loaded"))
    path = tmp_path / "big.json"
    path.write_text(json.dumps({**raw, "concurrency": 12, "run_memory_gib": 7.5}))
    out = tmp_path / "out"
    cases = [([], "use concurrency <= 9"),
             (["--concurrency", "9", "--set", "learnig_rate=1"], r"unknown or misplaced field\(s\) \['learnig_rate'\]"),
             (["--concurrency", "9", "--set", "seed=3"], r"misplaced field\(s\) \['seed'\]"),
             (["--concurrency", "9", "--set", "base_format=nvfp4"], "arm 'lora': mode lora trains on a bf16 base"),
             (["--concurrency", "9", "--set", "mode=qerl"], r"--set mode=\.\.\.: arm\(s\) \['lora', 'qerl'\] set 'mode'"),
             (["--concurrency", "0"], "--concurrency '0'")]
    for extra, message in cases:
        capsys.readouterr()
        assert main(["sweep", str(path), "--out", str(out), *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("qerl sweep: error:"), err
        assert re.search(message, err), (extra, err)
        assert not out.exists(), f"{extra}: the sweep wrote {out} before failing"
    assert main(["sweep", str(path), "--concurrency", "9", "--check"]) == 0
    assert "4 runs (2 arms x 2 seeds), 9 at once" in capsys.readouterr().out


def test_a_run_folder_takes_one_worker_at_a_time(tmp_path):
    """A worker left running by a SIGKILLed sweep holds its run's lock: a rerun's worker for that run stops with
    one line (two trainers would write the same checkpoints); once the first ends, the lock is free again."""
    from qerl_lib.studies.sweep import _hold_run_lock, run_one

    folder = tmp_path / "runs" / "arm-s0"
    folder.mkdir(parents=True)
    first = _hold_run_lock(folder)
    with pytest.raises(UserError, match="another worker is running .*arm-s0"):
        run_one(folder)  # refused before it reads anything of the run
    first.close()  # the first worker ends (the OS drops its lock the same way when it is killed)
    _hold_run_lock(folder).close()
