"""`qerl bench train` on a CPU with a tiny random architecture: the real trainer runs, rows add up, a failing
case becomes a row with its error (speed targets live in the benchmark, not here)."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.studies.train_bench import TrainCase, add_speedups, case_config, format_bench, run_bench


@pytest.fixture(scope="module")
def tiny_arch(tmp_path_factory):
    from transformers import LlamaConfig

    folder = tmp_path_factory.mktemp("arch")
    LlamaConfig(vocab_size=50000, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=True).save_pretrained(folder)
    return str(folder / "config.json")


def test_cases_run_the_real_trainer_and_rows_add_up(tiny_arch):
    cases = [TrainCase(model=tiny_arch, mode=mode, batch=4, prompt_len=48, gen_len=12, steps=2, lora_rank=4,
                       gradient_checkpointing=False, device="cpu") for mode in ("lora", "nvfp4")]
    record = run_bench(cases, progress=False)
    assert {"device", "versions", "date", "command"} <= set(record["provenance"])
    for row in record["rows"]:
        assert row["error"] is None, row["error"]
        assert row["completion_len"] == 12  # random weights: every completion runs to gen_len
        assert row["step_s"] == pytest.approx(row["rollout_s"] + row["train_s"], rel=1e-6)
        assert 0 < row["rollout_s"] < row["step_s"]
        assert len(row["train_s_steps"]) == len(row["rollout_s_steps"]) == row["steps_measured"] == 1
        assert row["train_s_steps"] == [pytest.approx(row["train_s"])]  # the median of one step is that step
        assert row["tokens_per_s"] == pytest.approx(12 * 4 / row["step_s"])
        assert row["peak_gib"] == pytest.approx(row["peak_gb"] * 1e9 / 2**30) and row["peak_gb"] > 0  # units
        parts = [row[k] for k in ("base_weights_gib", "lora_gib", "grads_gib", "optimizer_gib", "kv_cache_gib")]
        assert all(p > 0 for p in parts) and sum(parts) < row["peak_gib"], parts
    lora, nvfp4 = record["rows"]
    assert lora["speedup_vs_lora"] == pytest.approx(1.0)
    assert nvfp4["speedup_vs_lora"] == pytest.approx(lora["step_s"] / nvfp4["step_s"])
    assert "lora" in format_bench(record)
    json.dumps(record)  # the record is plain JSON


def test_a_failing_case_is_a_row_with_its_error(tiny_arch):
    record = run_bench([TrainCase(model=tiny_arch, mode="lora", batch=2, prompt_len=48, gen_len=8, steps=2,
                                  device="cuda-that-does-not-exist")], progress=False)
    (row,) = record["rows"]
    assert row["error"] and row.get("step_s") is None
    add_speedups(record["rows"])
    assert row["speedup_vs_lora"] is None


def test_bad_cases_fail_before_anything_runs(tiny_arch):
    with pytest.raises(UserError, match="mode"):
        TrainCase(mode="full")
    with pytest.raises(UserError, match="at least 2"):
        TrainCase(steps=1)
    with pytest.raises(UserError, match="unknown preset 'qwen2.5-9b-gsm8k'"):
        case_config(TrainCase(model="qwen2.5-9b", device="cpu"))
    with pytest.raises(UserError, match="random weights need an architecture"):
        case_config(TrainCase(model="/nonexistent/config.json", device="cpu"))
    config = case_config(TrainCase(model="qwen2.5-32b", mode="qerl", batch=2, device="cpu"))
    assert (config.model, config.base, config.aqn, config.gradient_checkpointing) == ("random:qwen2.5-32b", "nvfp4",
                                                                                        True, True)


def test_preset_cases_run_the_preset_settings_with_synthetic_inputs():
    """`TrainCase.from_preset` (`qerl bench train --preset-settings`): the config keeps every setting of the
    preset that decides time and memory; only the weights, prompts and reward are synthetic."""
    from qerl_lib.train.presets import make_config

    for model, mode in (("qwen2.5-7b", "qerl"), ("qwen2.5-14b", "lora"), ("qwen2.5-7b", "qlora")):
        preset = make_config(f"qwen2.5-{model.split('-')[1]}-gsm8k", mode=mode)
        config = case_config(TrainCase.from_preset(model, mode, device="cpu"))
        same = ("prompts_per_step", "num_generations", "micro_batch", "num_iterations", "max_prompt_tokens",
                "max_completion_length", "rollout_batch", "lora_rank", "gradient_checkpointing", "base", "aqn")
        assert {k: getattr(config, k) for k in same} == {k: getattr(preset, k) for k in same}
        assert (config.model, config.data, config.steps) == (f"random:{model}", "random", 3)
    assert case_config(TrainCase.from_preset("qwen2.5-7b", "qerl", num_iterations=1, device="cpu")).num_iterations == 1
    assert case_config(TrainCase(model="qwen2.5-7b", device="cpu")).num_iterations == 1  # the bench's own cases


def test_preset_settings_refuse_flags_that_would_change_them(capsys):
    from qerl_lib.cli import main

    assert main(["bench", "train", "--preset-settings", "--batches", "2", "--models", "qwen2.5-7b"]) != 0
    assert "--preset-settings runs the preset's own settings: drop --batches" in capsys.readouterr().err


def test_data_parallel_cases_carry_num_gpus_and_the_speedup_over_one(tiny_arch):
    """The same case on 1 and on 2 processes (accelerate, gloo on CPU): both run, the 2-process row carries
    num_gpus and speedup_vs_1gpu (a CPU says nothing about GPU scaling; the field is what is tested)."""
    cases = [TrainCase(model=tiny_arch, mode="lora", batch=4, groups=2, num_gpus=n, prompt_len=48, gen_len=8, steps=2,
                       lora_rank=4, gradient_checkpointing=False, device="cpu") for n in (1, 2)]
    one, two = run_bench(cases, progress=False)["rows"]
    assert one["error"] is None and two["error"] is None, (one["error"], two["error"])
    assert (one["num_gpus"], two["num_gpus"]) == (1, 2)
    assert one["speedup_vs_1gpu"] == pytest.approx(1.0)
    assert two["speedup_vs_1gpu"] == pytest.approx(one["step_s"] / two["step_s"])
    with pytest.raises(UserError, match="GPUs the groups"):
        TrainCase(batch=8, groups=1, num_gpus=2)


def test_merged_lora_rows_run_and_get_their_own_speedup_column(tiny_arch):
    """Mode lora with ``rollout_lora_merge`` runs through the real trainer (the merged engine on CPU); lora rows keep
    the unmerged row as their reference (the paper's baseline) and every row gets ``speedup_vs_lora_merged``."""
    base = dict(model=tiny_arch, batch=4, prompt_len=48, gen_len=8, steps=2, lora_rank=4, gradient_checkpointing=False,
                device="cpu")
    cases = [TrainCase(mode="lora", **base), TrainCase(mode="lora", rollout_lora_merge=True, **base),
             TrainCase(mode="nvfp4", **base)]
    record = run_bench(cases, progress=False)
    lora, merged, nvfp4 = record["rows"]
    assert all(r["error"] is None for r in record["rows"]), [r["error"] for r in record["rows"]]
    assert (lora["rollout_lora_merge"], merged["rollout_lora_merge"]) == (False, True)
    assert merged["speedup_vs_lora"] == pytest.approx(lora["step_s"] / merged["step_s"])
    assert merged["speedup_vs_lora_merged"] == pytest.approx(1.0)
    assert nvfp4["speedup_vs_lora_merged"] == pytest.approx(merged["step_s"] / nvfp4["step_s"])
    assert lora["speedup_vs_1gpu"] == merged["speedup_vs_1gpu"] == pytest.approx(1.0)  # each is its own 1-GPU row
    assert "lora+m" in format_bench(record)
    assert case_config(cases[1]).rollout_lora_merge and not case_config(cases[0]).rollout_lora_merge


def test_merge_is_refused_for_quantized_modes_and_bad_flag_values(capsys):
    from qerl_lib.cli import main

    with pytest.raises(UserError, match="only mode lora"):
        TrainCase(mode="qerl", rollout_lora_merge=True)
    assert main(["bench", "train", "--rollout-lora-merge", "maybe"]) != 0
    assert "--rollout-lora-merge takes off, on or off,on" in capsys.readouterr().err
    case = TrainCase.from_preset("qwen2.5-14b", "lora", rollout_lora_merge=True, device="cpu")
    assert case.rollout_lora_merge and case.rollout_batch < 32  # the rows that fit beside the copy


def test_gsm8k_like_workload_stops_each_row_at_its_drawn_length(tiny_arch, tmp_path):
    """With workload gsm8k-like every rollout's rows stop at lengths drawn afresh for that step (bench.workloads),
    so the trainer sees uneven lengths that change from step to step; "fixed" keeps one budget, gen_len."""
    from qerl_lib.bench.workloads import sample_lengths
    from qerl_lib.io import read_jsonl
    from qerl_lib.studies.train_bench import completion_budgets, run_case_here

    assert completion_budgets(TrainCase(device="cpu")) is None
    case = TrainCase(model=tiny_arch, mode="lora", batch=4, prompt_len=48, gen_len=64, steps=3, lora_rank=4,
                     gradient_checkpointing=False, device="cpu", workload="gsm8k-like")
    draws = [sample_lengths("gsm8k-like", 4, 64, seed=1000 * step) for step in range(3)]
    assert completion_budgets(case)(4, 1, 0) == draws[1]
    assert len({tuple(d) for d in draws}) == 3 and all(min(d) < max(d) for d in draws), draws  # uneven, changing
    row = run_case_here(case, tmp_path)
    assert row["steps_measured"] == 2
    assert format_bench({"rows": [{**asdict(case), **row, "error": None}]}).startswith("completion lengths: gsm8k-like")
    logged = [r["completion_length"] for r in read_jsonl(tmp_path / "metrics.jsonl") if "completion_length" in r]
    # every row ran to its budget: this seeded run samples no stop token (p ~ 1/50000 a token) before it
    assert logged == [pytest.approx(sum(d) / 4) for d in draws]
    with pytest.raises(UserError, match="workload"):
        TrainCase(workload="uneven")


def test_cli_workload_reaches_every_case(monkeypatch, capsys):
    """`qerl bench train --workload gsm8k-like` sets each case's workload, with or without --preset-settings."""
    from qerl_lib.cli import main
    from qerl_lib.studies import train_bench

    seen = []

    def fake_run_bench(cases, progress=True):
        seen.extend(cases)
        return {"provenance": {}, "rows": []}

    monkeypatch.setattr(train_bench, "run_bench", fake_run_bench)
    monkeypatch.setattr(train_bench, "format_bench", lambda record: "")
    assert main(["bench", "train", "--modes", "lora,qerl", "--workload", "gsm8k-like"]) == 0
    assert main(["bench", "train", "--preset-settings", "--modes", "qerl", "--workload", "gsm8k-like"]) == 0
    assert main(["bench", "train", "--modes", "qerl"]) == 0
    assert [c.workload for c in seen] == ["gsm8k-like"] * 3 + ["fixed"]
    assert seen[2].preset == "qwen2.5-7b-gsm8k"
    assert all(c.pad_to_multiple_of is None for c in seen)  # the preset's
    assert {train_bench.padding_of(c) for c in seen} == {64}
    seen.clear()
    assert main(["bench", "train", "--modes", "qerl", "--pad-to-multiple-of", "0,64"]) == 0
    assert main(["bench", "train", "--preset-settings", "--modes", "qerl", "--pad-to-multiple-of", "32"]) == 0
    assert [c.pad_to_multiple_of for c in seen] == [0, 64, 32]
    assert [train_bench.padding_of(c) for c in seen] == [None, 64, 32]
    assert [train_bench.case_config(c).pad_to_multiple_of for c in seen] == [0, 64, 32]


def test_train_cli_refuses_a_bad_padding_in_one_line(capsys):
    from qerl_lib.cli import main

    assert main(["train", "--preset", "smollm2-arith-cpu", "--pad-to-multiple-of", "-8"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pad_to_multiple_of=-8" in err[0], err


def test_padding_classes_reach_the_trainers_batches(tiny_arch, tmp_path, monkeypatch):
    """pad_to_multiple_of puts every trainer batch's prompt and completion lengths on multiples of it (TRL's
    padding), on uneven rollouts; unset, the completions are padded to the batch's longest only. It is recorded in
    the run's settings only when set, and a bad value is a one-line error."""
    from qerl_lib.studies.train_bench import run_case_here
    from qerl_lib.train import trainer as trainer_module
    from qerl_lib.train.presets import describe, make_config
    from qerl_lib.train.trainer import grpo_args

    cls = trainer_module.trainer_class()
    original, seen = cls.compute_loss, []

    def spy(self, model, inputs, *a, **kw):
        seen.append((inputs["prompt_ids"].shape[1], inputs["completion_ids"].shape[1]))
        return original(self, model, inputs, *a, **kw)

    monkeypatch.setattr(cls, "compute_loss", spy)
    common = dict(model=tiny_arch, mode="lora", batch=4, prompt_len=48, gen_len=64, steps=2, lora_rank=4,
                  gradient_checkpointing=False, device="cpu", workload="gsm8k-like")
    run_case_here(TrainCase(**common, pad_to_multiple_of=32), tmp_path / "pad32")
    padded, seen[:] = list(seen), []
    run_case_here(TrainCase(**common, pad_to_multiple_of=0), tmp_path / "longest")
    assert padded and all(p % 32 == 0 and c % 32 == 0 for p, c in padded), padded
    assert any(c % 32 for _, c in seen), seen  # the drawn lengths are not multiples of 32 by themselves
    assert [c for _, c in padded] == [-(-c // 32) * 32 for _, c in seen]
    config = make_config("smollm2-arith-cpu", pad_to_multiple_of=64)
    assert config.to_dict()["pad_to_multiple_of"] == 64
    assert "pad_to_multiple_of" not in make_config("smollm2-arith-cpu").to_dict()
    assert grpo_args(config, tmp_path / "c", torch.device("cpu"), [1.0, 0.2]).pad_to_multiple_of == 64
    for bad in (-8, 2.5, True):
        with pytest.raises(UserError, match="pad_to_multiple_of"):
            make_config("smollm2-arith-cpu", pad_to_multiple_of=bad)
    # the Qwen2.5 presets pad to 64 (dev/LOG.md 89); 0 turns it off: TRL's padding, and not recorded
    qwen = make_config("qwen2.5-7b-gsm8k")
    assert qwen.pad_to_multiple_of == 64 and qwen.to_dict()["pad_to_multiple_of"] == 64
    off = make_config("qwen2.5-7b-gsm8k", pad_to_multiple_of=0)
    assert "pad_to_multiple_of" not in off.to_dict()
    assert "padded to multiples of 64" in describe(qwen) and "padded" not in describe(off)  # the run's start lines
    assert grpo_args(off, tmp_path / "d", torch.device("cpu"), [1.0, 0.2]).pad_to_multiple_of is None


def test_dry_run_checks_every_case_and_its_config_and_runs_nothing(monkeypatch, capsys):
    """`--dry-run` (a GPU job's commands checked on the CPU first): every case and its trainer config is built and
    listed, the bench itself never starts; a case that cannot run is the usual one-line error."""
    from qerl_lib.cli import main
    from qerl_lib.studies import train_bench

    built = []
    original = train_bench.case_config
    monkeypatch.setattr(train_bench, "run_bench", lambda *a, **k: pytest.fail("--dry-run started the bench"))
    monkeypatch.setattr(train_bench, "case_config", lambda case: built.append(case) or original(case))
    argv = ["bench", "train", "--models", "qwen2.5-7b,qwen2.5-32b", "--modes", "lora,qerl", "--batches", "2,8",
            "--rollout-lora-merge", "off,on", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(built) == 12 and out[-1] == "12 case(s) checked; nothing ran (--dry-run)"  # lora twice: merged or not
    assert "qwen2.5-32b lora+m batch 8 (1 group(s), 1 GPU(s)), 256 + 2048 tokens, r32, 4 steps" in out
    assert main(["bench", "train", "--batches", "64", "--groups", "2", "--num-gpus", "4", "--dry-run"]) == 2
    assert "the groups must divide the batch, and the GPUs the groups" in capsys.readouterr().err
