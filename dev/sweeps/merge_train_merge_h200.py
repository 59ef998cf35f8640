"""Write results/train_step_merge_h200.json from eight `qerl bench train` records on H200s.

Rows: 7B and 14B at batch 8, 256 + 2048, modes qerl / lora with the rollout's adapters merged and not, the KV
cache remappable (dev/runs/train_remap_h200_2026-11-29/, dev/LOG.md section 107; it replaced section 100's run,
which had replaced section 63's; their records stay in dev/runs/train_merge_h200_2026-11-29/ and
dev/runs/train_merge_h200_2026-11-28/); the 7B GSM8K preset's own step, qerl and lora merged, one measured step each (dev/runs/preset_step_h200_2026-11-28/, section 68); and the data-parallel rows, 7B
qerl at batch 16 and 64 on one and on two GPUs of a 2-GPU machine, with the remappable cache
(dev/runs/two_gpu_remap_h200x2_2026-11-29/bench_train_2gpu.json, section 111; it replaced section 104's run 2, whose
record stays in dev/runs/two_gpu_h200x2_2026-11-29/run2/); the 32B step at batch 2, qerl and lora, with the
remappable cache, two measured steps each (dev/runs/train_32b_h200_2026-11-29/, section 108); and Tab. 3's batch-2
step at 7B and 14B, lora and qerl (dev/runs/two_gpu_remap_h200x2_2026-11-29/train_b2.json, section 111, on GPU 0
of the 2-GPU machine alone); Tab. 8's 32B step at batch 8, qerl and lora, two measured steps each
(dev/runs/tab3_tab8_h200x2_2026-11-29/train_32b_b8.json, section 118); and Tab. 3's batch-4 step at 7B and 14B, lora
and qerl, five measured steps each (dev/runs/b4_rerun_h200x2_2026-11-29/, section 118: they replace that section's
two-step run, as planned before the rerun). The speedup columns stay as each run computed them: within a run, against the lora rows of the same
case, and against the one-GPU row of the same case.
Run from the repository root: python dev/sweeps/merge_train_merge_h200.py
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from qerl_lib.io import write_json_atomic  # noqa: E402

SOURCES = [Path("dev/runs/train_remap_h200_2026-11-29/train_merge.json"),
           Path("dev/runs/preset_step_h200_2026-11-28/preset_step.json"),
           Path("dev/runs/two_gpu_remap_h200x2_2026-11-29/bench_train_2gpu.json"),
           Path("dev/runs/train_32b_h200_2026-11-29/train_32b.json"),
           Path("dev/runs/two_gpu_remap_h200x2_2026-11-29/train_b2.json"),
           Path("dev/runs/tab3_tab8_h200x2_2026-11-29/train_32b_b8.json"),
           Path("dev/runs/b4_rerun_h200x2_2026-11-29/train_b4_7b.json"),
           Path("dev/runs/b4_rerun_h200x2_2026-11-29/train_b4_14b.json")]


def main() -> None:
    docs = [json.loads(p.read_text()) for p in SOURCES]
    write_json_atomic(Path("results/train_step_merge_h200.json"),
                      {"rows": [r for d in docs for r in d["rows"]], "provenance": [d["provenance"] for d in docs]})


if __name__ == "__main__":
    main()
