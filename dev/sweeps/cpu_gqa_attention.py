"""CPU timing behind engine/forward.sdpa_attention's note: masked decode attention with K/V repeated per
query head (transformers' way) against SDPA's enable_gqa, at the embedded model's shapes (9 query heads,
3 KV heads, head dim 64), batch 64, 236 cached columns of a longer cache. Also checks both give the same
bits. Writes one JSON to argv[1] (default: stdout only). Run: python dev/sweeps/cpu_gqa_attention.py OUT.json
"""

import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402

B, H, KV, L, D, REPS = 64, 9, 3, 236, 64, 30
torch.manual_seed(0)
k_cache, v_cache = torch.randn(B, KV, 512, D), torch.randn(B, KV, 512, D)
k, v, q = k_cache[:, :, :L], v_cache[:, :, :L], torch.randn(B, H, 1, D)
mask = torch.rand(B, 1, 1, L) > 0.1


def repeated():
    return F.scaled_dot_product_attention(q, k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1),
                                          attn_mask=mask, scale=0.125)


def shared():
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.125, enable_gqa=True)


def ms(fn):
    fn()
    start = time.perf_counter()
    for _ in range(REPS):
        fn()
    return (time.perf_counter() - start) / REPS * 1e3


record = {"shape": {"batch": B, "heads": H, "kv_heads": KV, "columns": L, "head_dim": D}, "threads": torch.get_num_threads(),
          "repeat_kv_ms": ms(repeated), "enable_gqa_ms": ms(shared), "bit_identical": torch.equal(repeated(), shared()),
          "provenance": provenance(command="python dev/sweeps/cpu_gqa_attention.py")}
print({k: v for k, v in record.items() if k != "provenance"})
if len(sys.argv) > 1:
    write_json_atomic(sys.argv[1], record)
