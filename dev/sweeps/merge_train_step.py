"""Write results/train_step_h100.json from the `qerl bench train` records in dev/runs/train_step_h100_2026-11-24b/.

Rows: Qwen2.5-7B lora / qlora / nvfp4 / qerl and 14B qerl / lora / qlora measured with kernels/lora.py (the
engine's LoRA kernels), and the 32B qerl batch-2 row of the previous record (measured before those kernels,
with the torch LoRA path; its peak already converted to GiB, see that record's `corrections`).
Run from the repository root: python dev/sweeps/merge_train_step.py
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from qerl_lib.io import write_json_atomic  # noqa: E402

RUNS = Path("dev/runs/train_step_h100_2026-11-24b")
SOURCES = ["train_7b_lora_kernels.json", "train_14b_lora_kernels.json", "train_14b_qlora.json"]


def main() -> None:
    rows, provenance = [], []
    for name in SOURCES:
        doc = json.loads((RUNS / name).read_text())
        rows += doc["rows"]
        provenance.append(doc["provenance"])
    previous = json.loads((RUNS / "train_step_h100_previous.json").read_text())
    old = [r for r in previous["rows"] if r["model"] == "qwen2.5-32b"]
    rows += old
    provenance += [p for p in previous["provenance"] if "qwen2.5-32b" in p["command"]]
    doc = {"rows": rows, "provenance": provenance,
           "corrections": previous["corrections"] + [
               "2026-11-24: the 7B and 14B rows were measured again with the engine's LoRA kernels "
               "(kernels/lora.py); the 32B row predates them (torch LoRA path)"],
           "sources": [str(RUNS / n) for n in SOURCES] + [str(RUNS / "train_step_h100_previous.json")]}
    write_json_atomic("results/train_step_h100.json", doc)
    for r in rows:
        print(f"{r['model']:12s} {r['mode']:6s} b{r['batch']} step {r['step_s']:.2f} s rollout {r['rollout_s']:.2f} "
              f"train {r['train_s']:.2f} peak {r['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
