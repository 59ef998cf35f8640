"""Shared figure helpers: a headless backend, one look, atomic PNG writes, JSON input."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import matplotlib

from qerl_lib.io import file_mode, tree_sha256

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
    """Save `fig` as PNG atomically; `source` (the JSON, or run folder, it was drawn from) is stamped in the corner
    and recorded in the PNG's text chunks: ``Source`` (the path as given) and ``Source-SHA256`` (``io.tree_sha256``
    of it), so that a figure can be checked against the data it claims (tests/test_hygiene.py does, for results/).

    The PNG gets mode 0o666 & ~umask, as a plain `open` would give it (not the temporary file's 0600).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {}
    if source is not None:
        fig.text(0.995, 0.005, f"data: {Path(source).name}", ha="right", va="bottom", fontsize=6, color="0.5")
        metadata = {"Source": str(source), "Source-SHA256": tree_sha256(source) if Path(source).exists() else "missing"}
    fig.tight_layout()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}.", suffix=".png", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), file_mode())  # mkstemp's 0600 would make the figure private
            fig.savefig(f, dpi=130, format="png", metadata=metadata)
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename publishes it, as io.write_text_atomic does
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
