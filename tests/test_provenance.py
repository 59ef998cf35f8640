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
