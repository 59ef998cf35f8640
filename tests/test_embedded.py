"""The embedded default model: conversion, idempotence, chat, and failure modes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from qerl_lib.models import embedded
from qerl_lib.errors import UserError


def test_prepare_model_is_idempotent(embedded_model_dir):
    files = {p.name: p.stat().st_mtime_ns for p in embedded_model_dir.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= set(files)
    r = subprocess.run([sys.executable, "-m", "qerl_lib", "prepare-model"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines()[-1] == str(embedded_model_dir)
    assert {p.name: p.stat().st_mtime_ns for p in embedded_model_dir.iterdir()} == files  # nothing rewritten


def test_folder_loads_with_plain_transformers_and_chats(embedded_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_model_dir)
    model = AutoModelForCausalLM.from_pretrained(embedded_model_dir)
    assert model.dtype == torch.bfloat16 and not list(embedded_model_dir.glob("*.bin"))
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == end
    ids = tok.apply_chat_template([{"role": "user", "content": "Say hello."}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    out = model.generate(**ids, max_new_tokens=48, do_sample=False)
    new = out[0, ids["input_ids"].shape[1]:].tolist()
    assert end in new, "the model must end its turn with <|im_end|> within 48 tokens"
    assert new.index(end) == len(new) - 1, "generation must stop at <|im_end|>"
    assert len(tok.decode(new[:-1]).strip()) > 0


def test_tokenizer_config_does_not_ask_for_cleanup_that_transformers_ignores(embedded_model_dir):
    """The GGUF's ``clean_up_tokenization_spaces=True`` is saved as False: transformers ignores it for this BPE
    tokenizer (decoding is the same either way) and warned about it at every load."""
    import json

    assert json.loads((embedded_model_dir / "tokenizer_config.json").read_text())["clean_up_tokenization_spaces"] is False


def test_truncated_gguf_gives_clear_error_and_no_folder(tmp_path):
    source = embedded.find_embedded_gguf()
    bad = tmp_path / "truncated.gguf"
    with open(source, "rb") as f:
        bad.write_bytes(f.read(3_000_000))
    out = tmp_path / "model"
    with pytest.raises(UserError, match="truncated or corrupt"):
        embedded.prepare_embedded_model(gguf=bad, out=out, quiet=True)
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".model")], "temporary folder left behind"


def test_packaged_gguf_with_wrong_hash_is_refused(tmp_path, monkeypatch):
    bad = tmp_path / embedded.GGUF_NAME
    bad.write_bytes(b"GGUF" + os.urandom(1000))
    monkeypatch.setattr(embedded, "find_embedded_gguf", lambda: bad)
    monkeypatch.delenv("QERL_GGUF", raising=False)
    with pytest.raises(UserError, match="sha256"):
        embedded.prepare_embedded_model(out=tmp_path / "m", quiet=True)
    assert not (tmp_path / "m").exists()


def test_unknown_model_offline_is_one_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError, match="local model folder"):
        embedded.resolve_model("nobody/not-a-model")
    with pytest.raises(UserError, match="neither a local folder"):
        embedded.resolve_model("./no/such/folder")


def test_aliases_resolve_to_the_embedded_folder(embedded_model_dir):
    assert embedded.resolve_model("smollm2") == str(embedded_model_dir)
    assert embedded.resolve_model(None) == str(embedded_model_dir)
    assert embedded.resolve_model(str(embedded_model_dir)) == str(embedded_model_dir)


def test_a_finished_conversion_needs_no_package(tmp_path, monkeypatch):
    """A folder with the marker a finished conversion writes is returned as it is, even where the package (and so
    the GGUF) is absent, e.g. a GPU machine carrying only the converted tokenizer; without the marker the missing
    package is still reported in one line."""
    def missing():
        raise UserError("the embedded model package is not installed")

    monkeypatch.setattr(embedded, "find_embedded_gguf", missing)
    monkeypatch.delenv("QERL_GGUF", raising=False)
    done = tmp_path / "done"
    done.mkdir()
    (done / embedded.SOURCE_MARKER).write_text("{}")
    assert embedded.prepare_embedded_model(out=done, quiet=True) == done
    with pytest.raises(UserError, match="not installed"):
        embedded.prepare_embedded_model(out=tmp_path / "empty", quiet=True)
