"""The claims table: rebuilt from the committed block JSONs it equals results/claims.json, the README shows
it verbatim, and the verdict rules on small hand-made blocks (CPU, no model)."""

from __future__ import annotations

import json

import pytest

from qerl_lib.paths import REPO_ROOT, RESULTS_DIR
from qerl_lib.studies.claims_table import _claim_lr, _combine, build_table, read_blocks, render_markdown
from qerl_lib.studies.headline import read_block


def test_committed_table_is_what_its_block_jsons_give():
    table = json.loads(json.dumps(build_table(read_blocks(RESULTS_DIR / "claims"))))
    committed = json.loads((RESULTS_DIR / "claims.json").read_text())
    assert table == committed, "results/claims.json is stale: run `qerl claims --readme README.md`"
    assert [e["id"] for e in committed["claims"]] == ["a", "b", "c", "d", "e", "lr"]
    for entry in committed["claims"]:
        assert {"claim", "paper", "kit", "ci", "verdict"} <= set(entry)
        assert entry["verdict"] in ("holds", "does not hold", "inconclusive")


def test_readme_shows_the_committed_table():
    committed = json.loads((RESULTS_DIR / "claims.json").read_text())
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert read_block(readme, "claims") == render_markdown(committed), "run `qerl claims --readme README.md`"


def test_every_block_has_its_runs_spec_and_provenance():
    blocks = read_blocks(RESULTS_DIR / "claims")
    for name, block in blocks.items():
        assert block["runs"] and block["spec"]["blocks"][name]["arms"] == block["arms"]
        assert {"device", "date", "versions", "command"} <= set(block["provenance"])
        seeds = {arm: {r["seed"] for r in block["runs"] if r["arm"] == arm} for arm in block["arms"]}
        assert all(len(s) >= (3 if name == "lr" else 5) for s in seeds.values()), seeds
        assert all(r["heldout_pass1"] is not None for r in block["runs"]), "a run without held-out evaluation"


def _lr_block(collapsed: dict[tuple[str, float], int]) -> dict:
    runs = []
    for (mode, lr), n_collapsed in collapsed.items():
        for seed in range(3):
            runs.append({"arm": f"{mode}-lr{lr:g}", "seed": seed, "learning_rate": lr, "heldout_pass1": 0.5 - seed / 10,
                         "collapsed": seed < n_collapsed, "diverged_at_step": None})
    return {"runs": runs, "base_pass1": 0.3}


@pytest.mark.parametrize("collapsed, expected", [
    ({("lora", 1e-4): 0, ("qerl", 1e-4): 0, ("lora", 1e-3): 2, ("qerl", 1e-3): 1}, "holds"),
    ({("lora", 1e-4): 0, ("qerl", 1e-4): 0, ("lora", 1e-3): 0, ("qerl", 1e-3): 2}, "does not hold"),
    ({("lora", 1e-4): 0, ("qerl", 1e-4): 0, ("lora", 1e-3): 3, ("qerl", 1e-3): 3}, "inconclusive"),
    ({("lora", 1e-4): 1, ("qerl", 1e-4): 1, ("lora", 1e-3): 1, ("qerl", 1e-3): 0}, "inconclusive"),
])
def test_lr_verdict_follows_the_collapse_rule(collapsed, expected):
    assert _claim_lr(_lr_block(collapsed))["verdict"] == expected


def test_a_claim_of_several_comparisons_needs_all_of_them():
    rows = lambda *v: [{"verdict": x, "supplementary": False} for x in v] + [{"supplementary": True}]
    assert _combine(rows("holds", "holds")) == "holds"
    assert _combine(rows("holds", "inconclusive")) == "inconclusive"
    assert _combine(rows("holds", "does not hold")) == "does not hold"


def test_terminal_table_states_each_claim_whole_and_explains_its_columns():
    """`format_table` (notebook 07, `qerl claims`) prints every claim in full and a legend for the unadjusted CI,
    Holm's p, the equivalence interval's star and the supplementary rows."""
    from qerl_lib.studies.claims_table import format_table

    table = build_table(read_blocks(RESULTS_DIR / "claims"))
    text = format_table(table)
    for entry in table["claims"]:
        assert f"({entry['id']})".ljust(6) + f" {entry['claim']}  -> {entry['verdict']}" in text
    legend = " ".join(text.split("\n\n")[-1].split())
    for phrase in ("not adjusted for multiple comparisons", "p_holm <", "90% equivalence interval", "(suppl.)"):
        assert phrase in legend, phrase
