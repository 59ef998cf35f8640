"""Write results/train_step_h100.json from the `qerl bench train` records in dev/runs/train_step_h100_2026-11-24{b,c}/.

Rows: Qwen2.5-7B lora / qerl at batch 8 from the 2026-11-28 budget run (5 steps, medians over 4, all 28 layers
recomputing; its settings that kept more layers ran out of memory and are left out here; dev/LOG.md section 46);
7B nvfp4 at batch 8 from the first process of the spread run (6 steps, medians over 5;
dev/LOG.md section 23); 7B qerl at batch 8 and the 7B GSM8K preset's own settings (lora / qlora / qerl,
`--preset-settings --num-iterations 1`) from run c (the NVFP4 backward on the kernel path); 7B qlora at batch 8
and 14B qerl / lora / qlora from run b (with kernels/lora.py, before that backward: qlora and lora do not use
it, the 14B qerl row predates it); and the 32B qerl batch-2 row of the first record (torch LoRA path; its peak
already converted to GiB, see that record's `corrections`).
Run from the repository root: python dev/sweeps/merge_train_step.py
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.getcwd())
from qerl_lib.io import write_json_atomic  # noqa: E402
from qerl_lib.studies.train_bench import add_speedups  # noqa: E402

RUNS = Path("dev/runs/train_step_h100_2026-11-24b")
RUN_C = Path("dev/runs/train_step_h100_2026-11-24c")
SPREAD = Path("dev/runs/train_spread_h100_2026-11-24")
BUDGET = Path("dev/runs/trainer_budget_h100_2026-11-28")
SOURCES = [BUDGET / "budget_7b_lora.json", BUDGET / "budget_7b_qerl.json", SPREAD / "train_7b_spread_a.json", RUN_C / "train_7b_fp4_backward.json", RUN_C / "train_7b_preset_qerl.json", RUN_C / "train_7b_preset_lora.json",
           RUN_C / "train_7b_preset_qlora.json", RUNS / "train_7b_lora_kernels.json",
           RUNS / "train_14b_lora_kernels.json", RUNS / "train_14b_qlora.json"]


def main() -> None:
    rows, provenance = [], []
    for path in SOURCES:
        doc = json.loads(path.read_text())
        # the first source that has a (model, mode, batch) keeps it: run c's 7B rows replace run b's; rows that
        # did not run (the budget run's out-of-memory settings) stay in their dev/runs record
        new = [r for r in doc["rows"] if r.get("error") is None and all((r["model"], r["mode"], r["batch"]) != (o["model"], o["mode"], o["batch"])
                                             for o in rows)]
        rows += new
        if new:
            provenance.append(doc["provenance"])
    previous = json.loads((RUNS / "train_step_h100_previous.json").read_text())
    old = [r for r in previous["rows"] if r["model"] == "qwen2.5-32b"]
    rows += old
    provenance += [p for p in previous["provenance"] if "qwen2.5-32b" in p["command"]]
    add_speedups(rows)  # over the lora row of the same case, whichever run it came from
    doc = {"rows": rows, "provenance": provenance,
           "corrections": previous["corrections"] + [
               "2026-11-24: the 7B and 14B rows were measured again with the engine's LoRA kernels "
               "(kernels/lora.py); the 32B row predates them (torch LoRA path)",
               "2026-11-24 (run c): 7B lora / nvfp4 / qerl at batch 8 measured again with the NVFP4 backward on the "
               "kernel path, and the 7B preset rows added; the bf16 lora trainer phase of the batch-8 case has "
               "measured 4.43, 2.66 and 4.40 s in three runs (dev/LOG.md section 18)",
               "2026-11-24 (spread run): 7B lora / nvfp4 at batch 8 over 6 steps (medians over 5) in two processes; "
               "the first process's rows replace run c's. The bf16 trainer phase has occasional slow steps (one of "
               "ten at 5.2 s), which run c's median over two steps did not absorb (dev/LOG.md section 23)",
               "2026-11-28 (budget run): 7B lora / qerl at batch 8 measured again (5 steps, medians over 4, all 28 layers "
               "recomputing) with the decode kernels of dev/LOG.md sections 26-46, the bf16 LoRA A as weight rows "
               "included; they replace the spread run's lora row and run c's qerl row (dev/LOG.md section 46)"],
           "sources": [str(p) for p in SOURCES] + [str(RUNS / "train_step_h100_previous.json")]}
    write_json_atomic("results/train_step_h100.json", doc)
    for r in rows:
        print(f"{r['model']:12s} {r['mode']:6s} b{r['batch']:<3} step {r['step_s']:.2f} s rollout {r['rollout_s']:.2f} "
              f"train {r['train_s']:.2f} peak {r['peak_gib']:.1f} GiB")


if __name__ == "__main__":
    main()
