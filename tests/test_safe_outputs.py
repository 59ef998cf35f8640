"""Output folders: nothing the kit did not create is deleted, and nothing is replaced silently.

Every misuse of `--out` (`qerl quantize`, `qerl export`, `qerl prepare-model`, a training run's
folder, the adapter folder) must fail with one line naming the fix, exit 2, and leave the folder it
pointed at byte-for-byte as it was (a hash over every path and byte of the tree, before and after).
`--force` replaces a non-empty folder atomically, but never one that is, holds or lies inside an input.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from qerl_lib.cli import main
from qerl_lib.errors import UserError
from qerl_lib.io import atomic_directory, prepare_output_folder, refuse_overlap
from test_grpo import save_tiny_llama, tiny_config  # shared tiny-model helpers


@pytest.fixture(autouse=True)
def _one_thread(one_torch_thread):  # conftest.py
    yield


def tree_hash(root: Path) -> str:
    """sha256 over every path under ``root`` (files, folders, links) and every file's bytes."""
    h = hashlib.sha256()
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(dirs + files):
            path = Path(folder) / name
            h.update(str(path.relative_to(root)).encode() + b"\0")
            if path.is_symlink():
                h.update(b"link:" + os.readlink(path).encode())
            elif path.is_file():
                h.update(path.read_bytes())
    return h.hexdigest()


def run_cli(capsys, *argv) -> tuple[int, str]:
    code = main([str(a) for a in argv])
    err = capsys.readouterr().err.strip()
    return code, err


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """root/models/tiny (dense tiny Llama + tokenizer), root/adapter (a LoRA adapter of it)."""
    from qerl_lib.models.loader import load_model
    from qerl_lib.models.lora import attach_lora, save_adapters

    root = tmp_path_factory.mktemp("ws")
    model_dir = save_tiny_llama(root / "models" / "tiny", hidden=64, layers=2, heads=4, kv_heads=2)
    torch.manual_seed(1)
    peft_model = attach_lora(load_model(model_dir), rank=4)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)
    save_adapters(peft_model, root / "adapter")
    (root / "notes").mkdir()
    (root / "notes" / "mine.txt").write_text("a user's file the kit did not create\n")
    return root


# ------------------------------------------------------------------------------------------- the helper
def test_prepare_output_folder_rules(tmp_path):
    model = tmp_path / "model"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text("{}")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "x.txt").write_text("x")
    (tmp_path / "empty").mkdir()
    before = tree_hash(tmp_path)
    assert prepare_output_folder(tmp_path / "new", [model]) == tmp_path / "new"  # absent: fine
    assert prepare_output_folder(tmp_path / "empty", [model]) == tmp_path / "empty"  # empty: fine
    assert prepare_output_folder(tmp_path / "notes", [model], force=True) == tmp_path / "notes"
    for out, force, message in [
        (model, False, "is the input"), (model, True, "is the input"), (tmp_path, True, "contains the input"),
        (model / "sub", True, "is inside the input"), (model / "new" / "deeper", True, "is inside the input"),
        (model / "config.json", True, "is a file"), (tmp_path / "notes", False, "pass --force"),
    ]:
        with pytest.raises(UserError, match=message) as info:
            prepare_output_folder(out, [model], force=force)
        assert "\n" not in str(info.value)
    assert tree_hash(tmp_path) == before, "a check wrote or removed something"
    link = tmp_path / "link"
    link.symlink_to(model)
    with pytest.raises(UserError, match="symbolic link"):
        prepare_output_folder(link, [], force=True)
    with pytest.raises(UserError, match="is the input"):
        refuse_overlap(link, [model])
    refuse_overlap(tmp_path / "other", [model, None, "Qwen/Qwen2.5-7B-Instruct"])  # hub ids are not paths


def test_atomic_directory_keeps_the_old_folder_until_the_new_one_is_complete(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    before = tree_hash(tmp_path)
    with pytest.raises(RuntimeError, match="crash"):
        with atomic_directory(out, force=True) as tmp:
            (tmp / "half.bin").write_bytes(b"\0" * 100)
            raise RuntimeError("crash while writing")
    assert tree_hash(tmp_path) == before, "a failed write changed the folder or left a temp folder"
    with atomic_directory(out, force=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "temp or old folder left behind"
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]


def test_atomic_directory_replaces_only_what_it_was_allowed_to(tmp_path):
    """Library code that skips prepare_output_folder cannot delete a user's folder, file or link."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("a user's file")
    (tmp_path / "file").write_text("a user's file")
    (tmp_path / "link").symlink_to(out)
    before = tree_hash(tmp_path)
    for final, what in [(out, "non-empty folder"), (tmp_path / "file", "a file"), (tmp_path / "link", "symbolic link")]:
        with pytest.raises(UserError, match=what) as info:
            with atomic_directory(final) as tmp:
                (tmp / "new.txt").write_text("new")
        assert "\n" not in str(info.value) and "force=True" in str(info.value)
    assert tree_hash(tmp_path) == before, "a refused write changed something"
    (tmp_path / "empty").mkdir()
    for fresh in (tmp_path / "empty", tmp_path / "absent"):  # nothing to lose: written without force
        with atomic_directory(fresh) as tmp:
            (tmp / "new.txt").write_text("new")
        assert sorted(p.name for p in fresh.iterdir()) == ["new.txt"]
    # prepare_output_folder(force=True) clears the folder for one replacement, as the CLI's --force does
    prepare_output_folder(out, [], force=True)
    with atomic_directory(out) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]
    with pytest.raises(UserError, match="non-empty folder"):  # the clearance was used up
        with atomic_directory(out) as tmp:
            (tmp / "newer.txt").write_text("newer")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]


def test_save_nvfp4_checkpoint_refuses_a_users_folder_and_its_source(workspace, tmp_path):
    from qerl_lib.models.loader import load_model, replace_linear_with_nvfp4, save_nvfp4_checkpoint

    model_dir = workspace / "models" / "tiny"
    model = replace_linear_with_nvfp4(load_model(model_dir))
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "mine.txt").write_text("mine")
    before, model_before = tree_hash(tmp_path), tree_hash(model_dir)
    with pytest.raises(UserError, match="force=True"):
        save_nvfp4_checkpoint(model, notes, source_dir=model_dir)
    for out, message in [(model_dir, "is the input"), (model_dir / "nvfp4", "is inside the input"),
                         (workspace / "models", "contains the input")]:
        with pytest.raises(UserError, match=message):  # force does not override this
            save_nvfp4_checkpoint(model, out, source_dir=model_dir, force=True)
    with pytest.raises(UserError, match="is the input"):  # the source defaults to the folder it was loaded from
        save_nvfp4_checkpoint(model, model_dir)
    assert tree_hash(tmp_path) == before and tree_hash(model_dir) == model_before
    assert save_nvfp4_checkpoint(model, notes, source_dir=model_dir, force=True) == notes
    assert not (notes / "mine.txt").exists() and (notes / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------- qerl quantize
def test_quantize_refuses_a_non_empty_out_without_force(workspace, capsys):
    notes = workspace / "notes"
    before = tree_hash(notes)
    code, err = run_cli(capsys, "quantize", "--model", workspace / "models" / "tiny", "--out", notes,
                        "--backend", "native")
    assert code == 2 and "\n" not in err and "pass --force" in err, err
    assert tree_hash(notes) == before


@pytest.mark.parametrize("where,message", [
    ("model", "is the input"), ("models", "contains the input"), ("inside", "is inside the input"),
    ("link", "symbolic link"), ("file", "is a file"),
])
def test_quantize_never_replaces_an_input_even_with_force(where, message, workspace, tmp_path, capsys):
    model = workspace / "models" / "tiny"
    out = {"model": model, "models": workspace / "models", "inside": model / "nvfp4", "link": tmp_path / "link",
           "file": model / "config.json"}[where]
    if where == "link":
        out.symlink_to(model)
    watched = workspace / "models"
    before = tree_hash(watched)
    code, err = run_cli(capsys, "quantize", "--model", model, "--out", out, "--backend", "native", "--force")
    assert code == 2 and "\n" not in err and message in err, err
    assert tree_hash(watched) == before, f"--out {where} changed the model tree"


def test_quantize_with_force_replaces_a_folder_atomically(workspace, tmp_path, capsys):
    from qerl_lib.models.loader import is_nvfp4_checkpoint, load_model

    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("replaced with --force")
    code, err = run_cli(capsys, "quantize", "--model", workspace / "models" / "tiny", "--out", out,
                        "--backend", "native", "--force")
    assert code == 0, err
    assert not (out / "stale.txt").exists() and is_nvfp4_checkpoint(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "a temp or old folder was left beside --out"
    load_model(out)


# ------------------------------------------------------------------------------------------- qerl export
@pytest.mark.parametrize("where,force,message", [
    ("adapter", True, "is the input"), ("inside-adapter", True, "is inside the input"),
    ("model", True, "is the input"), ("root", True, "contains the input"), ("notes", False, "pass --force"),
])
def test_export_misuse_is_refused_and_changes_nothing(where, force, message, workspace, capsys):
    out = {"adapter": workspace / "adapter", "inside-adapter": workspace / "adapter" / "merged",
           "model": workspace / "models" / "tiny", "root": workspace, "notes": workspace / "notes"}[where]
    before = tree_hash(workspace)
    code, err = run_cli(capsys, "export", "--model", workspace / "models" / "tiny", "--lora", workspace / "adapter",
                        "--out", out, *(["--force"] if force else []))
    assert code == 2 and "\n" not in err and message in err, err
    assert tree_hash(workspace) == before, f"--out {where} changed the workspace"


# ------------------------------------------------------------------------------------------- qerl prepare-model
def test_prepare_model_misuse_is_refused_and_changes_nothing(tmp_path, capsys):
    gguf_dir = tmp_path / "ggufs"
    gguf_dir.mkdir()
    gguf = gguf_dir / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)  # refused before it is read
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "mine.txt").write_text("mine")
    before = tree_hash(tmp_path)
    cases = [(["--out", tmp_path / "notes"], "pass --force"),
             (["--out", gguf_dir, "--force"], "contains the input"),
             (["--out", gguf, "--force"], "is a file"),
             (["--out", tmp_path, "--force"], "contains the input")]
    for extra, message in cases:
        code, err = run_cli(capsys, "prepare-model", "--gguf", gguf, *extra)
        assert code == 2 and "\n" not in err and message in err, (extra, err)
        assert tree_hash(tmp_path) == before, extra
    code, err = run_cli(capsys, "prepare-model", "--gguf", tmp_path / "absent.gguf", "--out", tmp_path / "m")
    assert code == 2 and "is not a file" in err, err


def test_prepare_embedded_model_never_replaces_an_unmarked_folder_silently(tmp_path):
    from qerl_lib.models.embedded import SOURCE_MARKER, prepare_embedded_model

    gguf_dir = tmp_path / "ggufs"
    gguf_dir.mkdir()
    gguf = gguf_dir / "model.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 60)  # refused before it is read
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")  # an interrupted conversion or someone's folder: no marker
    (tmp_path / "file").write_text("mine")
    before = tree_hash(tmp_path)
    for out in (half, tmp_path / "file"):
        with pytest.raises(UserError, match=f"lacks {SOURCE_MARKER}") as info:
            prepare_embedded_model(gguf=gguf, out=out, quiet=True)
        assert "\n" not in str(info.value) and f"--out {out} --force" in str(info.value)
    for out, message in [(gguf_dir, "contains the input"), (tmp_path, "contains the input")]:
        with pytest.raises(UserError, match=message):  # even with force
            prepare_embedded_model(gguf=gguf, out=out, force=True, quiet=True)
    assert tree_hash(tmp_path) == before
    (half / SOURCE_MARKER).write_text("{}")  # marked complete: returned as is, nothing read or written
    assert prepare_embedded_model(gguf=gguf, out=half, quiet=True) == half
    assert sorted(p.name for p in half.iterdir()) == ["config.json", SOURCE_MARKER]


# ------------------------------------------------------------------------------------------- training runs
def test_a_run_folder_never_overlaps_its_inputs_or_overwrites_files(workspace, tmp_path):
    from qerl_lib.train.metrics import prepare_output

    model = workspace / "models" / "tiny"
    config = tiny_config(model, "lora")
    before = tree_hash(workspace)
    for out, message in [(model, "is the input"), (model / "run", "is inside the input"),
                         (workspace, "contains the input")]:
        for resume in (False, True):
            with pytest.raises(UserError, match=message):
                prepare_output(out, config, resume=resume)
    assert tree_hash(workspace) == before
    data = tmp_path / "data" / "problems.jsonl"
    data.parent.mkdir()
    data.write_text('{"question": "1+1", "answer": "2"}\n')
    with pytest.raises(UserError, match="contains the input"):
        prepare_output(tmp_path, tiny_config(model, "lora", data="file", data_path=str(data)), resume=False)
    held = tmp_path / "held"
    (held / "adapter").mkdir(parents=True)
    (held / "adapter" / "mine.txt").write_text("mine")
    before = tree_hash(held)
    with pytest.raises(UserError, match=r"already holds a run \(adapter\)"):
        prepare_output(held, config, resume=False)
    assert tree_hash(held) == before
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("kept")
    assert prepare_output(other, config, resume=False) is None  # a fresh run beside unrelated files
    assert (other / "notes.txt").read_text() == "kept" and (other / "run.json").is_file()


def test_adapters_replace_only_an_adapter_folder(workspace, tmp_path):
    from qerl_lib.models.loader import load_model
    from qerl_lib.models.lora import attach_lora, save_adapters

    peft_model = attach_lora(load_model(workspace / "models" / "tiny"), rank=4)
    foreign = tmp_path / "adapter"
    foreign.mkdir()
    (foreign / "mine.txt").write_text("mine")
    before = tree_hash(tmp_path)
    with pytest.raises(UserError, match="pass --force"):
        save_adapters(peft_model, foreign)
    assert tree_hash(tmp_path) == before
    again = save_adapters(peft_model, tmp_path / "ours")
    first = (again / "adapter_model.safetensors").read_bytes()
    save_adapters(peft_model, again)  # an adapter folder of the kit's own is replaced
    assert (again / "adapter_model.safetensors").read_bytes() == first
    save_adapters(peft_model, foreign, force=True)
    assert not (foreign / "mine.txt").exists() and (foreign / "adapter_config.json").is_file()


# ------------------------------------------------------------------------------------------- JSON
@pytest.mark.parametrize("value, shown", [(float("nan"), "NaN"), (float("inf"), "Infinity"),
                                          (-float("inf"), "-Infinity"), (torch.tensor(float("nan")), "NaN")],
                         ids=["nan", "inf", "-inf", "tensor"])
def test_json_writers_refuse_nan_naming_the_key_path(value, shown, tmp_path):
    from qerl_lib.io import append_jsonl_atomic, write_json_atomic, write_jsonl_atomic

    doc = {"formats": {"nvfp4": {"per_problem": [0.5, value], "n": 2}}, "ok": 1.0}
    with pytest.raises(ValueError) as info:
        write_json_atomic(tmp_path / "m.json", doc)
    message = str(info.value)
    assert "\n" not in message and f"{shown} at formats.nvfp4.per_problem[1]" in message and "null" in message
    assert str(tmp_path / "m.json") in message
    with pytest.raises(ValueError, match=r"line 2: .* at score"):
        write_jsonl_atomic(tmp_path / "rows.jsonl", [{"score": 1.0}, {"score": value}])
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "a refused write left a file (or a temp file) behind"
    append_jsonl_atomic(tmp_path / "log.jsonl", {"step": 1, "loss": 0.5})
    before = (tmp_path / "log.jsonl").read_bytes()
    with pytest.raises(ValueError, match=r"new line: .* at loss"):
        append_jsonl_atomic(tmp_path / "log.jsonl", {"step": 2, "loss": value})
    assert (tmp_path / "log.jsonl").read_bytes() == before
    with pytest.raises(ValueError, match=r"at \(top level\)"):
        write_json_atomic(tmp_path / "x.json", value)


def test_json_writers_write_null_and_plain_values(tmp_path):
    import json

    from qerl_lib.io import write_json_atomic

    doc = {"entropy": None, "entropy_note": "no completion tokens to score", "t": torch.tensor(2.5),
           "rows": [(1, 2.0)], "path": tmp_path}
    path = write_json_atomic(tmp_path / "m.json", doc)
    strict = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert strict == {"entropy": None, "entropy_note": "no completion tokens to score", "t": 2.5,
                      "rows": [[1, 2.0]], "path": str(tmp_path)}
