"""Run 20 (H200; dev/LOG.md): the last few percent at 7B -- decode-attention launch shape and
deeper prologues for the small q/k/v and o matmuls now that they start early (PDL).

Question: with PDL, the fused sampler and the RoPE table the 7B NVFP4 engine runs at 2963 tok/s on
the H200 (batch 8, 256 + 2048). The decode attention is the largest piece after the matmuls
(~11 us per layer at 1,280 cached tokens for 21 MB, under half of copy bandwidth). (1) Which
block size, warps, pipelining depth and program count make it fastest (CUDA-graph timer, 7B
shape, 1,280 and 2,240 cached tokens)? (2) Does the engine gain from the best of them, and from a
deeper register ring (loaded before the PDL wait) on the q/k/v and o matmuls?

The attention shapes are ``engine.attention.AttentionLaunch`` values, passed to ``decode_attention``
and to the engine (``time_engine(..., attention_launch=...)``); the matmul variants are launch rules
handed to the engine's layers with ``set_small_m_kernel(model, mma_rule=...)``. Writes
$OUT/attention_depth.jsonl as it goes (OUT defaults to dev/runs/) and prints tables.

    PYTHONPATH=$PWD python dev/sweeps/rollout_attention_depth_sweep.py
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import time

import torch

from qerl_lib.bench.gemm import time_graph
from qerl_lib.bench.rollout import Row, load_bench_model, time_engine
from qerl_lib.bench.table import format_table
from qerl_lib.engine.attention import DEFAULT_LAUNCH, AttentionLaunch, decode_attention
from qerl_lib.kernels import mma
from qerl_lib.models.nvfp4_linear import set_small_m_kernel

OUT = os.environ.get("OUT", "dev/runs")  # where the kept records live
T0 = time.time()
LOG = open(os.path.join(OUT, "attention_depth.jsonl"), "a")
DEFAULT = dataclasses.asdict(DEFAULT_LAUNCH)  # block, warps, stages, programs


def emit(rec: dict) -> None:
    rec["t"] = round(time.time() - T0, 1)
    LOG.write(json.dumps(rec) + "\n")
    LOG.flush()


def attention_sweep() -> list[tuple[float, dict]]:
    b, h, kv, d = 8, 28, 4, 128
    results = []
    for ctx in (1280, 2240):
        length = ((ctx + 255) // 256) * 256  # the engine's length bucket
        caches = [(torch.randn(b, kv, length, d, device="cuda").to(torch.bfloat16),
                   torch.randn(b, kv, length, d, device="cuda").to(torch.bfloat16)) for _ in range(8)]
        q = torch.randn(b, h, d, device="cuda").to(torch.bfloat16)
        pad = torch.zeros(b, dtype=torch.long, device="cuda")
        col = torch.tensor([ctx - 1], device="cuda")
        for block, warps, stages, programs in itertools.product((32, 64, 128), (2, 4, 8), (1, 2, 3, 4), (132, 264, 528)):
            cfg = dict(block=block, warps=warps, stages=stages, programs=programs)
            launch = AttentionLaunch(**cfg)
            try:
                t = time_graph([(lambda k=k, v=v: decode_attention(q, k, v, pad, col, d ** -0.5, launch=launch))
                                for k, v in caches]).median_ms
            except Exception as err:  # noqa: BLE001 - shared memory limits etc.: record and go on
                emit({"kind": "attention", "ctx": ctx, **cfg, "error": str(err)[:160]})
                continue
            emit({"kind": "attention", "ctx": ctx, **cfg, "us": round(t * 1e3, 2)})
            results.append((ctx, t * 1e3, cfg))
        del caches
    by_cfg: dict[str, float] = {}
    for ctx, us, cfg in results:
        by_cfg[json.dumps(cfg)] = by_cfg.get(json.dumps(cfg), 0.0) + us
    ranked = sorted(by_cfg.items(), key=lambda kv: kv[1])
    shown = ranked[:8] + [(json.dumps(DEFAULT), by_cfg.get(json.dumps(DEFAULT), float("nan")))]  # the best, then the default
    print(format_table([{**json.loads(key), "us(1280)+us(2240)": total} for key, total in shown],
                       (("block", "", 5), ("warps", "", 5), ("stages", "", 6), ("programs", "", 8),
                        ("us(1280)+us(2240)", ".2f", 17))), flush=True)
    return [(total, json.loads(key)) for key, total in ranked]


def rollout(settings) -> None:
    model = load_bench_model("qwen2.5-7b", "nvfp4", torch.device("cuda"))
    for label, attention, small in settings:
        # small: MmaConfig fields replaced on the q/k/v and o shapes (neither wide nor deep)
        set_small_m_kernel(model, mma_rule=(lambda m, n, k, s=small: dataclasses.replace(mma.pick_mma_config(m, n, k), **s)
                                            if n < 8 * k and k < 4 * n else mma.pick_mma_config(m, n, k)) if small else None)
        try:
            row = time_engine(model, Row("qwen2.5-7b", "nvfp4", 8, 0, "auto", "qerl", 256, 2048), "auto", None, 2, 0,
                              attention_launch=AttentionLaunch(**attention))
        finally:
            set_small_m_kernel(model)  # back to the launch rule
        emit({"kind": "rollout", "label": label, "attention": attention, "small_shapes": small,
              **dataclasses.asdict(row), "device": torch.cuda.get_device_name(0)})
        print(f"{label:<40} {row.tok_s:8.1f} tok/s {row.ms_per_step:7.3f} ms/step", flush=True)


def main() -> None:
    print(torch.cuda.get_device_name(0), flush=True)
    ranked = attention_sweep()
    best = ranked[0][1]
    second = next((c for _, c in ranked[1:] if c["block"] != best["block"] or c["warps"] != best["warps"]), ranked[1][1])
    rollout([
        ("default", DEFAULT, None),
        (f"attention {best}", best, None),
        (f"attention {second}", second, None),
        ("q/k/v, o: depth 3, min_ctas 1", DEFAULT, {"depth": 3, "min_ctas": 1}),
        ("q/k/v, o: depth 4, min_ctas 1", DEFAULT, {"depth": 4, "min_ctas": 1}),
        ("best attention + depth 3", best, {"depth": 3, "min_ctas": 1}),
    ])
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
