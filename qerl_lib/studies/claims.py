"""The paper's training claims, tested on sweep results: per-arm means, paired CIs, Holm, verdicts.

The analysis is fixed before the runs (``docs/claims_plan.md`` is the pre-registration); this
module is that plan as code.

Endpoints (per run, `studies/sweep.endpoints`)
----------------------------------------------
* primary: ``heldout_pass1``, pass@1 on the fixed held-out test problems after training (sampled
  at the paper's evaluation temperature 0.6, top-p 0.95);
* secondary: ``last_reward`` (mean training reward over the last 10 steps), ``mean_entropy``
  (the trainer's token entropy on its own completions, averaged over the run), and for the
  learning-rate block ``collapsed``: a run whose last-10-step reward fell below half of its best
  10-step window, or whose held-out pass@1 ended more than 0.10 below the untrained base's, or
  whose weights turned non-finite (``diverged_at_step``; such a run's held-out pass@1 is 0).

Comparisons
-----------
Arms are compared *paired by seed* (the same seed gives the same data order, LoRA initialisation
and sampling streams in every arm): the difference of an endpoint per seed, its mean, and a
Student-t confidence interval over seeds. Within a block the primary comparisons get Holm's
step-down correction at family-wise 5%; the interval reported next to a Holm-adjusted p is the
plain 95% one.

Verdicts (``holds`` / ``does not hold`` / ``inconclusive``), per claim, on the primary endpoint:

* holds: the paired difference is in the paper's direction and Holm-adjusted p < 0.05;
* does not hold: the 95% interval excludes an effect of the smallest size that matters,
  ``MARGIN`` = 0.03 pass@1 (three points) in the paper's direction, i.e. its upper end is below
  +MARGIN, or the difference is significant in the other direction;
* inconclusive: anything else (too few seeds for the spread seen).

Blocks of untrained arms (the base formats, ``pairing = "problem"``) pair by *held-out problem*
instead: each arm's accuracy on a problem is the mean over all its seeds' samples, the
difference per problem is averaged over the problems, with a t interval over problems. Seeds of
an untrained arm are only resamplings, so the problems are the units that vary.

For the schedule block the claim is one of *no difference* (paper Fig. 9: the schedules perform
alike, exponential a little more stable late): equivalence by two one-sided tests, the 90% interval
of each schedule minus exponential inside ±MARGIN.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from qerl_lib.errors import UserError

MARGIN = 0.03  # smallest pass@1 difference that matters (absolute)
ALPHA = 0.05
COLLAPSE_DROP = 0.10  # held-out pass@1 this far below the untrained base counts as collapse
ENDPOINTS = ("heldout_pass1", "last_reward", "mean_entropy", "last_entropy", "first_reward")


# ----------------------------------------------------------------------------- statistics
def t_quantile(p: float, df: int) -> float:
    from scipy.stats import t

    return float(t.ppf(p, df))


def mean_ci(values: list[float], level: float = 0.95) -> dict:
    """Mean with a Student-t interval over independent values (seeds)."""
    values = [float(v) for v in values if v is not None]
    n = len(values)
    if n == 0:
        return {"n": 0, "mean": None, "sd": None, "ci": [None, None]}
    mean = sum(values) / n
    if n < 2:
        return {"n": n, "mean": mean, "sd": None, "ci": [None, None]}
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return {"n": n, "mean": mean, "sd": sd, "ci": [mean - half, mean + half]}


def paired_difference(a: dict[int, float], b: dict[int, float], level: float = 0.95) -> dict:
    """a - b over the seeds both have: mean, t interval, two-sided paired t-test p."""
    seeds = sorted(set(a) & set(b))
    diffs = [a[s] - b[s] for s in seeds if a[s] is not None and b[s] is not None]
    out = mean_ci(diffs, level)
    out["seeds"] = seeds
    if out["n"] >= 2 and out["sd"]:
        from scipy.stats import t

        stat = out["mean"] / (out["sd"] / math.sqrt(out["n"]))
        out["p"] = float(2 * t.sf(abs(stat), out["n"] - 1))
    elif out["n"] >= 2:
        out["p"] = 0.0 if out["mean"] else 1.0  # every seed gave the same difference
    else:
        out["p"] = None
    return out


def holm(pvalues: list[float | None]) -> list[float | None]:
    """Holm step-down adjusted p-values (None stays None)."""
    indexed = sorted((p, i) for i, p in enumerate(pvalues) if p is not None)
    m, out, running = len(indexed), [None] * len(pvalues), 0.0
    for rank, (p, i) in enumerate(indexed):
        running = max(running, min(1.0, (m - rank) * p))
        out[i] = running
    return out


def verdict(diff: dict, direction: int = +1, margin: float = MARGIN) -> str:
    """'holds' / 'does not hold' / 'inconclusive' for a paired difference (see module docstring)."""
    if diff.get("mean") is None or diff.get("ci", [None])[0] is None:
        return "inconclusive"
    mean, (low, high) = direction * diff["mean"], sorted(direction * x for x in diff["ci"])
    p = diff.get("p_holm", diff.get("p"))
    if mean > 0 and p is not None and p < ALPHA:
        return "holds"
    if high < margin or (mean < 0 and p is not None and p < ALPHA):
        return "does not hold"
    return "inconclusive"


def equivalent(diff: dict, margin: float = MARGIN) -> str:
    """TOST at 5%: the 90% interval inside ±margin -> 'equivalent'; outside entirely -> 'different'."""
    if diff.get("n", 0) < 2 or diff.get("sd") is None:
        return "inconclusive"
    half = t_quantile(0.95, diff["n"] - 1) * diff["sd"] / math.sqrt(diff["n"])
    low, high = diff["mean"] - half, diff["mean"] + half
    if -margin < low and high < margin:
        return "equivalent"
    if low > margin or high < -margin:
        return "different"
    return "inconclusive"


# ----------------------------------------------------------------------------- sweep results
def load_results(out: str | Path) -> list[dict]:
    """Every finished run of a sweep folder (its ``result.json``), sorted by arm and seed."""
    runs = []
    for path in sorted(Path(out).glob("runs/*/result.json")):
        runs.append(json.loads(path.read_text()))
    return sorted(runs, key=lambda r: (r["arm"], r["seed"]))


def run_record(result: dict) -> dict:
    """One entry of a summary's ``runs`` list: arm, seed, endpoints, and the few settings that define it."""
    c = result["config"]
    return {"arm": result["arm"], "seed": result["seed"], **result["endpoints"], "base": c["base"],
            "aqn": c["aqn"], "learning_rate": c["learning_rate"], "schedule": c["aqn_schedule"],
            "steps": c["steps"], "eval_pass1_ci95": result["eval"]["pass@1_ci95"],
            "diverged_at_step": result.get("diverged_at_step"), "seconds": result["seconds"]}


def by_seed(runs: list[dict], arm: str, endpoint: str) -> dict[int, float]:
    return {r["seed"]: r[endpoint] for r in runs if r["arm"] == arm and r.get(endpoint) is not None}


def problem_accuracy(results: list[dict], arm: str) -> list[float] | None:
    """Per held-out problem, the share of correct samples over every seed of `arm` (None if no run)."""
    rows = [r["correct"] for r in results if r["arm"] == arm and r.get("correct")]
    if not rows:
        return None
    if len({len(c) for c in rows}) != 1:
        raise UserError(f"arm {arm!r}: runs evaluated different numbers of problems; rerun with one [eval] n")
    return [sum(sum(row[i]) for row in rows) / sum(len(row[i]) for row in rows) for i in range(len(rows[0]))]


def problem_paired_difference(a: list[float], b: list[float], level: float = 0.95) -> dict:
    """a - b paired by problem: mean, t interval over problems, two-sided p (as `paired_difference`)."""
    if len(a) != len(b):
        raise UserError("arms evaluated different problem sets; rerun with one [eval] n")
    out = paired_difference(dict(enumerate(a)), dict(enumerate(b)), level)
    out["unit"] = "problem"
    out.pop("seeds")
    return out


def block_summary(name: str, table: dict, runs: list[dict], endpoints=ENDPOINTS,
                  results: list[dict] | None = None) -> dict:
    """Per-arm means with 95% CIs and paired differences against the block's reference (Holm on the
    primary endpoint); equivalence tests when the block says ``test = "equivalence"``; pairing by
    held-out problem (from the runs' full `results`) when it says ``pairing = "problem"``."""
    if table.get("pairing", "seed") == "problem":
        return _problem_block(name, table, results or [])
    arms = table["arms"]
    block_runs = [r for r in runs if r["arm"] in arms]
    per_arm = {arm: {e: mean_ci(list(by_seed(block_runs, arm, e).values())) for e in endpoints} for arm in arms}
    out = {"block": name, "arms": arms, "reference": table.get("reference"), "test": table.get("test", "superiority"),
           "runs": block_runs, "per_arm": per_arm, "comparisons": []}
    ref = table.get("reference")
    if ref is None:
        return out
    comps = []
    for arm in arms:
        if arm == ref:
            continue
        comp = {"arm": arm, "vs": ref}
        for e in endpoints:
            comp[e] = paired_difference(by_seed(block_runs, arm, e), by_seed(block_runs, ref, e))
        comps.append(comp)
    adjusted = holm([c["heldout_pass1"]["p"] for c in comps])
    for comp, p in zip(comps, adjusted):
        comp["heldout_pass1"]["p_holm"] = p
        if out["test"] == "equivalence":
            comp["equivalence"] = equivalent(comp["heldout_pass1"])
    out["comparisons"] = comps
    return out


def _problem_block(name: str, table: dict, results: list[dict]) -> dict:
    arms, ref = table["arms"], table.get("reference")
    block_runs = [run_record(r) for r in results if r["arm"] in arms]
    accuracy = {arm: problem_accuracy(results, arm) for arm in arms}
    per_arm = {arm: {"heldout_pass1": mean_ci(accuracy[arm] or []),  # interval over problems
                     "seeds": mean_ci(list(by_seed(block_runs, arm, "heldout_pass1").values()))} for arm in arms}
    out = {"block": name, "arms": arms, "reference": ref, "test": table.get("test", "superiority"),
           "pairing": "problem", "runs": block_runs, "per_arm": per_arm, "comparisons": []}
    if ref is None or accuracy[ref] is None:
        return out
    comps = [{"arm": arm, "vs": ref, "heldout_pass1": problem_paired_difference(accuracy[arm], accuracy[ref])}
             for arm in arms if arm != ref and accuracy[arm] is not None]
    for comp, p in zip(comps, holm([c["heldout_pass1"]["p"] for c in comps])):
        comp["heldout_pass1"]["p_holm"] = p
    out["comparisons"] = comps
    return out


def collapse_flags(runs: list[dict], base_pass1: float | None) -> None:
    """Mark each run ``collapsed`` (in place) by the pre-registered rule."""
    for r in runs:
        late_drop = (r.get("last_reward") is not None and r.get("best_window_reward")
                     and r["last_reward"] < 0.5 * r["best_window_reward"])
        below_base = base_pass1 is not None and r["heldout_pass1"] < base_pass1 - COLLAPSE_DROP
        r["collapsed"] = bool(late_drop or below_base or r.get("diverged_at_step") is not None)


def summarise_sweep(spec, out: str | Path) -> dict:
    """``out/summary.json``: every finished run and one summary per block of the spec."""
    from qerl_lib.io import provenance, write_json_atomic

    results = load_results(out)
    runs = [run_record(r) for r in results]
    blocks = {name: block_summary(name, table, runs, results=results) for name, table in spec.blocks.items()}
    summary = {"sweep": spec.name, "preset": spec.preset, "n_runs_finished": len(runs),
               "n_runs_planned": len(spec.arms) * len(spec.seeds), "runs": runs, "blocks": blocks,
               "provenance": provenance()}
    write_json_atomic(Path(out) / "summary.json", summary)
    return summary


def read_summary(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path} does not exist: run `qerl sweep SPEC --out {path.parent}` first")
    return json.loads(path.read_text())
