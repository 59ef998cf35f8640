"""Where the kit keeps things: the model cache, the repository's data/, figures/ and artifacts/."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
DATA_DIR = REPO_ROOT / "data"
CONFIGS_DIR = DATA_DIR / "configs"
FIGURES_DIR = REPO_ROOT / "figures"
ARTIFACTS_DIR = REPO_ROOT / "artifacts"
RESULTS_DIR = REPO_ROOT / "results"
NOTEBOOKS_DIR = REPO_ROOT / "notebooks"


def cache_dir() -> Path:
    """`$QERL_CACHE`, default `~/.cache/qerl`: converted models live here, never in the repo."""
    return Path(os.environ.get("QERL_CACHE", Path.home() / ".cache" / "qerl")).expanduser()


def hub_reachable(host: str = "huggingface.co", timeout: float = 3.0) -> bool:
    """Quick offline check (DNS + TCP connect), so offline users get an error at once, not after retries."""
    import os
    import socket

    if os.environ.get("HF_HUB_OFFLINE", "0") not in ("0", "", "false", "False"):
        return False
    try:
        with socket.create_connection((host, 443), timeout=timeout):
            return True
    except OSError:
        return False


def load_model_config(model: str) -> dict:
    """`data/configs/<model>.json` (a Qwen2.5 architecture, shapes only) as a dict; unknown names list the known ones."""
    import json

    from qerl_lib.errors import UserError

    path = CONFIGS_DIR / f"{model}.json"
    if not path.exists():
        known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
        raise UserError(f"unknown model {model!r}: no {path.name} in {CONFIGS_DIR} (known: {', '.join(known)})")
    return json.loads(path.read_text(encoding="utf-8"))
