"""Shared figure helpers: a headless backend, one look, atomic PNG writes, JSON input."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import matplotlib

from qerl_lib.io import file_mode

matplotlib.use("Agg")  # headless: notebooks under papermill, CI, GPU machines
import matplotlib.pyplot as plt  # noqa: E402

# one colour per weight format / run mode, used by every figure
COLORS = {"bf16": "#4c72b0", "nvfp4": "#55a868", "mxfp4": "#c44e52", "nf4": "#8172b2",
          "lora": "#4c72b0", "qlora": "#8172b2", "qerl": "#dd8452"}


def load_json(path: str | os.PathLike) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def new_figure(ncols: int = 1, width: float = 5.0, height: float = 3.6):
    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, axes[0]


def save_figure(fig, path: str | os.PathLike, source: str | os.PathLike | None = None) -> Path:
    """Save `fig` as PNG atomically; `source` (the JSON it was drawn from) is stamped in the corner.

    The PNG gets mode 0o666 & ~umask, as a plain `open` would give it (not the temporary file's 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if source is not None:
        fig.text(0.995, 0.005, f"data: {Path(source).name}", ha="right", va="bottom", fontsize=6, color="0.5")
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 would make the figure private
            fig.savefig(f, dpi=130, format="png")
        os.replace(tmp, path)
    finally:
        plt.close(fig)
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def has_value(d: dict | None) -> bool:
    """A paired difference that was computed (``mean_diff`` is null, with a note, when no problem had a
    value on both sides): the figures draw those as "n/a" instead of failing."""
    return bool(d) and d.get("mean_diff") is not None
