"""Run 17 (H200; dev/LOG.md): the decode step with the NVFP4 matmuls launched early (PDL).

Question: the step breakdown (``rollout_step_breakdown.py``, H200, 7B NVFP4, batch 8, context
1280) gives 3.0 ms per step, of which the NVFP4 matmuls take 1.94 ms; q/k/v and o stream at only
26-30% of copy bandwidth (7-8 us for 7-9 MB): launch, first DRAM round trip and tail, per matmul.
With programmatic dependent launch the matmul's CTAs start while the kernel before it runs, fetch
their first weights and wait (``griddepcontrol.wait``) for x. That needs the kernel before to
trigger early, so the norms and SiLU * up become ``engine/glue.py``'s Triton kernels (which do) instead
of ``torch.compile``'s (which do not); the attention kernels trigger too. How much does each piece
give, with the L2::128B load hint of run 16? Every decode kernel of the kit (matmul, norms, SiLU,
RoPE + cache write, attention and its merge) waits for its predecessor and then triggers its
successor (qerl_lib.kernels.pdl). Also: more attention programs (slices) per layer.

Engine at Qwen2.5-7B shapes (random weights), batch 8, 256 prompt + 2048 generated, per setting.
Each setting goes in through public switches: ``time_engine(glue_kernels=..., attention_launch=
AttentionLaunch(programs=...))``, the ``QERL_PDL`` environment variable (read at each launch) and
``set_small_m_kernel(model, mma_rule=...)`` for the L2 hint. Writes $OUT/pdl_ablation.jsonl as it
goes (OUT defaults to dev/runs/) and prints a table last.

    PYTHONPATH=$PWD python dev/sweeps/rollout_pdl_ablation.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch

from qerl_lib.bench.rollout import Row, load_bench_model, time_engine
from qerl_lib.bench.table import format_table
from qerl_lib.engine.attention import AttentionLaunch
from qerl_lib.kernels import mma
from qerl_lib.kernels.pdl import PDL_ENV
from qerl_lib.models.nvfp4_linear import set_small_m_kernel

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
T0 = time.time()
LOG = open(os.path.join(OUT, "pdl_ablation.jsonl"), "a")

# (label, weights, glue kernels, PDL, l2_hint, attention programs target)
SETTINGS = [
    ("before (compiled glue, no PDL, no hint)", "nvfp4", False, False, 0, 264),
    ("L2 hint + Triton glue, no PDL", "nvfp4", True, False, 1, 264),
    ("+ PDL on every decode kernel", "nvfp4", True, True, 1, 264),
    ("+ PDL, attention 2x programs", "nvfp4", True, True, 1, 528),
    ("+ PDL, attention 4x programs", "nvfp4", True, True, 1, 1056),
    ("bf16, compiled glue, no PDL", "bf16", False, False, 0, 264),
    ("bf16, Triton glue + PDL", "bf16", True, True, 0, 264),
]


def main() -> None:
    rows, models = [], {}
    for label, weights, glue, early, hint, programs in SETTINGS:
        if weights not in models:
            models.clear()
            torch.cuda.empty_cache()
            models[weights] = load_bench_model("qwen2.5-7b", weights, torch.device("cuda"))
        previous_pdl = os.environ.get(PDL_ENV)
        os.environ[PDL_ENV] = "1" if early else "0"
        set_small_m_kernel(models[weights], mma_rule=lambda m, n, k, h=hint:
                           dataclasses.replace(mma.pick_mma_config(m, n, k), l2_hint=h))
        try:
            row = time_engine(models[weights], Row("qwen2.5-7b", weights, 8, 0, "auto", "qerl", 256, 2048), "auto",
                              None, 2, 0, glue_kernels=glue, attention_launch=AttentionLaunch(programs=programs))
        finally:
            set_small_m_kernel(models[weights])  # back to the launch rule
            if previous_pdl is None:
                os.environ.pop(PDL_ENV, None)
            else:
                os.environ[PDL_ENV] = previous_pdl
        rec = {"label": label, "glue_kernels": glue, "pdl": early, "l2_hint": hint, "attention_programs": programs,
               **dataclasses.asdict(row), "t": round(time.time() - T0, 1),
               "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
        LOG.write(json.dumps(rec) + "\n")
        LOG.flush()
        rows.append(rec)
        print(f"{label:<42} {weights:>5} {row.tok_s:8.1f} tok/s {row.ms_per_step:7.3f} ms/step", flush=True)
    print()
    print(format_table(rows, (("label", "", 42), ("weights", "", 7), ("tok_s", ".1f", 8), ("ms_per_step", ".3f", 11))))
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
