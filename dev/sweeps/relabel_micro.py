"""The decode step's glue kernels with and without the relabeled second output (dev/LOG.md section 38).

Run 2 of section 38 found the engine's step slower with the relabeled copies (batch 32: 4.75 -> 5.17 ms) and the
SiLU x up + LoRA kernel's time up by ~17 us a call. This times each kernel alone at Qwen2.5-7B shapes, 32 and 64
rows, plain and relabeled, microseconds per call (a CUDA graph of CALLS calls, median of REPLAYS replays, PDL off):
residual + RMSNorm (3584 wide), SiLU x up (18944 wide) with and without the gate/up LoRA r16 expand, the permute
kernel they replace, and the decode attention (28 heads, 4 KV heads, 768 cached columns). VARIANT (environment)
names the glue/attention kernels' version under test in the JSON. Writes relabel_micro{TAG}.json to $OUT.

Run on a GPU: python dev/sweeps/relabel_micro.py
"""

import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lora_kernel_micro import time_calls  # noqa: E402
from qerl_lib.engine import attention, glue  # noqa: E402
from qerl_lib.io import provenance  # noqa: E402
from qerl_lib.kernels import fp4_wgmma, pdl  # noqa: E402
from tests.test_lora_kernels import make_group  # noqa: E402

HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, CONTEXT = 3584, 18944, 28, 4, 128, 768
OUT = os.environ.get("OUT", ".")
TAG = os.environ.get("TAG", "")


def main() -> None:
    pdl.use_for = lambda device: False  # plain launches: each kernel's own time
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    act = torch.nn.SiLU()
    rows_out = []
    for m in (32, 64):
        x, d = (torch.randn(m, HIDDEN, generator=g, device=dev).to(torch.bfloat16) for _ in range(2))
        w = torch.ones(HIDDEN, dtype=torch.bfloat16, device=dev)
        fused = torch.randn(m, 2 * INTER, generator=g, device=dev).to(torch.bfloat16)
        gate, up = fused[:, :INTER], fused[:, INTER:]
        plan, xs, base = make_group(m, HIDDEN, [(INTER, 16, 2.0), (INTER, 16, 2.0)], torch.bfloat16, "cuda", seed=m)
        shrunk = __import__("qerl_lib.kernels.lora", fromlist=["shrink_"]).shrink_(xs, plan, use_pdl=False)
        q = torch.randn(m, HEADS, HEAD_DIM, generator=g, device=dev).to(torch.bfloat16)
        kc = torch.randn(m, KV_HEADS, CONTEXT, HEAD_DIM, generator=g, device=dev).to(torch.bfloat16)
        vc = torch.randn(m, KV_HEADS, CONTEXT, HEAD_DIM, generator=g, device=dev).to(torch.bfloat16)
        pad, col = torch.zeros(m, dtype=torch.long, device=dev), torch.tensor([CONTEXT - 1], device=dev)
        a_out = torch.empty(m, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=dev)
        cases = {
            "norm": lambda: glue.residual_rms_norm(x, d, w, 1e-6),
            "norm relabeled": lambda: glue.residual_rms_norm(x, d, w, 1e-6, relabeled=True),
            "permute 3584": lambda: fp4_wgmma.permute_x(x),
            "silu": lambda: glue.silu_mul(act, gate, up),
            "silu relabeled": lambda: glue.silu_mul(act, gate, up, relabeled=True),
            "silu+lora": lambda: glue.silu_mul(act, base[:, :INTER], base[:, INTER:], lora=shrunk),
            "silu+lora relabeled": lambda: glue.silu_mul(act, base[:, :INTER], base[:, INTER:], lora=shrunk,
                                                         relabeled=True),
            "permute 18944": lambda: fp4_wgmma.permute_x(gate.contiguous()),
            "attention": lambda: attention.decode_attention(q, kc, vc, pad, col, 0.08, out=a_out.view(m, HEADS, HEAD_DIM)),
            "attention relabeled": lambda: attention.decode_attention(
                q, kc, vc, pad, col, 0.08, out=a_out.view(m, HEADS, HEAD_DIM),
                out_relabeled=torch.empty(m, HEADS * HEAD_DIM, dtype=torch.bfloat16, device=dev)),
        }
        for name, fn in cases.items():
            us = time_calls(fn)
            rows_out.append({"rows": m, "kernel": name, "us": round(us, 2)})
            print(f"M={m:3d} {name:22s} {us:8.2f} us", flush=True)
    doc = {"provenance": provenance(), "variant": os.environ.get("VARIANT", "committed"), "rows": rows_out}
    path = os.path.join(OUT, f"relabel_micro{TAG}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
