"""Calibrate the claim sweeps' task: base pass@1 and reward spread per (level, temperature).

GRPO learns only from groups whose completions disagree: a group of G completions that are all
right or all wrong has zero advantage everywhere. So a task suits a short RL run when the base
model is right some of the time (pass@1 well inside (0, 1)) and most groups of G = 8 are *mixed*.
`calibrate` samples G completions for each of ``n`` training-split problems per (level,
temperature) from the untrained base and reports, per setting: pass@1, the share of mixed groups,
the share of truncated completions and the mean length. `choose_setting` applies the rule fixed
before the claim sweeps (``docs/claims_plan.md``): among settings with pass@1 in [0.25, 0.45],
prefer the paper's rollout temperature 1.0, then the largest share of mixed groups.
"""

from __future__ import annotations

import time

from qerl_lib.errors import UserError

PASS1_WINDOW = (0.25, 0.45)
PREFERRED_TEMPERATURE = 1.0


def calibrate(model: str = "smollm2", levels=(1, 2, 3, 4, 5), temperatures=(0.5, 0.7, 1.0), n: int = 128,
              group: int = 8, max_new_tokens: int = 32, bases=("bf16", "nvfp4"), device: str = "auto",
              seed: int = 0, progress: bool = True) -> dict:
    """Measure every (base, level, temperature) setting; returns the calibration record (see module doc)."""
    from qerl_lib.evals.evaluation import EvalConfig, evaluate
    from qerl_lib.tasks.problems import load_problems
    from qerl_lib.train.grpo import compute_dtype, load_base, load_tokenizer, resolve_device
    from qerl_lib.train.presets import make_config

    from qerl_lib.tasks.expressions import EXPR_LEVELS
    from qerl_lib.train.presets import BASE_FORMATS

    if group < 2 or n < 1:
        raise UserError(f"--group must be >= 2 and --n >= 1, got group={group}, n={n}")
    checks = (("--levels", levels, lambda v: v in EXPR_LEVELS, f"levels from {EXPR_LEVELS}"),
              ("--temperatures", temperatures, lambda v: v >= 0, "temperatures >= 0 (0 = greedy)"),
              ("--bases", bases, lambda v: v in BASE_FORMATS, f"bases from {', '.join(BASE_FORMATS)}"))
    for flag, values, valid, wanted in checks:  # before any model loads
        if not values or not all(valid(v) for v in values):
            raise UserError(f"{flag} takes comma-separated {wanted}, got {list(values)}")
    rows = []
    for base in bases:
        config = make_config("smollm2-expr", model=model, base_format=base, device=device)
        dev = resolve_device(config)
        tokenizer = load_tokenizer(config)
        policy = load_base(config, dev, compute_dtype(dev)).eval()
        for level in levels:
            problems = load_problems("expr", "train", n=n, seed=seed, level=level)
            for temperature in temperatures:
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
                rows.append(row)
                if progress:
                    print(f"{base:6s} level {level}  T {temperature:.1f}  pass@1 {row['pass@1']:.3f}  "
                          f"mixed {row['mixed_groups']:.2f}  truncated {row['truncated_rate']:.2f}", flush=True)
    return {"rows": rows, "settings": {"model": model, "n": n, "group": group, "max_new_tokens": max_new_tokens,
                                       "split": "train", "seed": seed, "rule": choose_setting.__doc__.strip()},
            "chosen": choose_setting(rows)}


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
    lines.append("chosen: " + (f"level {chosen['level']}, temperature {chosen['temperature']}" if chosen else
                               "none in the pass@1 window: widen the levels or temperatures"))
    return "\n".join(lines)
