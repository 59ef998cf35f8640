"""GPU check of the per-row sampling streams (engine/sampling.py): the cost of one decode step's draws.

Times, at Qwen2.5's vocabulary (152064) and batch 8/64/128, torch's exponential_ from one generator (the
per-call stream) against RowStreams.exponentials (the Triton hash kernel), each followed by the fused
sampler, with CUDA events over 200 repetitions. Writes one JSON to $OUT (or the current folder).
Run: python dev/sweeps/row_streams_gpu.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qerl_lib.engine.sampling import RowStreams, fused_sample  # noqa: E402
from qerl_lib.io import provenance  # noqa: E402

VOCAB, REPS = 152064, 200


def timed(fn) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(REPS):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / REPS  # microseconds per call


rows = []
for batch in (8, 64, 128):
    logits = torch.randn(batch, VOCAB, device="cuda", dtype=torch.bfloat16)
    generator = torch.Generator(device="cuda").manual_seed(0)
    streams = RowStreams(list(range(batch)), "cuda")

    def per_call():
        race = torch.empty(batch, VOCAB, dtype=torch.float32, device="cuda").exponential_(1.0, generator=generator)
        return fused_sample(logits, race)

    def per_row():
        return fused_sample(logits, streams.exponentials(VOCAB, 7))

    rows.append({"batch": batch, "vocab": VOCAB, "per_call_us": timed(per_call), "per_row_us": timed(per_row)})
    print(rows[-1], flush=True)

out = os.environ.get("OUT", ".")
record = {"rows": rows, "device": torch.cuda.get_device_name(), "provenance": provenance(
    command="python dev/sweeps/row_streams_gpu.py")}
with open(os.path.join(out, "row_streams_gpu.json"), "w") as f:
    json.dump(record, f, indent=1)
