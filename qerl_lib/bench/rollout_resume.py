"""`qerl bench rollout --json F` run again: which of ``F``'s rows the sweep keeps instead of measuring them again.

A case is one planned row of the sweep (`bench.rollout.plan_unit`): the kit's engine is built afresh for every row
(and transformers' baseline times each row on its own), so a finished row is kept on its own; vLLM's rows of one model
and weights come from one process, so they are kept only all together (one missing or failed: that model and
weights' vLLM process runs again). A row is matched to its case by `CONFIGURATION` (the fields `--merge` also tells
measurements apart by), reading the backend asked for where the row names the one that ran ("auto" becomes the
engine's choice, `engine.rollout.resolve_decode_backend`; a vLLM row names vLLM's version). A row with an
``error`` is never kept (its case runs again).

A file is resumed only if it is one run's record (rows, provenance, config; a ``--merge`` result is not), its
config equals this command's in every field but the ones that choose cases (`SELECTING`: a run may add models,
batches...) and the few that do not change a number (`NOT_COMPARED`), and each of its rows without an error is a
case of this command. Anything else is refused in one line naming ``--force`` (which starts over) rather than mixed in
or silently replaced.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from qerl_lib.bench.rollout import Row, RolloutBenchConfig, plan_sweep
from qerl_lib.bench.rollout_report import CONFIGURATION
from qerl_lib.engine.rollout import resolve_decode_backend
from qerl_lib.errors import UserError
from qerl_lib.io import RESUME_FIX, resumable_record

# `RolloutBenchConfig` fields that choose which cases run: a file written with other values is resumed (its rows
# of this command's cases kept). Every other field must be equal, but for `NOT_COMPARED`: where the profile is
# printed and where vLLM's packages and checkpoint live (a vLLM row names vLLM's version itself).
SELECTING = ("models", "weights", "batches", "lora_ranks", "backends", "scheduling", "lora_merge", "engines",
             "hf_baseline", "hf_batches")
NOT_COMPARED = ("profile", "vllm_pythonpath", "vllm_workdir")
_ABSENT = object()  # a field a row or config lacks (an older version's): equal to no value


def case_key(row: dict) -> tuple:
    """What identifies a measured row's case: its `CONFIGURATION` values, a vLLM row's backend (vLLM's version)
    read as "vllm"."""
    values = {**row, "backend": "vllm"} if row.get("engine") == "vllm" else row
    return tuple(values.get(k, _ABSENT) for k in CONFIGURATION)


def planned_key(row: Row, device_type: str) -> tuple:
    """`case_key` of the row a planned one (`plan_unit`, the backend asked for) becomes on ``device_type``."""
    values = asdict(row)
    if row.engine == "qerl":
        values["backend"] = resolve_decode_backend(row.backend, device_type)
    return case_key(values)


def resume_rows(path: str | Path, cfg: RolloutBenchConfig, device_type: str = "cuda") -> tuple[list[dict], list[dict]]:
    """The rows of an existing ``--json`` that a sweep of ``cfg`` on ``device_type`` need not measure again (pass them
    to `run_rollout_bench` as ``kept``), and the provenance of the runs that measured them, oldest first, each with
    its ``code`` hashes where the file has them (empty when nothing is kept); ``([], [])`` when ``path`` does not
    exist. Refused with a one-line `UserError` naming ``--force``: see the module docstring."""
    path = Path(path)
    if not path.exists():
        return [], []
    fix = RESUME_FIX
    doc, runs = resumable_record(path, "qerl bench rollout", tables=("provenance", "config"),
                                 note="; a --merge result is not resumed")
    mine, there = json.loads(json.dumps(asdict(cfg))), doc["config"]
    changed = [f"{k} {_shown(there.get(k, _ABSENT))} there, {_shown(mine[k])} here" for k in mine
               if k not in SELECTING + NOT_COMPARED and there.get(k, _ABSENT) != mine[k]]
    if changed:
        raise UserError(f"--json {path} holds rows measured with other settings ({'; '.join(changed[:3])}): {fix}")
    try:
        for row in doc["rows"]:
            Row(**row)
    except TypeError as e:  # fields this kit's rows do not have (or lack)
        raise UserError(f"--json {path} holds rows that do not match this kit's rollout rows ({e}): {fix}") from None
    plan = plan_sweep(cfg)
    wanted = Counter(planned_key(row, device_type) for *_, entries in plan for _, row in entries)
    good = [r for r in doc["rows"] if r.get("error") is None]
    seen: Counter = Counter()
    foreign = []
    for row in good:
        seen[case_key(row)] += 1
        if seen[case_key(row)] > wanted[case_key(row)]:
            foreign.append(row)
    if foreign:
        raise UserError(f"--json {path} holds {len(foreign)} row(s) of cases this command does not run (the first: "
                        f"{_described(foreign[0])}): name them in the flags, {fix}")
    partial = set()  # (model, weights) whose vLLM rows are not all there: its vLLM process runs again
    for name, weights, entries in plan:
        peers = Counter(planned_key(row, device_type) for kind, row in entries if kind == "vllm")
        have = Counter(case_key(r) for r in good
                       if r["engine"] == "vllm" and (r["model"], r["weights"]) == (name, weights))
        if have != peers:
            partial.add((name, weights))
    kept = [r for r in good if r["engine"] != "vllm" or (r["model"], r["weights"]) not in partial]
    if not kept:
        return [], []
    return kept, [*runs[:-1], {**runs[-1], "code": doc.get("code")}] if runs else []


def _shown(value) -> str:
    return "absent" if value is _ABSENT else repr(value)


def _described(row: dict) -> str:
    """A row in a few words, e.g. "qwen2.5-7b nvfp4 qerl batch 8 rank 16, graphs+fused, static"."""
    merged = ", merged adapters" if row.get("lora_merged") else ""
    return (f"{row['model']} {row['weights']} {row['engine']} batch {row['batch']} rank {row['rank']}, "
            f"{row['backend']}, {row.get('scheduling')}, {row['prompt_len']} + {row['gen_len']} tokens{merged}")
