"""RMSNorm, SiLU x up and the rotary embedding for training: one Triton kernel forward, one backward, transformers'
roundings.

Why
---
In transformers' eager code a decoder layer's two RMSNorms are each ~6 kernels forward (the float32 up-cast, pow,
mean, rsqrt, multiply, down-cast, the weight's multiply) and about as many backward, each a pass over a
[tokens, hidden] tensor, several of them in float32; SiLU x up is 2 forward and 3 backward passes over
[tokens, intermediate]. With gradient checkpointing the forward runs twice. Once LoRA's own passes were gone
(`models/lora_forward.py`), these were the bulk of what was left of a 7B trainer step's elementwise time
(dev/LOG.md section 78).

What
----
Forward: the rollout engine's kernels (`engine/glue.rms_norm`, `engine/glue.silu_mul`, `engine/glue.rotate`), which
follow transformers' order of roundings. Backward, one program per row (RMSNorm) or per block of a row (SiLU x up),
with the roundings autograd makes on transformers' graph reproduced:

    RMSNorm   y = w * bf16(x * r),  r = rsqrt(mean(x^2) + eps)   (statistics in float32)
              g  = bf16(dy * w)                                     # the multiply's gradient, in x's dtype
              dx = bf16(r * g - x * r^3 * mean(g * x))              # float32, as the chain of fp32 ops makes it
    SiLU x up o = bf16(bf16(silu(gate)) * up)
              du = bf16(do * bf16(silu(gate)));  da = bf16(do * up)
              dg = bf16(da * s * (1 + gate * (1 - s))),  s = sigmoid(gate)   # torch's silu_backward

    RoPE      y1 = bf16(x1 c1) - bf16(x2 s1),  y2 = bf16(x2 c2) + bf16(x1 s2)      (x1, x2: the halves of a head)
              dx1 = bf16(dy1 c1) + bf16(dy2 s2),  dx2 = bf16(dy2 c2) - bf16(dy1 s1)   # through rotate_half's cat

The rotary embedding is transformers' ``q * cos + rotate_half(q) * sin`` (and the same for k) with each product
rounded, ~5 passes over q and k forward and as many backward; here one program per (sequence, position) covers
all of its heads, for q and for k, each way (on an H200 it took a 7B trainer phase's forward + backward from 1.52
to 1.43 s; dev/LOG.md 94). Elementwise with the same roundings, so outputs and gradients are transformers' bit for
bit. The kernel is compiled without floating-point fusion: with it, Triton's compiler fused a product and the sum
after it into one multiply-add, skipping the product's own rounding, even where the source rounds it to bf16 in
between (a quarter of the outputs then sat a unit off, in every dtype; dev/LOG.md 95).

SiLU x up is elementwise, so its gradients match autograd's bit for bit wherever ``exp`` rounds alike; the norm's
row sums run in another order, so its outputs and gradients may differ from torch's by a rounding step now and
then (tests against the modules' own autograd: fp32 within 1e-5; fp16 normwise within a quarter unit for the norm,
within two units for SiLU x up). A trainable
norm weight (``train_norms``) gets ``sum_rows(dy * bf16(x * r))`` from torch ops in the backward.

Where
-----
`use_fused_layers(model)` changes the class of every ``Qwen2RMSNorm`` / ``LlamaRMSNorm`` (the final norm too) and
``Qwen2MLP`` / ``LlamaMLP`` with SiLU to a subclass whose forward runs these kernels on CUDA tensors (and on CPU
tensors under ``TRITON_INTERPRET=1``, for the tests) and transformers' own forward otherwise: CPU training,
``QERL_FUSED_LAYERS=0`` (read at each call), a norm whose weight is not in the activations' dtype. transformers'
attention forwards call the module-level ``apply_rotary_pos_emb`` of their modeling file, so for the rotary
embedding ``Qwen2Attention`` / ``LlamaAttention`` get a subclass that marks its forward as running, and that
module's ``apply_rotary_pos_emb`` is replaced, once, by a dispatcher that takes the kernels only while a marked
forward runs (and the inputs fit: 4-d q and k with unit-stride heads of a power-of-two half, cos and sin as
``[batch or 1, positions, head_dim]`` without gradients) and calls transformers' function otherwise, so other
models in the process are unchanged; ``QERL_FUSED_ROTARY=0`` turns off the rotary kernel alone. The norm reads
its weight at call time, so AQN's overrides (`train/aqn.apply_norm_overrides`, a copy into the weight) apply. The
rollout engine never calls these modules' forward (it reads their weights), so rollouts are unchanged.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
from torch import nn

from qerl_lib.engine import glue
from qerl_lib.kernels.lora import interpreting

try:  # Triton is optional: the CPU paths do not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

__all__ = ["use_fused_layers", "fused_layers_enabled", "rms_norm", "silu_mul", "rotary", "NORM_CLASSES", "MLP_CLASSES",
           "ATTENTION_CLASSES"]

NORM_CLASSES = ("Qwen2RMSNorm", "LlamaRMSNorm")  # transformers' forward: float32 statistics, then times the weight
MLP_CLASSES = ("Qwen2MLP", "LlamaMLP")  # down_proj(act_fn(gate_proj(x)) * up_proj(x))
ATTENTION_CLASSES = ("Qwen2Attention", "LlamaAttention")  # apply_rotary_pos_emb(q, k, cos, sin) of their module
_marked_forwards = 0  # FusedRotaryAttention forwards running now (the dispatcher's kernels apply only inside one)


def fused_layers_enabled() -> bool:
    """On unless ``QERL_FUSED_LAYERS=0``."""
    return os.environ.get("QERL_FUSED_LAYERS", "1") != "0"


def fused_rotary_enabled() -> bool:
    """On unless ``QERL_FUSED_ROTARY=0`` (the rotary kernel alone off; the norms and SiLU x up keep theirs)."""
    return os.environ.get("QERL_FUSED_ROTARY", "1") != "0"


def _runs_kernels(t: torch.Tensor) -> bool:
    return triton is not None and fused_layers_enabled() and \
        (t.is_cuda or interpreting())


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        ctx.eps = eps
        ctx.save_for_backward(x, weight)
        return glue.rms_norm(x, weight, eps)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        width = x.shape[-1]
        dx = dw = None
        if ctx.needs_input_grad[0]:
            x2, dy2 = x.reshape(-1, width), dy.contiguous().reshape(-1, width)
            dx = torch.empty_like(x2)
            block = triton.next_power_of_2(width)
            _rms_norm_backward_kernel[(x2.shape[0],)](x2, weight, dy2, dx, float(ctx.eps), width, x2.stride(0),
                                                      dy2.stride(0), dx.stride(0), BLOCK=block,
                                                      num_warps=8 if block >= 4096 else 4)
            dx = dx.view(x.shape)
        if ctx.needs_input_grad[1]:  # a trainable norm weight (train_norms): torch ops, off the default path
            xf = x.float()
            normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
            dw = (dy.float() * normed.float()).reshape(-1, width).sum(0).to(weight.dtype)
        return dx, dw, None


class _SiluMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return glue.silu_mul(None, gate, up)

    @staticmethod
    def backward(ctx, do):
        gate, up = ctx.saved_tensors
        width = gate.shape[-1]
        g2, u2, do2 = gate.reshape(-1, width), up.reshape(-1, width), do.contiguous().reshape(-1, width)
        dg, du = torch.empty_like(g2), torch.empty_like(u2)
        _silu_mul_backward_kernel[(g2.shape[0], triton.cdiv(width, glue.SILU_BLOCK))](
            g2, u2, do2, dg, du, width, g2.stride(0), u2.stride(0), do2.stride(0), dg.stride(0), du.stride(0),
            BLOCK=glue.SILU_BLOCK, num_warps=4)
        return dg.view(gate.shape), du.view(up.shape)


class _Rotary(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        return glue.rotate(q, cos, sin, backward=False), glue.rotate(k, cos, sin, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = (g if g.stride(-1) == 1 else g.contiguous() for g in (dq, dk))
        return glue.rotate(dq, cos, sin, backward=True), glue.rotate(dk, cos, sin, backward=True), None, None


rotary_fits = glue.rotary_fits  # what `rotary` takes (the kernel lives in engine/glue.py)


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """transformers' ``apply_rotary_pos_emb(q, k, cos, sin)`` (``unsqueeze_dim=1``) with its gradients, one kernel
    each way for q and for k."""
    if not glue.rotary_fits(q, k, cos, sin):
        raise ValueError("rotary: q [B, H, L, D] and k [B, Hkv, L, D] with unit-stride heads of a power-of-two "
                         "half, cos and sin [B or 1, L, D] without gradients, one dtype and device, got "
                         f"{[(list(t.shape), t.dtype) for t in (q, k, cos, sin)]}")
    return _Rotary.apply(q, k, cos, sin)


def _rotary_dispatcher(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        if _marked_forwards and unsqueeze == 1 and len(args) + len(kwargs) <= 1 and _runs_kernels(q) and \
                fused_rotary_enabled() and glue.rotary_fits(q, k, cos, sin):
            return _Rotary.apply(q, k, cos, sin)  # checked just now: `rotary` would check again
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.qerl_original = original
    return apply_rotary_pos_emb


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm ``weight * bf16(x * rsqrt(mean(x^2) + eps))`` with its gradient, one kernel each way."""
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:]:
        raise ValueError(f"rms_norm: the weight must be [{x.shape[-1]}] in {x.dtype}, got {list(weight.shape)} "
                         f"{weight.dtype}")
    return _RMSNorm.apply(x.contiguous(), weight, eps)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``bf16(bf16(silu(gate)) * up)`` with its gradients, one kernel each way."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"silu_mul: gate {list(gate.shape)} {gate.dtype} and up {list(up.shape)} {up.dtype} differ")
    return _SiluMul.apply(gate.contiguous(), up.contiguous())


class FusedRMSNorm:
    """Mixin over a transformers RMSNorm class: `rms_norm` where the kernels run, the class's forward elsewhere."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if _runs_kernels(hidden_states) and self.weight.dtype == hidden_states.dtype:
            return rms_norm(hidden_states, self.weight, self.variance_epsilon)
        return super().forward(hidden_states)


class FusedSiluMLP:
    """Mixin over a transformers gated MLP class with SiLU: `silu_mul` between the projections where the kernels
    run, the class's forward elsewhere."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _runs_kernels(x):
            return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))
        return super().forward(x)


class FusedRotaryAttention:
    """Mixin over a transformers attention class: its forward runs marked, so that the module's rotary dispatcher
    takes the kernels (module docstring)."""

    def forward(self, *args, **kwargs):
        global _marked_forwards
        _marked_forwards += 1
        try:
            return super().forward(*args, **kwargs)
        finally:
            _marked_forwards -= 1


_SUBCLASSES: dict[type, type] = {}


def _fused_class(cls: type, mixin: type) -> type:
    if cls not in _SUBCLASSES:
        fused = type(f"Fused{cls.__name__}", (mixin, cls), {"__module__": __name__, "__doc__": mixin.__doc__})
        globals()[fused.__name__] = fused  # findable by name, as pickle looks classes up
        _SUBCLASSES[cls] = fused
    return _SUBCLASSES[cls]


def _is_silu(act: nn.Module) -> bool:
    return isinstance(act, nn.SiLU) or type(act).__name__ == "SiLUActivation"


def _install_dispatcher(cls: type) -> None:
    """Replace the ``apply_rotary_pos_emb`` of ``cls``'s modeling module by the dispatcher, once."""
    module = sys.modules[cls.__module__]
    current = getattr(module, "apply_rotary_pos_emb", None)
    if current is not None and not hasattr(current, "qerl_original"):
        module.apply_rotary_pos_emb = _rotary_dispatcher(current)


def use_fused_layers(model: nn.Module) -> dict[str, int]:
    """Give every RMSNorm, SiLU MLP and attention of ``model`` (``NORM_CLASSES``, ``MLP_CLASSES``,
    ``ATTENTION_CLASSES``) the fused forward, in place (a class change; weights, names and state dict untouched).
    Returns how many of each were changed."""
    counts = {"norms": 0, "mlps": 0, "attentions": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in NORM_CLASSES:
            module.__class__ = _fused_class(type(module), FusedRMSNorm)
            counts["norms"] += 1
        elif name in MLP_CLASSES and _is_silu(module.act_fn):
            module.__class__ = _fused_class(type(module), FusedSiluMLP)
            counts["mlps"] += 1
        elif name in ATTENTION_CLASSES:
            _install_dispatcher(type(module))
            module.__class__ = _fused_class(type(module), FusedRotaryAttention)
            counts["attentions"] += 1
    return counts


if triton is not None:

    @triton.jit
    def _rms_norm_backward_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, eps, width, sx, sdy, sdx, BLOCK: tl.constexpr):
        """One program per row: dx of ``w * round(x * r)`` given dy, in float32, rounded once."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        ok = cols < width
        dtype = dx_ptr.dtype.element_ty
        x = tl.load(x_ptr + row * sx + cols, mask=ok, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * sdy + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
        g = (dy * w).to(dtype).to(tl.float32)
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / width + eps)
        dot = tl.sum(g * x, axis=0) / width
        dx = r * g - x * (r * r * r) * dot
        tl.store(dx_ptr + row * sdx + cols, dx.to(dtype), mask=ok)

    @triton.jit
    def _silu_mul_backward_kernel(g_ptr, u_ptr, do_ptr, dg_ptr, du_ptr, width, sg, su, sdo, sdg, sdu,
                                  BLOCK: tl.constexpr):
        """Program (row, block of columns): the gradients of gate and up through ``round(round(silu(g)) * u)``."""
        row, blk = tl.program_id(0), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < width
        dtype = dg_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * sg + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * su + cols, mask=ok, other=0.0).to(tl.float32)
        do = tl.load(do_ptr + row * sdo + cols, mask=ok, other=0.0).to(tl.float32)
        s = 1.0 / (1.0 + tl.exp(-g))
        a = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)  # the forward's rounded silu(gate)
        da = (do * u).to(dtype).to(tl.float32)
        tl.store(du_ptr + row * sdu + cols, (do * a).to(dtype), mask=ok)
        tl.store(dg_ptr + row * sdg + cols, (da * s * (1.0 + g * (1.0 - s))).to(dtype), mask=ok)
