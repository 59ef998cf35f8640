"""Reading the results files for the README's tables: a missing file or field is one line naming both.

`headline` (the README's GPU table and results/README.md's index), `headline_training` (its training rows) and
`speed_claims` (the paper's speed and memory claims) read the JSONs of ``results/`` through these helpers, and format
numbers and tables with the same few functions, so every table writes a ratio or a rate the same way.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

from qerl_lib.errors import UserError


class ResultsError(UserError):
    """A results file is missing, or lacks a field the README's table needs."""


# ---- reading ------------------------------------------------------------------------------------

def load_result(results_dir: str | Path, name: str) -> dict:
    path = Path(results_dir) / name
    if not path.is_file():
        raise ResultsError(f"{path}: not found; the README's results tables read it (restore it, or change "
                           f"qerl_lib/studies/headline.py / headline_training.py / speed_claims.py)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ResultsError(f"{path}: not valid JSON ({e})") from None


def field(doc, *keys, file: str):
    """``doc[k1][k2]...``, or a `ResultsError` naming `file` and the first missing key."""
    value, trail = doc, ""
    for key in keys:
        trail += f"[{key!r}]"
        try:
            value = value[key]
        except (KeyError, IndexError, TypeError):
            raise ResultsError(f"{file}: missing field {trail}") from None
    if value is None:
        raise ResultsError(f"{file}: field {trail} is null")
    return value


def checked_rows(doc: dict, file: str, keys: tuple[str, ...]) -> list[dict]:
    rows = field(doc, "rows", file=file)
    for i, row in enumerate(rows):
        for key in keys:
            if key not in row:
                raise ResultsError(f"{file}: missing field ['rows'][{i}][{key!r}]")
    return rows


def provenances(doc: dict, file: str) -> list[dict]:
    prov = field(doc, "provenance", file=file)
    return prov if isinstance(prov, list) else [prov]


def device_name(doc: dict, file: str) -> str:
    """The GPU of the file's run(s), from its provenance ("NVIDIA " dropped); several as "A + B"."""
    names = []
    for i, prov in enumerate(provenances(doc, file)):
        if "device" not in prov or "name" not in prov["device"]:
            raise ResultsError(f"{file}: missing field ['provenance'][{i}]['device']['name']")
        name = str(prov["device"]["name"]).removeprefix("NVIDIA ")
        if name not in names:
            names.append(name)
    return " + ".join(names)


ROLLOUT_KEYS = ("model", "weights", "batch", "rank", "engine", "prompt_len", "gen_len", "tok_s", "peak_gib", "error")
BATCH8 = dict(batch=8, prompt_len=256, gen_len=2048, engine="qerl")  # the paper's rollout setting, the kit's engine


def matching_row(rows: list[dict], file: str, **match) -> dict:
    """The first error-free row matching ``match``, or a `ResultsError` naming the file and the match."""
    for r in rows:
        if r["error"] is None and all(r[k] == v for k, v in match.items()):
            return r
    raise ResultsError(f"{file}: no measured row with {', '.join(f'{k}={v}' for k, v in match.items())}")


def fastest(rows: list[dict], file: str, **match) -> dict:
    """The fastest error-free row matching `match` (the engine uses whichever backend measures faster)."""
    hits = [r for r in rows if r["error"] is None and r["tok_s"] and all(r[k] == v for k, v in match.items())]
    if not hits:
        what = ", ".join(f"{k}={v}" for k, v in match.items())
        raise ResultsError(f"{file}: no measured row with {what}")
    return max(hits, key=lambda r: r["tok_s"])


# ---- formatting ---------------------------------------------------------------------------------

def times(ratio: float, decimals: int = 2) -> str:
    """A ratio as the tables print it (three decimals where a target sits close to the value)."""
    return f"{ratio:.{decimals}f}×"


def tok_text(tok_s: float) -> str:
    return f"{tok_s:.0f}"


def ktok_text(tok_s: float) -> str:
    return f"{tok_s / 1000:#.3g}k"


def model_size(model: str) -> float:
    """'qwen2.5-32b' -> 32.0, for ordering models by size."""
    m = re.search(r"(\d+(?:\.\d+)?)b$", model)
    return float(m.group(1)) if m else math.inf


def ci_text(d: dict, file: str) -> str:
    mean, low, high = (field(d, k, file=file) for k in ("mean_diff", "low", "high"))
    return f"{mean:+.3f} nats, 95% CI [{low:+.3f}, {high:+.3f}]"


def markdown_table(header: tuple[str, ...], rows) -> str:
    """A markdown table of ``rows`` under ``header`` (a ``|`` inside a cell escaped)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)
