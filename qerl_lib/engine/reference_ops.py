"""The decoder layer's plain-torch math, with transformers' numerics: RMSNorm, RoPE, attention, SiLU x up.

`engine/forward.py` runs these in prefill and on the CPU (the kit's engine equals `transformers` bit for bit there,
tests/test_engine.py), hands them to ``torch.compile`` for the fused decode step, and they are the references the
Triton glue and attention kernels are tested against (`engine/glue.py`, `engine/attention.py`). `Glue` is the set of
elementwise functions a decode step calls between its matmuls, eager or compiled.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's LlamaRMSNorm / Qwen2RMSNorm arithmetic, with the weight passed in."""
    dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [B, heads, T, D]``, ``cos/sin [B, T, D]`` (HF's apply_rotary_pos_emb, one tensor at a time)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return (x * cos) + (_rotate_half(x) * sin)


def sdpa_attention(q, k, v, mask, scaling, causal):
    """Attention as transformers' sdpa integration computes it, K/V heads shared through ``enable_gqa``.

    transformers repeats K/V for the query heads when a mask is given; on a CPU the kit does not (the same
    bits, tests/test_engine.py; the copies made masked decode ~16x slower at the embedded model's shapes,
    dev/runs/cpu_tour_2026-11-24/). On CUDA it keeps the repeat, as its prefill was measured."""
    groups = q.shape[1] // k.shape[1]
    kwargs = {}
    if groups > 1:
        if mask is None or q.device.type == "cpu":
            kwargs["enable_gqa"] = True
        else:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling,
                                          is_causal=causal and mask is None and q.shape[2] > 1, **kwargs)


def attention_probs(scores: torch.Tensor, mask: torch.Tensor | None, scaling: float) -> torch.Tensor:
    """``softmax(scores * scaling)`` in float32 over unmasked columns, cast back to the scores' dtype."""
    s = scores.float() * scaling
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    return torch.softmax(s, dim=-1).to(scores.dtype)


def matmul_decode_attention(q, k, v, mask, scaling, probs_fn=attention_probs):
    """One query token per row: ``q [B, H, 1, D]``, cache slices ``k, v [B, KV, L, D]``, ``mask [B, 1, 1, L]``.

    The ``H / KV`` query heads sharing a KV head become the rows of one matmul, so K and V are
    read once. Scores come out of the matmul in the activation dtype (fp32 accumulation, as in
    HF's eager attention); the softmax runs in float32.
    """
    b, h, _, d = q.shape
    kv = k.shape[1]
    scores = torch.matmul(q.reshape(b, kv, h // kv, d), k.transpose(-1, -2))  # [B, KV, G, L]
    return torch.matmul(probs_fn(scores, mask, scaling), v).reshape(b, h, 1, d)


class Glue(NamedTuple):
    """The elementwise functions between matmuls (eager, or each compiled into one kernel)."""

    norm: Callable
    residual_norm: Callable
    rope: Callable
    attention_probs: Callable
    gated: Callable


def residual_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float):
    """``x + delta`` (HF's residual add, in the activation dtype) and its RMSNorm."""
    x = x + delta
    return x, rms_norm(x, weight, eps)


def rope_qk(q, k, cos, sin):
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _rope_in_attention(q, k, cos, sin):
    return q, k  # the kernel attention path rotates q and k itself (attention.rope_cache_attention)


def gated_act(act, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return act(gate) * up
