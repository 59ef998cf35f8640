"""The claims table: each of the paper's training claims beside the kit's measurement and a verdict.

Two steps, both pure functions of files the kit wrote:

1. `export_block` turns one block of a claim sweep folder (``dev/runs/claims/NAME``, written by
   ``qerl sweep``) into a self-contained block JSON (``results/claims/block_X.json``): every run
   with its endpoints, per-arm means with 95% intervals, the paired comparisons of the
   pre-registered analysis (`studies/claims.py`), the per-step curves the figures need, the sweep
   spec, and the GPU, date and versions the runs carried.
2. `build_table` builds the table from those block JSONs alone (``qerl claims`` writes it to
   ``results/claims.json``): one entry per claim (a)-(e) and LR with ``claim``, ``paper`` (the
   paper's setting and number, cited by section), ``kit`` (the kit's setting and measurement),
   ``ci`` (the headline comparison's interval), ``verdict``, and every comparison behind it.
   Notebook 07 rebuilds the table from the block JSONs alone, so a reader without a GPU can check it.

Verdicts follow ``docs/claims_plan.md`` (the pre-registration): holds / does not hold /
inconclusive from `claims.verdict` on the paired difference in the paper's direction, Holm-adjusted
within the family the plan names; equivalence for the schedules; the collapse rule for LR. A
claim made of several comparisons holds when all hold and does not hold when any does not hold.
Comparisons the plan does not name (for example entropy at equal learning rates) are listed as
``supplementary`` and never enter a verdict.

Where this differs from the plan's wording: the training reward is logged once per rollout, and
with μ = 2 a rollout serves two optimizer steps, so "the last 10 steps" of the reward endpoint are
the last 10 logged rollouts (20 optimizer steps).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from qerl_lib.errors import UserError
from qerl_lib.io import read_jsonl, write_json_atomic
from qerl_lib.studies.claims import (
    ALPHA, MARGIN, block_summary, by_seed, collapse_flags, equivalent, holm, load_results, mean_ci, paired_difference,
    problem_accuracy, problem_paired_difference, run_record, verdict,
)

# block -> the sweep (folder under the sweeps root, spec under data/sweeps/) that holds its runs
BLOCK_SWEEPS = {"b": "base", "c": "claims", "d": "claims", "e": "claims", "lr": "lr"}
CURVE_KEYS = ("reward", "entropy", "sigma")
LR_BASE_ARM = "base-bf16"

# The paper's side of each claim (QeRL, arXiv 2510.11696; sections as cited). Typed here once.
PAPER = {
    "a": ("A quantized base raises the policy's entropy during RL (more exploration)",
          "§3.2, Fig. 5: NVFP4-, NF4- and MXFP4-LoRA runs show higher token entropy than 16-bit LoRA "
          "(Qwen2.5-7B, GSM8K, r32; curves only, no numbers)"),
    "b": ("NVFP4 costs less base accuracy than NF4 and MXFP4",
          "Tab. 1 base rows, GSM8K: 7B BF16 76.3, NVFP4 73.4 (-2.9), MXFP4 71.3 (-5.0), NF4 70.5 (-5.8); "
          "3B BF16 61.2, NVFP4 59.4 (-1.8), MXFP4 59.8 (-1.4), NF4 57.5 (-3.7)"),
    "c": ("QeRL (NVFP4 + LoRA + AQN) ends above 16-bit LoRA and QLoRA",
          "Tab. 1, GSM8K after GRPO: 7B QeRL 90.8, LoRA 88.1, QLoRA 85.0; 3B 83.7, 76.1, 76.1 (Fig. 4 reward "
          "curves); QeRL trained at lr 1e-5, LoRA at 5e-6 (Tab. 4)"),
    "d": ("AQN on top of NVFP4 improves the result",
          "Fig. 8: with AQN the reward ends slightly above without (3B, ~100 steps; 7B, ~300 steps); Tab. 1: "
          "7B 90.8 vs 88.5, 3B 83.7 vs 83.3"),
    "e": ("The noise schedules perform alike",
          "Fig. 9 (3B, 150 steps): linear, exponential, cosine and logarithmic decay almost identical; exponential "
          "a little more stable late (curves only)"),
    "lr": ("QeRL stays stable at a learning rate where 16-bit LoRA collapses",
           "App. I, Fig. 16/17 (7B): at lr 3e-5 QeRL's reward grows about 2x faster and stays stable while BF16 "
           "LoRA becomes unstable or collapses; at 5e-6 the two are close"),
}


# ----------------------------------------------------------------------------- step 1: block JSONs
def export_block(sweep_dir: str | Path, block: str) -> dict:
    """The block JSON of `block` from the sweep folder that ran it (see the module docstring)."""
    sweep_dir = Path(sweep_dir)
    spec_path = sweep_dir / "spec.json"
    if not spec_path.is_file():
        raise UserError(f"{sweep_dir} is not a sweep folder (no spec.json): run `qerl sweep SPEC --out {sweep_dir}`")
    spec = json.loads(spec_path.read_text())["spec"]
    if block not in spec.get("blocks", {}):
        raise UserError(f"{sweep_dir}: its spec has no block {block!r} (blocks: {sorted(spec.get('blocks', {}))})")
    table = spec["blocks"][block]
    results = [r for r in load_results(sweep_dir) if r["arm"] in table["arms"]]
    if not results:
        raise UserError(f"{sweep_dir}: no finished run of block {block!r}: run the sweep first")
    summary = block_summary(block, table, [run_record(r) for r in results], results=results)
    out = {**summary, "sweep": spec["name"], "description": spec.get("description", ""),
           "n_runs": len(results), "n_runs_planned": len(table["arms"]) * len(spec["seeds"]),
           "spec": spec, "provenance": _runs_provenance(results, spec["name"], block)}
    if table.get("pairing") == "problem":
        out["problem_accuracy"] = {arm: problem_accuracy(results, arm) for arm in table["arms"]}
    else:
        out["curves"] = {arm: {str(r["seed"]): _curves(sweep_dir / "runs" / f"{arm}-s{r['seed']}")
                               for r in results if r["arm"] == arm and r["train"]} for arm in table["arms"]}
    if block == "lr":
        base = mean_ci(list(by_seed(out["runs"], LR_BASE_ARM, "heldout_pass1").values()))["mean"]
        trained = [r for r in out["runs"] if r["arm"] != LR_BASE_ARM]
        collapse_flags(trained, base)
        out["base_pass1"] = base
    return out


def _curves(run_dir: Path) -> dict:
    rows = [r for r in read_jsonl(run_dir / "train" / "metrics.jsonl") if r.get("reward") is not None]
    return {"step": [r["step"] for r in rows], **{k: [r.get(k) for r in rows] for k in CURVE_KEYS}}


def _runs_provenance(results: list[dict], sweep: str, block: str) -> dict:
    first = results[0]["provenance"]
    gpus = sorted({r["provenance"]["device"].get("name", "?") for r in results})
    dates = sorted(r["provenance"]["date"] for r in results)
    return {"device": {**first["device"], "name": " + ".join(gpus)}, "date": dates[-1], "first_run_date": dates[0],
            "versions": first["versions"],
            "command": f"qerl sweep data/sweeps/{sweep}.toml --out dev/runs/claims/{sweep}; "
                       f"qerl claims --export (block {block})"}


def export_blocks(sweeps_root: str | Path, out_dir: str | Path) -> dict[str, dict]:
    """Every block JSON from ``sweeps_root/SWEEP`` into ``out_dir/block_X.json``; returns them."""
    blocks = {}
    for block, sweep in BLOCK_SWEEPS.items():
        blocks[block] = export_block(Path(sweeps_root) / sweep, block)
        write_json_atomic(Path(out_dir) / f"block_{block}.json", blocks[block])
    return blocks


def read_blocks(folder: str | Path) -> dict[str, dict]:
    """The block JSONs of ``folder`` (``results/claims`` by default in the CLI)."""
    blocks = {}
    for block in BLOCK_SWEEPS:
        path = Path(folder) / f"block_{block}.json"
        if not path.is_file():
            raise UserError(f"{path} is missing: run `qerl claims --export` after the claim sweeps")
        blocks[block] = json.loads(path.read_text())
    return blocks


# ----------------------------------------------------------------------------- step 2: the table
def build_table(blocks: dict[str, dict]) -> dict:
    """The claims table (one entry per claim) from the block JSONs."""
    entries = [_claim_a(blocks["c"]), _claim_b(blocks["b"]), _claim_c(blocks["c"]), _claim_d(blocks["d"]),
               _claim_e(blocks["e"]), _claim_lr(blocks["lr"])]
    c = blocks["c"]
    setting = (f"SmolLM2-135M-Instruct, expression task level {c['spec']['common'].get('data_level', '?')}, "
               f"preset {c['spec']['preset']}, {len(c['spec']['seeds'])} seeds")
    runs = {(blocks[k]["sweep"], r["arm"], r["seed"]) for k in blocks for r in blocks[k]["runs"]}
    gpus = sorted({blocks[k]["provenance"]["device"]["name"] for k in blocks})
    return {"setting": setting, "n_runs": len(runs), "gpus": gpus, "margin": MARGIN, "alpha": ALPHA, "claims": entries,
            "provenance": {**c["provenance"], "command": "qerl claims (from results/claims/block_*.json)"}}


def _cmp(label: str, diff: dict, direction: int, rule: str = "superiority", supplementary: bool = False) -> dict:
    """One comparison row: estimate and CI in the paper's direction of the label (a - b)."""
    sign = direction
    ci = sorted(sign * x for x in diff["ci"]) if None not in diff["ci"] else [None, None]
    row = {"comparison": label, "estimate": None if diff["mean"] is None else sign * diff["mean"], "ci": ci,
           "n": diff["n"], "unit": diff.get("unit", "seed"), "p": diff.get("p"), "p_holm": diff.get("p_holm"),
           "supplementary": supplementary}
    if rule == "equivalence":
        row["verdict"] = {"equivalent": "holds", "different": "does not hold"}.get(equivalent(diff), "inconclusive")
        row["ci90"] = _ci90(diff)
    elif not supplementary:
        row["verdict"] = verdict(diff, direction=direction)
    return row


def _ci90(diff: dict) -> list:
    from qerl_lib.studies.claims import t_quantile

    if diff.get("n", 0) < 2 or diff.get("sd") is None:
        return [None, None]
    half = t_quantile(0.95, diff["n"] - 1) * diff["sd"] / diff["n"] ** 0.5
    return [diff["mean"] - half, diff["mean"] + half]


def _seed_diff(block: dict, a: str, b: str, endpoint: str = "heldout_pass1") -> dict:
    return paired_difference(by_seed(block["runs"], a, endpoint), by_seed(block["runs"], b, endpoint))


def _combine(rows: list[dict]) -> str:
    verdicts = [r["verdict"] for r in rows if not r["supplementary"]]
    if verdicts and all(v == "holds" for v in verdicts):
        return "holds"
    return "does not hold" if "does not hold" in verdicts else "inconclusive"


def _arm_mean(block: dict, arm: str, endpoint: str = "heldout_pass1") -> float:
    return block["per_arm"][arm][endpoint]["mean"]


def _entry(key: str, kit: str, rows: list[dict], headline: dict, verdict_: str | None = None, **extra) -> dict:
    claim, paper = PAPER[key]
    return {"id": key, "claim": claim, "paper": paper, "kit": kit, "estimate": headline["estimate"],
            "ci": headline["ci"], "ci_level": 0.90 if "ci90" in headline else 0.95,
            "verdict": verdict_ or _combine(rows), "comparisons": rows, **extra}


def _claim_a(c: dict) -> dict:
    diffs = [_seed_diff(c, "nvfp4", "lora", "mean_entropy"), _seed_diff(c, "qlora", "lora", "mean_entropy")]
    for d, p in zip(diffs, holm([d["p"] for d in diffs])):
        d["p_holm"] = p
    rows = [_cmp("nvfp4 - lora", diffs[0], +1), _cmp("qlora - lora", diffs[1], +1),
            _cmp("nvfp4 - lora at the same lr", _seed_diff(c, "nvfp4", "lora-at-qerl-lr", "mean_entropy"), +1,
                 supplementary=True)]
    for row in rows[:2]:  # entropy has no minimal effect size: "does not hold" needs the other direction
        row["verdict"] = verdict(_as_diff(row), direction=+1, margin=0.0)
    kit = (f"mean token entropy over the run: lora {_arm_mean(c, 'lora', 'mean_entropy'):.2f}, nvfp4 "
           f"{_arm_mean(c, 'nvfp4', 'mean_entropy'):.2f}, qlora {_arm_mean(c, 'qlora', 'mean_entropy'):.2f}; "
           f"nvfp4 - lora {rows[0]['estimate']:+.3f}, qlora - lora {rows[1]['estimate']:+.3f} "
           f"(lora at nvfp4's lr: nvfp4 - lora {rows[2]['estimate']:+.3f})")
    return _entry("a", kit, rows, rows[0], endpoint="mean_entropy")


def _as_diff(row: dict) -> dict:
    return {"n": row["n"], "mean": row["estimate"], "ci": row["ci"], "p": row["p"], "p_holm": row["p_holm"]}


def _claim_b(b: dict) -> dict:
    acc = b["problem_accuracy"]
    diffs = [problem_paired_difference(acc["nvfp4"], acc["nf4"]), problem_paired_difference(acc["nvfp4"], acc["mxfp4"])]
    for d, p in zip(diffs, holm([d["p"] for d in diffs])):
        d["p_holm"] = p
    rows = [_cmp("nvfp4 - nf4", diffs[0], +1), _cmp("nvfp4 - mxfp4", diffs[1], +1)]
    rows += [_cmp(f"{arm} - bf16", problem_paired_difference(acc[arm], acc["bf16"]), +1, supplementary=True)
             for arm in ("nvfp4", "mxfp4", "nf4")]
    means = ", ".join(f"{arm} {_arm_mean(b, arm):.3f}" for arm in ("bf16", "nvfp4", "mxfp4", "nf4"))
    n_problems = len(acc["bf16"])
    samples = b["spec"]["eval"]["samples"] * len(b["spec"]["seeds"])
    kit = (f"untrained base pass@1 on {n_problems} held-out problems x {samples} samples: {means}; "
           f"nvfp4 - nf4 {rows[0]['estimate']:+.3f}, nvfp4 - mxfp4 {rows[1]['estimate']:+.3f} (paired by problem)")
    return _entry("b", kit, rows, rows[0], endpoint="heldout_pass1")


def _block_rows(block: dict, reference: str, arms: list[str], direction: int, label) -> list[dict]:
    """Rows from the block's own (Holm-adjusted) comparisons `arm - reference`, turned into the paper's direction."""
    by_arm = {comp["arm"]: comp["heldout_pass1"] for comp in block["comparisons"]}
    return [_cmp(label(arm), by_arm[arm], direction) for arm in arms]


def _claim_c(c: dict) -> dict:
    arms = ["lora", "qlora", "lora-at-qerl-lr"]
    rows = _block_rows(c, "qerl", arms, -1, lambda arm: f"qerl - {arm}")  # paper: qerl above each
    means = ", ".join(f"{arm} {_arm_mean(c, arm):.3f}" for arm in ["qerl", *arms, "nvfp4"])
    kit = (f"held-out pass@1 after 60 steps: {means}; " +
           ", ".join(f"{r['comparison']} {r['estimate']:+.3f}" for r in rows))
    return _entry("c", kit, rows, rows[0], endpoint="heldout_pass1")


def _claim_d(d: dict) -> dict:
    rows = _block_rows(d, "nvfp4", ["qerl"], +1, lambda arm: f"{arm} - nvfp4")
    rows.append(_cmp("bf16-aqn - lora (noise without quantization)", _seed_diff(d, "bf16-aqn", "lora"), +1,
                     supplementary=True))
    means = ", ".join(f"{arm} {_arm_mean(d, arm):.3f}" for arm in ("nvfp4", "qerl", "lora", "bf16-aqn"))
    kit = (f"held-out pass@1: {means}; qerl - nvfp4 {rows[0]['estimate']:+.3f}; "
           f"control bf16-aqn - lora {rows[1]['estimate']:+.3f}")
    return _entry("d", kit, rows, rows[0], endpoint="heldout_pass1")


def _claim_e(e: dict) -> dict:
    rows = [_cmp(f"{comp['arm'].removeprefix('qerl-')} - exponential", comp["heldout_pass1"], +1, rule="equivalence")
            for comp in e["comparisons"]]
    lows = [r["ci90"][0] for r in rows if r["ci90"][0] is not None]
    highs = [r["ci90"][1] for r in rows if r["ci90"][1] is not None]
    headline = {"estimate": max((r["estimate"] for r in rows), key=abs), "ci": [min(lows), max(highs)], "ci90": True}
    paper_four = [r for r in rows if not r["comparison"].startswith("constant")]
    four = "equivalent" if all(r["verdict"] == "holds" for r in paper_four) else "not all shown equivalent"
    kit = (f"held-out pass@1 minus exponential's ({_arm_mean(e, 'qerl'):.3f}): " +
           ", ".join(f"{r['comparison'].split(' ')[0]} {r['estimate']:+.3f}" for r in rows) +
           f"; equivalence margin ±{MARGIN} (90% intervals); the paper's four decays alone: {four}; "
           "constant σ is the kit's extra control")
    out = _entry("e", kit, rows, headline, endpoint="heldout_pass1")
    out["ci_level"] = 0.90
    return out


def _claim_lr(lr: dict) -> dict:
    runs = [r for r in lr["runs"] if r["arm"] != LR_BASE_ARM]
    rates = sorted({r["learning_rate"] for r in runs})
    table = []
    for rate in rates:
        row = {"lr": rate}
        for mode in ("lora", "qerl"):
            these = [r for r in runs if r["learning_rate"] == rate and r["arm"].startswith(mode + "-")]
            row[mode] = {"collapsed": sum(r["collapsed"] for r in these), "seeds": len(these),
                         "diverged": sum(r.get("diverged_at_step") is not None for r in these),
                         "heldout_pass1": mean_ci([r["heldout_pass1"] for r in these])["mean"]}
        table.append(row)

    def most(cell):
        return cell["collapsed"] * 2 > cell["seeds"]

    holds = [t["lr"] for t in table if most(t["lora"]) and not most(t["qerl"])]
    against = [t["lr"] for t in table if most(t["qerl"]) and not most(t["lora"])]
    verdict_ = "holds" if holds else "does not hold" if against else "inconclusive"
    top = max(rates)
    top_arms = {r["arm"].split("-")[0]: r["arm"] for r in runs if r["learning_rate"] == top}
    diff = _seed_diff(lr, top_arms["qerl"], top_arms["lora"])
    rows = [_cmp(f"qerl - lora at lr {top:g}", diff, +1, supplementary=True)]
    counts = "; ".join(f"lr {t['lr']:g}: lora {t['lora']['collapsed']}/{t['lora']['seeds']}, "
                       f"qerl {t['qerl']['collapsed']}/{t['qerl']['seeds']}" for t in table)
    kit = (f"collapsed runs (pre-registered rule) {counts}; held-out pass@1 at lr {top:g}: "
           f"qerl - lora {diff['mean']:+.3f}")
    return _entry("lr", kit, rows, rows[0], verdict_=verdict_, endpoint="collapsed", ladder=table,
                  untrained_base_pass1=lr.get("base_pass1"))


# ----------------------------------------------------------------------------- rendering
def render_markdown(table: dict) -> str:
    """The README's claims table (markdown)."""
    lines = [f"{table['setting']}; {table['n_runs']} runs on {', '.join(table['gpus'])}. CI: the headline "
             "comparison's interval (95%; 90% for the schedules' equivalence test).", "",
             "| claim | paper | kit (135M model, this task) | CI | verdict |", "|---|---|---|---|---|"]
    for e in table["claims"]:
        ci = "-" if None in e["ci"] else f"[{e['ci'][0]:+.3f}, {e['ci'][1]:+.3f}] ({int(e['ci_level'] * 100)}%)"
        lines.append(f"| ({e['id']}) {e['claim']} | {e['paper']} | {e['kit']} | {ci} | **{e['verdict']}** |")
    return "\n".join(lines)


def format_table(table: dict) -> str:
    """Fixed-width terminal table: one line per comparison under its claim (stated in full), then a legend."""
    out = [f"claims at kit scale: {table['setting']}", ""]
    out.append(f"{'claim':6s} {'comparison':44s} {'estimate':>9s} {'CI (95%; 90% *)':>19s} {'p_holm':>8s}  verdict")
    for e in table["claims"]:
        out.append(f"({e['id']})".ljust(6) + f" {e['claim']}  -> {e['verdict']}")
        for r in e["comparisons"]:
            ci = r.get("ci90") or r["ci"]
            ci_text = "-" if None in ci else f"[{ci[0]:+.3f}, {ci[1]:+.3f}]" + ("*" if r.get("ci90") else "")
            p = "-" if r.get("p_holm") is None else f"{r['p_holm']:.3g}"
            tag = "(suppl.)" if r["supplementary"] else r.get("verdict", "")
            est = "-" if r["estimate"] is None else f"{r['estimate']:+.3f}"
            out.append(f"{'':6s} {r['comparison'][:44]:44s} {est:>9s} {ci_text:>19s} {p:>8s}  {tag}")
    legend = ("estimate: the paired difference of the two arms. CI: its Student-t interval (paired by seed; by "
              "problem for the untrained bases of (b)), not adjusted for multiple comparisons. 'holds' needs the "
              f"paper's direction with p_holm < {table['alpha']} (Holm's correction within the claim); 'does not "
              f"hold' needs the interval to rule out a {table['margin']} effect the paper's way, or a significant "
              "effect the other way; so an interval that excludes 0 can still be inconclusive. *: a 90% equivalence "
              f"interval, 'holds' when it lies inside +-{table['margin']} (the p_holm beside it tests a difference "
              "and is not read). (suppl.): context, not part of the verdict. (lr) is decided by the plan's collapse "
              "rule (the claim holds where most LoRA seeds collapse and most QeRL seeds do not), not by a difference.")
    out += ["", textwrap.fill(legend, width=110)]
    return "\n".join(out)
