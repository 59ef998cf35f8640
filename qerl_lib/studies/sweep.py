"""`qerl sweep`: a grid of (arm x seed) training runs from one spec file, several at once, resumable.

A spec (TOML or JSON) names a preset, the seeds, the settings every run shares, the arms (each a
set of `TrainConfig` overrides), the held-out evaluation and, optionally, the blocks of arms the
analysis compares (`studies/claims.py`)::

    name = "pilot"
    preset = "smollm2-expr"
    seeds = [0, 1, 2]
    concurrency = 4              # runs at once on one GPU ("auto": as many as memory allows, at most 8)
    run_memory_gib = 6.0         # peak GPU memory of one run (the summary reports the measured value)
    [common]                     # TrainConfig fields for every arm
    steps = 60
    [eval]                       # held-out pass@1 after training
    n = 256
    samples = 4
    [[arms]]
    name = "lora"
    mode = "lora"
    [[arms]]
    name = "base-bf16"           # train = false: evaluate the untrained base only
    base_format = "bf16"
    train = false
    [blocks.c]                   # optional: which arms a block compares, and against which reference
    arms = ["lora", "qerl"]
    reference = "lora"
    test = "superiority"         # or "equivalence" (two one-sided tests, `studies/claims.py`)
    pairing = "seed"             # or "problem": pair held-out problems, pooling seeds (untrained arms)

Every setting is validated, and every run's config built, before anything loads: an unknown
field, a grid without runs, a mode that contradicts a base format, or more concurrent runs than
the GPU's memory holds is one line on stderr.

Each run lives in ``OUT/runs/ARM-sSEED/``: ``spec.json`` (its config), ``train/`` (the `qerl train`
folder: ``run.json``, ``metrics.jsonl``, checkpoints while it runs) and, once finished,
``result.json`` (its endpoints and held-out evaluation). A finished run is never rerun; a run
killed mid-way resumes from its last checkpoint (or restarts when it had none). Checkpoints and
adapters are deleted once the run is evaluated, unless ``keep_adapters = true``: a sweep folder is
small enough to commit. A run whose trainable weights turn non-finite stops at that step
(`errors.TrainingDiverged`); it is finished, with ``diverged_at_step`` set and held-out pass@1 0
(a policy with NaN weights answers nothing), and the learning-rate analysis counts it as collapsed.
Runs execute as separate processes (``python -m qerl_lib.studies.sweep RUN_DIR``, output in
``RUN_DIR/log.txt``), so one crash stays one failed run, named on stderr when the sweep ends.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from qerl_lib.errors import TrainingDiverged, UserError
from qerl_lib.io import provenance, read_jsonl, write_json_atomic

SPEC_KEYS = {"name", "preset", "seeds", "concurrency", "run_memory_gib", "common", "eval", "arms", "blocks",
             "keep_adapters", "description"}
ARM_KEYS_EXTRA = {"name", "train"}  # besides TrainConfig fields
BLOCK_KEYS = {"arms", "reference", "test", "pairing"}  # test: superiority | equivalence; pairing: seed | problem
AUTO_MAX_CONCURRENCY = 8
LAST_WINDOW = 10  # steps over which the end-of-run reward and entropy are averaged


@dataclass(frozen=True)
class EvalSpec:
    """The held-out evaluation that ends every run: `n` fixed test problems x `samples` completions."""

    n: int = 256
    samples: int = 4
    temperature: float = 0.6  # the paper's evaluation setting (QeRL §4.1)
    top_p: float = 0.95
    seed: int = 0  # sampling seed; the test problems themselves are fixed (generator seed 0)
    # Trained runs all sample with `seed` (their weights differ); an evaluation-only run samples with
    # `seed + run seed`, so the seeds of an untrained arm are independent samplings, not copies.

    def __post_init__(self):
        if self.n < 1 or self.samples < 1:
            raise UserError(f"[eval] n={self.n} and samples={self.samples} must be >= 1")


@dataclass(frozen=True)
class SweepSpec:
    name: str
    preset: str
    seeds: tuple[int, ...]
    arms: tuple[dict, ...]
    common: dict = field(default_factory=dict)
    eval: EvalSpec = field(default_factory=EvalSpec)
    concurrency: int | str = "auto"
    run_memory_gib: float = 6.0
    blocks: dict = field(default_factory=dict)
    keep_adapters: bool = False
    description: str = ""


@dataclass(frozen=True)
class RunPlan:
    arm: str
    seed: int
    train: bool
    config: object  # TrainConfig

    @property
    def run_id(self) -> str:
        return f"{self.arm}-s{self.seed}"


# ----------------------------------------------------------------------------- spec: read and validate
def read_spec(path: str | os.PathLike) -> SweepSpec:
    """Parse and validate a sweep spec file (.toml or .json)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"sweep spec {path} does not exist: pass a .toml or .json file (see `qerl sweep --help`)")
    try:
        raw = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is not valid {path.suffix[1:].upper()}: {e}") from None
    return parse_spec(raw, source=str(path))


def parse_spec(raw: dict, source: str = "spec") -> SweepSpec:
    unknown = sorted(set(raw) - SPEC_KEYS)
    if unknown:
        raise UserError(f"{source}: unknown key(s) {unknown}; a sweep spec has {sorted(SPEC_KEYS)}")
    for key in ("name", "preset", "seeds", "arms"):
        if key not in raw:
            raise UserError(f"{source}: missing '{key}'")
    seeds = raw["seeds"]
    if not isinstance(seeds, list) or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise UserError(f"{source}: seeds must be a list of non-negative integers, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise UserError(f"{source}: seeds repeat ({seeds}): each (arm, seed) is one run")
    arms = raw["arms"]
    if not isinstance(arms, list) or not all(isinstance(a, dict) for a in arms):
        raise UserError(f"{source}: arms must be a list of tables ([[arms]] in TOML)")
    names = [a.get("name") for a in arms]
    if any(not isinstance(n, str) or not n or "/" in n for n in names):
        raise UserError(f"{source}: every arm needs a 'name' (a string without '/')")
    if len(set(names)) != len(names):
        raise UserError(f"{source}: arm names repeat: {names}")
    ev = raw.get("eval", {})
    unknown_eval = sorted(set(ev) - {f.name for f in fields(EvalSpec)})
    if unknown_eval:
        raise UserError(f"{source}: unknown [eval] field(s) {unknown_eval}; valid: {[f.name for f in fields(EvalSpec)]}")
    concurrency = raw.get("concurrency", "auto")
    if concurrency != "auto" and (isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1):
        raise UserError(f"{source}: concurrency must be a positive integer or \"auto\", got {concurrency!r}")
    spec = SweepSpec(name=raw["name"], preset=raw["preset"], seeds=tuple(seeds), arms=tuple(arms),
                     common=dict(raw.get("common", {})), eval=EvalSpec(**ev), concurrency=concurrency,
                     run_memory_gib=float(raw.get("run_memory_gib", 6.0)), blocks=dict(raw.get("blocks", {})),
                     keep_adapters=bool(raw.get("keep_adapters", False)), description=raw.get("description", ""))
    for block, table in spec.blocks.items():
        unknown = sorted(set(table) - BLOCK_KEYS)
        if unknown:
            raise UserError(f"{source}: block {block!r}: unknown field(s) {unknown}; known: {sorted(BLOCK_KEYS)}")
        if table.get("test", "superiority") not in ("superiority", "equivalence") or \
                table.get("pairing", "seed") not in ("seed", "problem"):
            raise UserError(f"{source}: block {block!r}: test is superiority or equivalence, pairing is seed or problem")
        if table.get("test") == "equivalence" and table.get("pairing") == "problem":
            raise UserError(f"{source}: block {block!r}: the equivalence test pairs seeds; use pairing = \"seed\" "
                            f"or test = \"superiority\"")
        missing = [a for a in table.get("arms", []) if a not in names]
        if not table.get("arms") or missing:
            raise UserError(f"{source}: block {block!r} must list existing arms; unknown: {missing or '(none listed)'}")
        if table.get("reference") is not None and table["reference"] not in table["arms"]:
            raise UserError(f"{source}: block {block!r}: reference {table['reference']!r} is not one of its arms")
    return spec


def plan_runs(spec: SweepSpec) -> list[RunPlan]:
    """Every (arm, seed) run with its validated TrainConfig; raises UserError before anything loads."""
    from qerl_lib.train.presets import CONFIG_FIELDS, make_config

    valid = set(CONFIG_FIELDS) | ARM_KEYS_EXTRA
    for where, table in [("common", spec.common)] + [(f"arm {a['name']!r}", a) for a in spec.arms]:
        unknown = sorted(set(table) - valid)
        if unknown or (where == "common" and {"name", "seed"} & set(table)):
            bad = unknown or sorted({"name", "seed"} & set(table))
            raise UserError(f"{where}: unknown or misplaced field(s) {bad}; arms take TrainConfig fields "
                            f"(see `qerl train --help`) plus 'name' and 'train'")
        if "seed" in table:
            raise UserError(f"{where}: 'seed' is set by the spec's seeds list, not per arm")
    runs = []
    for arm in spec.arms:
        settings = {**spec.common, **{k: v for k, v in arm.items() if k not in ARM_KEYS_EXTRA}}
        mode = settings.pop("mode", None)
        for seed in spec.seeds:
            try:
                config = make_config(spec.preset, mode=mode, seed=seed, **settings)
            except UserError as e:
                raise UserError(f"arm {arm['name']!r}: {e}") from None
            runs.append(RunPlan(arm=arm["name"], seed=seed, train=bool(arm.get("train", True)), config=config))
    if not runs:
        raise UserError("the sweep has no runs: it needs at least one arm and one seed")
    return runs


def resolve_concurrency(spec: SweepSpec, n_runs: int, device: str | None = None) -> int:
    """Runs at once: the spec's number, checked against the GPU's memory, or the most that fit ("auto")."""
    on_cpu = device == "cpu" or (device is None and spec.common.get("device") == "cpu"
                                 and all(arm.get("device", "cpu") == "cpu" for arm in spec.arms))
    total_gib = None if on_cpu else _gpu_memory_gib()
    if total_gib is None:  # CPU: processes share the cores; more than that only adds switching
        fit = max(1, (os.cpu_count() or 2) // 2)
    else:
        fit = max(1, int(0.9 * total_gib // spec.run_memory_gib))
    if spec.concurrency == "auto":
        return max(1, min(fit, AUTO_MAX_CONCURRENCY, n_runs))
    if total_gib is not None and spec.concurrency * spec.run_memory_gib > 0.9 * total_gib:
        raise UserError(f"concurrency {spec.concurrency} x run_memory_gib {spec.run_memory_gib:g} GiB exceeds 90% of "
                        f"this GPU's {total_gib:.0f} GiB: use concurrency <= {fit} (or \"auto\")")
    return spec.concurrency


def _gpu_memory_gib() -> float | None:
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


# ----------------------------------------------------------------------------- the runner
def run_sweep(spec: SweepSpec, out: str | os.PathLike, device: str | None = None, max_minutes: float | None = None,
              progress: bool = True) -> dict:
    """Run every unfinished run of `spec` into `out` (resumable) and write ``out/summary.json``.

    ``device`` overrides every run's device; ``max_minutes`` stops launching new runs after that
    long (running ones finish), so a sweep can be spread over several sessions.
    """
    from qerl_lib.studies.claims import summarise_sweep

    runs = plan_runs(spec)
    concurrency = resolve_concurrency(spec, len(runs), device)
    out = Path(out)
    (out / "runs").mkdir(parents=True, exist_ok=True)
    write_json_atomic(out / "spec.json", {"spec": _spec_dict(spec), "provenance": provenance()})
    todo = []
    for run in runs:
        folder = out / "runs" / run.run_id
        _write_run_spec(folder, run, spec, device)
        if not (folder / "result.json").is_file():
            todo.append((run, folder))
    bar = _bar(len(runs), len(runs) - len(todo), progress, spec.name, concurrency)
    start = time.monotonic()
    active: dict = {}
    failed: list[str] = []
    previous = signal.signal(signal.SIGTERM, _raise_exit)  # a killed sweep takes its runs down with it
    try:
        _drive(todo, active, failed, concurrency, start, max_minutes, bar)
    finally:
        signal.signal(signal.SIGTERM, previous)
        for proc, log, _ in active.values():
            proc.terminate()
            proc.wait()
            log.close()
    bar.close()
    summary = summarise_sweep(spec, out)
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}; see runs/RUN/log.txt, then run the sweep again "
              "(finished runs are kept)", file=sys.stderr)
    return summary


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def _drive(todo: list, active: dict, failed: list, concurrency: int, start: float, max_minutes: float | None,
           bar) -> None:
    """Keep `concurrency` runs going until none is left (or the time is up and the running ones end)."""
    while todo or active:
        while todo and len(active) < concurrency and (max_minutes is None or time.monotonic() - start < 60 * max_minutes):
            run, folder = todo.pop(0)
            log = open(folder / "log.txt", "a")
            active[run.run_id] = (subprocess.Popen([sys.executable, "-m", "qerl_lib.studies.sweep", str(folder)],
                                                   stdout=log, stderr=subprocess.STDOUT), log, folder)
        if max_minutes is not None and time.monotonic() - start >= 60 * max_minutes and todo and not active:
            break
        time.sleep(1.0)
        for run_id, (proc, log, folder) in list(active.items()):
            if proc.poll() is None:
                continue
            log.close()
            del active[run_id]
            if proc.returncode != 0 or not (folder / "result.json").is_file():
                failed.append(run_id)
            bar.update(1)
            bar.set_postfix_str(f"{len(active)} running, {len(failed)} failed")


def _bar(total: int, done: int, enabled: bool, name: str, concurrency: int):
    from qerl_lib.progress import progress_bar

    return progress_bar(total=total, initial=done, disable=not enabled, desc=f"sweep {name} (x{concurrency})",
                        unit="run")


def _spec_dict(spec: SweepSpec) -> dict:
    return {**asdict(spec), "seeds": list(spec.seeds), "arms": list(spec.arms)}


def _write_run_spec(folder: Path, run: RunPlan, spec: SweepSpec, device: str | None) -> None:
    config = run.config.to_dict() if device is None else {**run.config.to_dict(), "device": device}
    evaluation = asdict(spec.eval) if run.train else {**asdict(spec.eval), "seed": spec.eval.seed + run.seed}
    record = {"arm": run.arm, "seed": run.seed, "train": run.train, "preset": spec.preset,
              "overrides": _overrides(run, spec), "eval": evaluation, "keep_adapters": spec.keep_adapters,
              "config": config}
    existing = folder / "spec.json"
    if existing.is_file():
        saved = json.loads(existing.read_text())
        if saved["config"] != json.loads(json.dumps(record["config"])) or saved["eval"] != record["eval"]:
            raise UserError(f"{folder} holds run {run.run_id} with other settings than this spec: "
                            "use a new output folder for a changed spec")
        return
    write_json_atomic(existing, record)


def _overrides(run: RunPlan, spec: SweepSpec) -> dict:
    arm = next(a for a in spec.arms if a["name"] == run.arm)
    return {**spec.common, **{k: v for k, v in arm.items() if k not in ARM_KEYS_EXTRA}}


# ----------------------------------------------------------------------------- one run (worker process)
RUN_LOCK = ".worker.lock"


def _hold_run_lock(folder: Path):
    """An exclusive lock on ``folder`` for this process's life (the OS drops it when the process ends, even
    killed). A sweep killed with SIGKILL leaves its workers running; rerunning it must not start a second
    worker on a run one of them still trains: that worker stops here with a one-line error instead."""
    import fcntl

    handle = open(folder / RUN_LOCK, "a")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(f"another worker is running {folder} (it holds {RUN_LOCK}): wait for it to finish, or "
                        "stop the old sweep's workers (pkill -f qerl_lib.studies.sweep), then run the sweep "
                        "again") from None
    return handle


def run_one(folder: str | os.PathLike) -> dict:
    """Train (or resume) one run of a sweep, evaluate it on held-out problems, write ``result.json``."""
    from qerl_lib.train.presets import make_config

    folder = Path(folder)
    lock = _hold_run_lock(folder)  # noqa: F841 -- held until this process ends
    record = json.loads((folder / "spec.json").read_text())
    if (folder / "result.json").is_file():
        return json.loads((folder / "result.json").read_text())
    config_dict = record["config"]
    overrides = dict(record["overrides"])
    mode = overrides.pop("mode", None)
    overrides["device"] = config_dict["device"]  # --device on the sweep overrides the spec's
    config = make_config(record["preset"], mode=mode, seed=record["seed"], **overrides)
    train_dir = folder / "train"
    started = time.time()
    diverged_at = None
    if record["train"]:
        try:
            _train_resumably(config, train_dir)
        except TrainingDiverged as exc:
            diverged_at = exc.step
    if diverged_at is None:
        evaluation = _evaluate(config, train_dir / "adapter" if record["train"] else None, EvalSpec(**record["eval"]))
    else:
        evaluation = {"summary": {"pass@1": 0.0, "pass@1_ci95": [0.0, 0.0], "skipped": "diverged"}, "correct": []}
    result = {"arm": record["arm"], "seed": record["seed"], "train": record["train"],
              "config": config.to_dict(), "eval": evaluation["summary"], "correct": evaluation["correct"],
              "endpoints": endpoints(train_dir / "metrics.jsonl", evaluation["summary"]) if record["train"] else
              {"heldout_pass1": evaluation["summary"]["pass@1"]},
              "curves": curves(train_dir / "metrics.jsonl") if record["train"] else {},
              "diverged_at_step": diverged_at,
              "seconds": round(time.time() - started, 1), "provenance": provenance()}
    write_json_atomic(folder / "result.json", result)
    if not record["keep_adapters"]:
        shutil.rmtree(train_dir / "checkpoints", ignore_errors=True)
        shutil.rmtree(train_dir / "adapter", ignore_errors=True)
    return result


def _train_resumably(config, train_dir: Path) -> None:
    """Train the run in ``train_dir``, continuing whatever a killed worker left there.

    A finished adapter means only the evaluation was missing. A folder with ``run.json`` is resumed from
    its newest complete checkpoint (``metrics.prepare_output``; incomplete ones, from a worker killed while
    saving, are skipped, and with none complete the run starts over from step 0). A folder without
    ``run.json`` was left before training began and starts fresh (nothing in it is a run's file).
    """
    from qerl_lib.train.grpo import train

    if (train_dir / "adapter" / "adapter_config.json").is_file():
        return  # trained; only the evaluation was missing
    train(config, train_dir, resume=(train_dir / "run.json").is_file(), quiet=True)


def _evaluate(config, adapter_dir: Path | None, spec: EvalSpec) -> dict:
    from qerl_lib.evals.evaluation import EvalConfig, evaluate
    from qerl_lib.models.lora import load_adapters
    from qerl_lib.tasks.problems import load_problems
    from qerl_lib.train.grpo import compute_dtype, load_base, load_tokenizer, resolve_device

    device = resolve_device(config)
    tokenizer = load_tokenizer(config)
    model = load_base(config, device, compute_dtype(device))
    if adapter_dir is not None:
        model = load_adapters(model, adapter_dir, is_trainable=False)
    model.eval()
    problems = load_problems(config.data, "test", n=spec.n, seed=0, path=None, level=config.data_level)
    eval_config = EvalConfig(samples=spec.samples, temperature=spec.temperature, top_p=spec.top_p,
                             max_new_tokens=config.max_completion_length, batch_size=256, seed=spec.seed,
                             last_number_fallback=config.answer_fallback, first_number=config.answer_first_number)
    report = evaluate(model, tokenizer, problems, eval_config, progress=False)
    return {"summary": report.summary, "correct": [r["correct"] for r in report.records]}


def endpoints(metrics_path: Path, eval_summary: dict) -> dict:
    """A run's pre-registered endpoints (`studies/claims.py` documents them); None where undefined."""
    rows = [r for r in read_jsonl(metrics_path) if r.get("reward") is not None]
    rewards = [r["reward"] for r in rows]
    entropy = [r["entropy"] for r in rows if r.get("entropy") is not None]
    window = min(LAST_WINDOW, len(rewards))

    def mean(values):
        return sum(values) / len(values) if values else None

    windows = [mean(rewards[i:i + window]) for i in range(len(rewards) - window + 1)] if window else []
    return {"heldout_pass1": eval_summary["pass@1"], "last_reward": mean(rewards[-window:]) if window else None,
            "first_reward": mean(rewards[:window]) if window else None, "best_window_reward": max(windows, default=None),
            "last_entropy": mean(entropy[-window:]), "mean_entropy": mean(entropy),
            "peak_memory_gb": max((r["peak_memory_gb"] for r in rows if r.get("peak_memory_gb")), default=None),
            "steps": len(rows)}


def curves(metrics_path: Path) -> dict:
    """Per-step reward, entropy, σ and zero-std groups (compact: the figures' input)."""
    rows = list(read_jsonl(metrics_path))
    return {key: [r.get(key) for r in rows] for key in ("reward", "entropy", "sigma", "zero_std_groups")}


if __name__ == "__main__":
    run_one(sys.argv[1])
