"""`qerl train --report-to`: TRL's trackers receive the step metrics under the kit's names, in the run folder.

A 2-step run of the tiny random Llama of tests/test_grpo.py with ``report_to="tensorboard"`` writes
TensorBoard event files into ``OUT/tensorboard`` whose scalars are named like the keys of
``metrics.jsonl`` (``train/accuracy``, not TRL's ``train/rewards/accuracy/mean``) and hold the same
values, while ``metrics.jsonl`` keeps its format. Bad values, and a tracker whose package is missing,
fail in `make_config` as one line, before any model loads.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch

from qerl_lib.errors import UserError
from qerl_lib.train.metrics import METRIC_KEYS, RENAMES
from qerl_lib.train.presets import make_config
from test_grpo import tiny_config, toy_reward  # shared tiny-model helpers

# kit names (metrics.jsonl keys) that must reach the tracker, TRL's own and the kit's additions
TRACKED = ("reward", "accuracy", "format_rate", "entropy", "zero_std_groups", "clip_ratio", "sigma", "noise_rms",
           "logprob_mismatch", "rollout_tokens", "rollout_tokens_per_s")


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):  # conftest.py
    yield


def test_tensorboard_scalars_carry_the_kit_names_and_the_jsonl_values(tiny_dir, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from qerl_lib.train.grpo import train

    train(tiny_config(tiny_dir, "qerl", report_to="tensorboard"), tmp_path,
          extra_rewards=[("toy", toy_reward, 1.0)], quiet=True)

    events = sorted((tmp_path / "tensorboard").rglob("events.out.tfevents.*"))
    assert events, f"no TensorBoard event file under {tmp_path / 'tensorboard'}"
    assert not (tmp_path / "checkpoints" / "runs").exists(), "TensorBoard wrote to transformers' default folder"
    accumulator = EventAccumulator(str(events[0].parent), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = set(accumulator.Tags()["scalars"])
    trl_names = sorted(f"train/{name}" for name in RENAMES if f"train/{name}" in tags)
    assert not trl_names, f"TRL's names reached TensorBoard instead of the kit's: {trl_names}"

    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in TRACKED:
        points = accumulator.Scalars(f"train/{key}") if f"train/{key}" in tags else []
        assert [p.step for p in points] == [1, 2], f"train/{key}: steps {[p.step for p in points]}, want [1, 2]"
        jsonl = [row[key] for row in lines]
        assert [p.value for p in points] == pytest.approx(jsonl, rel=1e-6, abs=1e-12), key  # float32 in the file

    # metrics.jsonl keeps its format: METRIC_KEYS first, in order, then TRL's other keys; no TRL name of RENAMES
    for row in lines:
        assert list(row)[:len(METRIC_KEYS)] == list(METRIC_KEYS)
        assert not set(RENAMES) & set(row), sorted(set(RENAMES) & set(row))
        assert isinstance(row["accuracy"], float) and isinstance(row["entropy"], float)


def test_report_to_none_writes_no_tracker_files(tiny_dir, tmp_path):
    from qerl_lib.train.grpo import build_trainer
    from transformers.integrations import TensorBoardCallback

    trainer = build_trainer(tiny_config(tiny_dir, "lora", steps=1), tmp_path, extra_rewards=[("toy", toy_reward, 1.0)],
                            quiet=True)
    assert trainer.args.report_to == []
    assert not any(isinstance(cb, TensorBoardCallback) for cb in trainer.callback_handler.callbacks)


@pytest.mark.parametrize("value", ["mlflow", "TensorBoard", "", "all", ("tensorboard",)], ids=repr)
def test_unknown_tracker_is_one_line_before_any_model_loads(value):
    with pytest.raises(UserError, match="--report-to must be one of none, tensorboard, trackio, wandb") as err:
        make_config("smollm2-arith", report_to=value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("tracker", ["tensorboard", "trackio", "wandb"])
def test_missing_tracker_package_names_the_pip_install(tracker, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == tracker else real(name, *a))
    with pytest.raises(UserError, match=f"pip install {tracker}") as err:
        make_config("smollm2-arith", report_to=tracker)
    assert "\n" not in str(err.value)


def test_report_to_is_not_part_of_the_run_record():
    """Where copies of the metrics go does not change the run: run.json and resume checks ignore it."""
    plain = make_config("smollm2-arith")
    tracked = make_config("smollm2-arith", report_to="tensorboard")
    assert tracked.report_to == "tensorboard" and "report_to" not in tracked.to_dict()
    assert plain.to_dict() == tracked.to_dict()


def test_trackers_stay_offline_and_in_the_run_folder_unless_the_user_says_otherwise(tmp_path, monkeypatch):
    from qerl_lib.train.trainer import run_folder, tracker_environment

    for name in ("WANDB_MODE", "WANDB_DIR", "TRACKIO_DIR"):
        monkeypatch.delenv(name, raising=False)
    assert run_folder(tmp_path / "checkpoints") == tmp_path and run_folder(tmp_path) == tmp_path
    tracker_environment(["tensorboard"], tmp_path)
    assert "WANDB_MODE" not in os.environ
    tracker_environment(["wandb", "trackio"], tmp_path / "a")
    env = os.environ
    assert (env["WANDB_MODE"], env["WANDB_DIR"], env["TRACKIO_DIR"]) == ("offline", str(tmp_path / "a"),
                                                                       str(tmp_path / "a" / "trackio"))
    tracker_environment(["wandb"], tmp_path / "b")  # a later run of the process moves what this module set
    assert env["WANDB_DIR"] == str(tmp_path / "b")
    monkeypatch.setenv("WANDB_MODE", "online")  # the user's setting wins
    tracker_environment(["wandb"], tmp_path / "c")
    assert env["WANDB_MODE"] == "online"
