"""Where `fused_layers.rotary` and transformers' `apply_rotary_pos_emb` differ in bf16 on a GPU (dev/LOG.md 95).

    python3 dev/sweeps/rotary_diag.py --json dev/runs/NAME.json

The CUDA test `test_cuda_rotary_bf16_bit_for_bit`'s first case (2 sequences, 28 heads, 4 KV heads, 301 positions,
shared cos/sin), run in float32, float16 and bfloat16: for q's and k's outputs and gradients, the count of elements
that differ and the largest difference in units of the last place; for the first few that differ, the inputs and
both results beside the value computed on the CPU with every rounding spelled out (float64 products and sums, each
rounded to the dtype as torch rounds them), so the odd one out is named.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
from qerl_lib.io import provenance, write_json_atomic  # noqa: E402
from qerl_lib.train import fused_layers  # noqa: E402


def rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(torch.float64)


def spelled_out(x, c, s, dtype, backward: bool):
    """The rotation of ``x`` (float64 copies of dtype values) with each product and sum rounded to ``dtype``."""
    half = x.shape[-1] // 2
    x1, x2, c1, c2, s1, s2 = x[..., :half], x[..., half:], c[..., :half], c[..., half:], s[..., :half], s[..., half:]
    a1, a2 = rounded(x1 * c1, dtype), rounded(x2 * c2, dtype)
    if backward:
        o1, o2 = a1 + rounded(x2 * s2, dtype), a2 - rounded(x1 * s1, dtype)
    else:
        o1, o2 = a1 - rounded(x2 * s1, dtype), a2 + rounded(x1 * s2, dtype)
    return rounded(torch.cat([o1, o2], -1), dtype)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", required=True)
    p.add_argument("--show", type=int, default=6)
    p.add_argument("--device", default="cuda", help="cpu: under TRITON_INTERPRET=1 (a smoke run)")
    args = p.parse_args()
    from transformers import Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2

    original = getattr(modeling_qwen2.apply_rotary_pos_emb, "qerl_original", modeling_qwen2.apply_rotary_pos_emb)
    batch, heads, kv_heads, positions, width = 2, 28, 4, 301, 128
    record = {"provenance": provenance(), "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "cases": {}}
    for dt in (torch.float32, torch.float16, torch.bfloat16):
        g = torch.Generator(device=args.device).manual_seed(positions)
        rope = modeling_qwen2.Qwen2RotaryEmbedding(Qwen2Config(hidden_size=heads * width, num_attention_heads=heads,
                                                               num_key_value_heads=kv_heads)).to(args.device)
        ids = torch.arange(positions, device=args.device).repeat(1, 1) + 17
        cos, sin = rope(torch.empty(batch, positions, 1, dtype=dt, device=args.device), ids)
        q0 = (3 * torch.randn(batch, positions, heads, width, generator=g, device=args.device)).to(dt).transpose(1, 2)
        k0 = (3 * torch.randn(batch, positions, kv_heads, width, generator=g, device=args.device)).to(dt).transpose(1, 2)
        dq, dk = (torch.randn(t.shape, generator=g, device=args.device).to(dt) for t in (q0, k0))
        results = []
        for fn in (original, fused_layers.rotary):
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            qe, ke = fn(q, k, cos, sin)
            torch.autograd.backward((qe, ke), (dq, dk))
            results.append((qe.detach(), ke.detach(), q.grad, k.grad))
        c64, s64 = (t.double().cpu().unsqueeze(1) for t in (cos, sin))
        inputs = {"q_out": (q0, False), "k_out": (k0, False), "q_grad": (dq, True), "k_grad": (dk, True)}
        case = {}
        for (name, (x, backward)), ref, fused in zip(inputs.items(), *results):
            spelled = spelled_out(x.double().cpu(), c64, s64, dt, backward)
            ulp = torch.finfo(dt).eps
            differ = (ref != fused).cpu()
            gap = (ref.double() - fused.double()).abs().cpu()
            ulps = torch.where(spelled != 0, gap / (spelled.abs() * ulp), torch.zeros_like(gap))  # ~units of last place
            entry = {"numel": ref.numel(), "differ": int(differ.sum()),
                     "torch_vs_spelled": int((ref.double().cpu() != spelled).sum()),
                     "kernel_vs_spelled": int((fused.double().cpu() != spelled).sum()),
                     "max_ulps": float(ulps.max()), "max_abs": float(gap.max()), "examples": []}
            for index in differ.nonzero()[:args.show].tolist():
                b, h, pos, d = index
                half = width // 2
                pair = d + half if d < half else d - half
                entry["examples"].append({
                    "index": index, "x_d": float(x[b, h, pos, d]), "x_pair": float(x[b, h, pos, pair]),
                    "cos_d": float(cos[0, pos, d]), "sin_d": float(sin[0, pos, d]),
                    "cos_pair": float(cos[0, pos, pair]), "sin_pair": float(sin[0, pos, pair]),
                    "torch": float(ref[b, h, pos, d]), "kernel": float(fused[b, h, pos, d]),
                    "spelled": float(spelled[b, h, pos, d])})
            case[name] = entry
            print(f"{str(dt):<15}{name:<8} differ {entry['differ']:>8} of {entry['numel']:>9}  torch != spelled "
                  f"{entry['torch_vs_spelled']:>8}  kernel != spelled {entry['kernel_vs_spelled']:>8}  max "
                  f"{entry['max_ulps']:.2f} ulp, {entry['max_abs']:.3g} abs", flush=True)
            for e in entry["examples"]:
                print("    ", e)
        record["cases"][str(dt)] = case
    write_json_atomic(args.json, record)


if __name__ == "__main__":
    main()
