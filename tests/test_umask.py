"""Outputs keep the user's umask: every atomic writer gives files 0o666 & ~umask and folders 0o777 & ~umask.

The temporary files and folders the writers start from are private (mkstemp 0600, mkdtemp 0700); without
a chmod before the rename every figure, JSON and checkpoint would end up -rw------- whatever the umask.
Each test runs under two non-default umasks, so a hard-coded mode (0644 / 0755) fails one of them.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from qerl_lib import io as qio


@pytest.fixture(params=[0o027, 0o002], ids=["umask027", "umask002"])
def umask(request):
    old = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_umask_is_read_without_changing_it(umask, monkeypatch):
    assert qio.current_umask() == umask
    assert qio.file_mode() == 0o666 & ~umask and qio.folder_mode() == 0o777 & ~umask
    assert os.umask(umask) == umask, "reading the umask changed it"

    def no_proc(*args, **kwargs):  # systems without /proc: set and restore
        raise OSError("no /proc")

    monkeypatch.setattr(qio, "open", no_proc, raising=False)
    assert qio.current_umask() == umask
    assert os.umask(umask) == umask, "the fallback did not restore the umask"


def test_json_and_text_writers(umask, tmp_path):
    expected = 0o666 & ~umask
    written = [qio.write_text_atomic(tmp_path / "a.txt", "x"), qio.write_json_atomic(tmp_path / "b.json", {"a": 1}),
               qio.write_jsonl_atomic(tmp_path / "c.jsonl", [{"a": 1}]),
               qio.append_jsonl_atomic(tmp_path / "d.jsonl", {"a": 1})]
    qio.append_jsonl_atomic(tmp_path / "d.jsonl", {"a": 2})  # the rewrite keeps the mode too
    for path in written:
        assert mode(path) == expected, f"{path.name}: {oct(mode(path))}, expected {oct(expected)}"
    nested = qio.write_json_atomic(tmp_path / "new" / "deeper" / "e.json", {})
    assert mode(nested.parent) == 0o777 & ~umask and mode(nested) == expected


def test_figures(umask, tmp_path):
    from qerl_lib.plots.style import new_figure, save_figure

    fig, axes = new_figure()
    axes[0].plot([0, 1], [1, 0])
    png = save_figure(fig, tmp_path / "figures" / "07_x.png")
    assert mode(png) == 0o666 & ~umask and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in png.parent.iterdir()] == ["07_x.png"], "temporary file left behind"


def test_atomic_directory(umask, tmp_path):
    from safetensors.torch import save_file
    import torch

    with qio.atomic_directory(tmp_path / "out") as tmp:
        (tmp / "plain.bin").write_bytes(b"x")  # written by a library (transformers, peft) with open()
        qio.write_json_atomic(tmp / "meta.json", {})
        (tmp / "sub").mkdir(mode=0o700)
        save_file({"w": torch.zeros(2)}, str(tmp / "sub" / "model.safetensors"))  # safetensors writes 0600
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o755)  # made more open on purpose: not narrowed
    out = tmp_path / "out"
    assert mode(out) == mode(out / "sub") == 0o777 & ~umask
    for name in ("plain.bin", "meta.json", "sub/model.safetensors"):
        assert mode(out / name) == 0o666 & ~umask, f"{name}: {oct(mode(out / name))}"
    assert mode(out / "run.sh") == 0o755 | (0o666 & ~umask)


def test_checkpoints_written_by_the_kit(umask, tmp_path):
    import torch

    from qerl_lib.models.loader import quantize_checkpoint
    from test_grpo import save_tiny_llama

    old = os.umask(0o077)  # the source is private: the output's modes come from the umask, not from it
    try:
        src = save_tiny_llama(tmp_path / "src", hidden=32, layers=1, heads=2, kv_heads=1)
    finally:
        os.umask(old)
    torch.set_num_threads(1)
    out = quantize_checkpoint(src, tmp_path / "nvfp4", backend="native")
    assert mode(out) == 0o777 & ~umask
    for path in out.iterdir():
        assert mode(path) == 0o666 & ~umask, f"{path.name}: {oct(mode(path))}"
