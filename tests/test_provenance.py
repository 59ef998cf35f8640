"""The provenance block every results JSON carries (``qerl_lib/io.provenance``)."""

from __future__ import annotations

import os

from qerl_lib.io import provenance


def test_provenance_records_the_qerl_switches_that_were_set_and_nothing_else(monkeypatch):
    for name in [k for k in os.environ if k.startswith("QERL_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("QERL_LORA_ROWS", "0")
    monkeypatch.setenv("QERL_PDL", "1")
    monkeypatch.setenv("NOT_QERL_SWITCH", "x")
    block = provenance("qerl bench rollout")
    assert block["command"] == "qerl bench rollout"
    assert block["environment"] == {"QERL_LORA_ROWS": "0", "QERL_PDL": "1"}
    monkeypatch.delenv("QERL_LORA_ROWS")
    monkeypatch.delenv("QERL_PDL")
    assert provenance("x")["environment"] == {}


def test_provenance_names_the_library_source_it_ran_and_the_hash_follows_every_source(tmp_path):
    from qerl_lib.io import library_sha256

    block = provenance("x")
    assert block["library_sha256"] == library_sha256() and len(block["library_sha256"]) == 12
    (tmp_path / "kernels").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "k.cu").write_text("// kernel\n")
    first = library_sha256(tmp_path)
    assert library_sha256(tmp_path) == first  # the same tree, the same hash
    (tmp_path / "kernels" / "k.cu").write_text("// kernel, changed\n")
    second = library_sha256(tmp_path)
    assert second != first  # a CUDA source counts
    (tmp_path / "notes.txt").write_text("not a source")
    (tmp_path / "kernels" / "k.cpython-311.pyc").write_bytes(b"cache")
    assert library_sha256(tmp_path) == second  # other files do not
    (tmp_path / "a.py").rename(tmp_path / "b.py")
    assert library_sha256(tmp_path) != second  # a renamed module counts


def test_tree_sha256_of_a_file_is_its_bytes_hash(tmp_path):
    import hashlib

    from qerl_lib.io import tree_sha256

    f = tmp_path / "r.json"
    f.write_text('{"a": 1}')
    assert tree_sha256(f) == hashlib.sha256(b'{"a": 1}').hexdigest()[:12]
    f.write_text('{"a": 2}')
    assert tree_sha256(f) == hashlib.sha256(b'{"a": 2}').hexdigest()[:12]
