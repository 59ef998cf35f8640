"""Calibrate the claim sweeps' task: base pass@1 and reward spread per (level, temperature).

GRPO learns only from groups whose completions disagree: a group of G completions that are all
right or all wrong has zero advantage everywhere. So a task suits a short RL run when the base
model is right some of the time (pass@1 well inside (0, 1)) and most groups of G = 8 are *mixed*.
`calibrate` samples G completions for each of ``n`` training-split problems per (base format,
level, temperature) from the untrained model and reports, per setting: pass@1, the share of mixed groups,
the share of truncated completions and the mean length. `choose_setting` applies the rule fixed
before the claim sweeps (``docs/claims_plan.md``): among settings with pass@1 in [0.25, 0.45],
prefer the paper's rollout temperature 1.0, then the largest share of mixed groups.

Resuming: the grid is bases x levels x temperatures evaluations of ``n x group`` completions each, so
``checkpoint(record)`` hands the record so far to the caller after every row (`qerl calibrate --json`
writes it there), and ``done`` rows (an earlier record of the same settings, `resume_calibration`) are
not measured again: a rerun of a stopped calibration continues where it stopped, and a base whose rows
are all done does not even load its model. What makes rows comparable is `SETTING_KEYS` (model,
problems, group, length budget, seed, split); a file of other settings is refused, never mixed in.
"""

from __future__ import annotations

import time

from qerl_lib.errors import UserError

PASS1_WINDOW = (0.25, 0.45)
PREFERRED_TEMPERATURE = 1.0


SETTING_KEYS = ("model", "n", "group", "max_new_tokens", "split", "seed")  # what a row's numbers depend on


def calibration_settings(model: str = "smollm2", n: int = 128, group: int = 8, max_new_tokens: int = 32,
                         seed: int = 0) -> dict:
    """The record's ``settings``: `SETTING_KEYS` and the rule that chose among the rows."""
    return {"model": model, "n": n, "group": group, "max_new_tokens": max_new_tokens, "split": "train",
            "seed": seed, "rule": choose_setting.__doc__.strip()}


def check_calibration_args(levels, temperatures, n: int, group: int, bases) -> None:
    """The grid's and the group's values, checked before anything loads; a bad one is a one-line `UserError`."""
    from qerl_lib.tasks.expressions import EXPR_LEVELS
    from qerl_lib.train.presets import BASE_FORMATS

    if group < 2 or n < 1:
        raise UserError(f"--group must be >= 2 and --n >= 1, got group={group}, n={n}")
    checks = (("--levels", levels, lambda v: v in EXPR_LEVELS, f"levels from {EXPR_LEVELS}"),
              ("--temperatures", temperatures, lambda v: v >= 0, "temperatures >= 0 (0 = greedy)"),
              ("--bases", bases, lambda v: v in BASE_FORMATS, f"bases from {', '.join(BASE_FORMATS)}"))
    for flag, values, valid, wanted in checks:
        if not values or not all(valid(v) for v in values):
            raise UserError(f"{flag} takes comma-separated {wanted}, got {list(values)}")


def _row_key(row: dict) -> tuple:
    return row["base"], row["level"], row["temperature"]


def resume_calibration(path, settings: dict, bases, levels, temperatures) -> tuple[list[dict], list[dict]]:
    """The rows of an existing calibration record at ``path`` that a run of ``settings`` over the grid ``bases x
    levels x temperatures`` need not measure again, and the provenance of the runs that measured them (the file's,
    after those it had itself resumed from; empty when nothing is kept); ``([], [])`` when there is no file.

    Refused with a one-line `UserError` naming ``--force``: a file that is not a calibration record, one measured
    with other `SETTING_KEYS` (its numbers are not comparable), and one with a row outside the grid (resuming would
    mix in a setting this command does not ask for, and replacing it would lose that row)."""
    from pathlib import Path

    from qerl_lib.io import RESUME_FIX as fix
    from qerl_lib.io import resumable_record

    path = Path(path)
    if not path.exists():
        return [], []
    doc, runs = resumable_record(path, "qerl calibrate", tables=("settings",),
                                 row_fields=("base", "level", "temperature"))
    rows = doc["rows"]
    changed = [f"{k} {doc['settings'].get(k)!r} there, {settings[k]!r} here" for k in SETTING_KEYS
               if doc["settings"].get(k) != settings[k]]
    if changed:
        raise UserError(f"--json {path} holds a calibration with other settings ({'; '.join(changed)}): {fix}")
    grid = {(b, lv, t) for b in bases for lv in levels for t in temperatures}
    outside = [r for r in rows if _row_key(r) not in grid]
    if outside:
        b, lv, t = _row_key(outside[0])
        raise UserError(f"--json {path} holds {len(outside)} row(s) outside this grid (the first: {b} level {lv} "
                        f"temperature {t}): add them to --bases/--levels/--temperatures, {fix}")
    return rows, runs if rows else []


def calibrate(model: str = "smollm2", levels=(1, 2, 3, 4, 5), temperatures=(0.5, 0.7, 1.0), n: int = 128,
              group: int = 8, max_new_tokens: int = 32, bases=("bf16", "nvfp4"), device: str = "auto",
              seed: int = 0, progress: bool = True, done=(), checkpoint=None) -> dict:
    """Measure every (base, level, temperature) setting; returns the calibration record (see module doc).

    ``done``: rows already measured under these settings (`resume_calibration`); their settings are not measured
    again, a base with all of them done is not loaded, and a row outside this grid is left out of the record.
    ``checkpoint(record)``, when given, gets the record so far (the same shape as the returned one: rows in grid
    order, settings, chosen) after every row measured."""
    check_calibration_args(levels, temperatures, n, group, bases)  # before any model loads
    from qerl_lib.evals.evaluation import EvalConfig, evaluate
    from qerl_lib.tasks.problems import load_problems
    from qerl_lib.train.grpo import compute_dtype, load_base, load_tokenizer, resolve_device
    from qerl_lib.train.presets import make_config

    grid = [(b, lv, t) for b in bases for lv in levels for t in temperatures]
    measured = {_row_key(r): r for r in done}
    settings = calibration_settings(model, n, group, max_new_tokens, seed)

    def record() -> dict:
        rows = [measured[key] for key in grid if key in measured]  # grid order, as one uninterrupted run gives
        return {"rows": rows, "settings": settings, "chosen": choose_setting(rows)}

    for base in bases:
        if all(key in measured for key in grid if key[0] == base):
            continue  # every row of this base is done: its model is not loaded
        config = make_config("smollm2-expr", model=model, base_format=base, device=device)
        dev = resolve_device(config)
        tokenizer = load_tokenizer(config)
        policy = load_base(config, dev, compute_dtype(dev)).eval()
        for level in levels:
            if all((base, level, t) in measured for t in temperatures):
                continue
            problems = load_problems("expr", "train", n=n, seed=seed, level=level)
            for temperature in temperatures:
                if (base, level, temperature) in measured:
                    continue
                start = time.perf_counter()
                report = evaluate(policy, tokenizer, problems, EvalConfig(
                    samples=group, temperature=temperature, top_p=1.0, max_new_tokens=max_new_tokens,
                    batch_size=512, seed=seed, first_number=True), progress=False)
                correct = [sum(r["correct"]) for r in report.records]
                row = {"base": base, "level": level, "temperature": temperature, "n": n, "group": group,
                       "pass@1": report.summary["pass@1"], "pass@1_ci95": report.summary["pass@1_ci95"],
                       "mixed_groups": sum(0 < c < group for c in correct) / len(correct),
                       "truncated_rate": report.summary["truncated_rate"],
                       "mean_length": report.summary["mean_length"], "seconds": round(time.perf_counter() - start, 2)}
                measured[(base, level, temperature)] = row
                if progress:
                    print(f"{base:6s} level {level}  T {temperature:.1f}  pass@1 {row['pass@1']:.3f}  "
                          f"mixed {row['mixed_groups']:.2f}  truncated {row['truncated_rate']:.2f}", flush=True)
                if checkpoint is not None:
                    checkpoint(record())
        del policy  # the next base's model loads in its place
    return record()


def choose_setting(rows: list[dict], base: str = "bf16") -> dict | None:
    """Among the bf16 settings with pass@1 in [0.25, 0.45], prefer temperature 1.0, then the most mixed
    groups; if none is in the window, the setting whose pass@1 is closest to it (ties: most mixed groups)."""
    rows = [r for r in rows if r["base"] == base]
    if not rows:
        return None
    candidates = [r for r in rows if PASS1_WINDOW[0] <= r["pass@1"] <= PASS1_WINDOW[1]]
    if candidates:
        best = max(candidates, key=lambda r: (r["temperature"] == PREFERRED_TEMPERATURE, r["mixed_groups"]))
    else:
        def distance(r):
            return max(PASS1_WINDOW[0] - r["pass@1"], r["pass@1"] - PASS1_WINDOW[1])

        best = min(rows, key=lambda r: (round(distance(r), 3), -r["mixed_groups"]))
    return {"level": best["level"], "temperature": best["temperature"], "pass@1": best["pass@1"],
            "mixed_groups": best["mixed_groups"], "in_window": bool(candidates)}


def format_calibration(record: dict) -> str:
    lines = [f"{'base':6s} {'level':>5s} {'T':>4s} {'pass@1':>7s} {'mixed':>6s} {'trunc':>6s} {'len':>5s}"]
    for r in record["rows"]:
        lines.append(f"{r['base']:6s} {r['level']:5d} {r['temperature']:4.1f} {r['pass@1']:7.3f} "
                     f"{r['mixed_groups']:6.2f} {r['truncated_rate']:6.2f} {r['mean_length']:5.1f}")
    chosen = record.get("chosen")
    if chosen is None:
        lines.append("chosen: none (the rule chooses among bf16 settings: add bf16 to --bases)")
    else:
        low, high = PASS1_WINDOW
        lines.append(f"chosen: level {chosen['level']}, temperature {chosen['temperature']}"
                     + ("" if chosen.get("in_window", True) else
                        f" (the closest: none in the pass@1 window [{low}, {high}]; widen the levels or temperatures)"))
    return "\n".join(lines)
