"""LoRA's forward as the trainer runs it: one shrink matmul, and the expand added in one pass over the base output.

What peft does, and what it costs
---------------------------------
peft's ``lora.Linear.forward`` computes, for a frozen base layer and adapters A [r, K], B [N, r],

    x32    = x.to(A.dtype)                       # A, B are fp32 (peft's default upcast): a copy of x
    result = base(x) + B(A(dropout(x32))) * s    # an [tokens, N] product, a scaling pass, an add pass
    result = result.to(base dtype)               # and, outside autocast, a cast back

Each line is a pass over a [tokens, N] or [tokens, K] tensor, in the forward, again in gradient
checkpointing's recomputed forward, and in the backward (the scaling and the casts have gradients). On
the trainer's shapes they add up: a 7B forward + backward of 8 x 2304 tokens spent about as long in
elementwise kernels as in its GEMMs, most of it on the MLP's 18,944-wide tensors (dev/LOG.md section 78).
The bytes of A and B are < 1% of the base's; the cost is the passes.

What this module does instead
-----------------------------
    h = dropout(x) @ A'^T                        # A' = A cast to x's dtype: an [r, K] copy
    y = base(x) + s * h @ B'^T                   # one pass over the base output

No copy of x, no scaling pass, no add pass: the expand adds into the base output as it reads it (`expand_add`,
the arithmetic of ``torch.addmm(base(x), h, B'^T, alpha=s)``: a Triton kernel on GPUs, cuBLAS's addmm elsewhere).
An NVFP4 base on its kernels rounds its product and then adds its bias in a pass of its own (the oracle's order);
there the base runs without its bias and the expand adds it first, rounded as the layer rounds it: the same bits,
one pass over the output fewer (`_foldable_bias`; dev/LOG.md 95).
The backward hands the base output's gradient through unchanged and applies ``s`` on the small [tokens, r] side, as
addmm's does; the casts of A and B carry fp32 gradients back to the fp32 adapters, so the optimizer still updates
fp32 weights.

Numerics, and where this differs from peft
------------------------------------------
Under bf16 autocast (the trainer: TRL's ``bf16=True`` runs the model's forward in ``torch.autocast``) peft's
matmuls already run in bf16, so the adapters' precision class is the same here; what changes is the
rounding: peft rounds ``B(A(x))``, then ``* s``, then the sum (three bf16 roundings); the GPU kernel here rounds
the float32 sum once (cuBLAS's bf16 ``addmm``, the fallback, rounds the product before it adds ``base``: on an H200
a quarter of its outputs sat one unit from the kernel's, the kernel's the closer to the exact value; section 80).
Called *outside* autocast on a bf16 model, peft runs the adapters in fp32 and this in bf16 (with fp32
accumulation), which is what the trainer does anyway. In fp32 (CPUs) both are fp32 and agree to rounding.
The rollout engine adds its adapters with one ``addmm`` per B (``engine/adapters.py``) or its own kernels.

peft's own forward still runs for what this path does not cover: adapters disabled or merged, more
than one active adapter, mixed-adapter batches (``adapter_names``), LoRA variants (DoRA, aLoRA, ...) and
``lora_bias``. ``QERL_LORA_FUSED=0`` turns the path off everywhere, ``QERL_LORA_EXPAND_KERNEL=0`` only the Triton
expand (``torch.addmm`` instead); both are read at each call, to compare.

Which layers get it: ``NVFP4LoraLinear`` (an NVFP4 base), plain ``nn.Linear`` bases (bf16), and
bitsandbytes ``Linear4bit`` bases (NF4, the QLoRA baseline), so every mode's trainer gains alike.
``lora_layer_for`` is the factory peft's custom-module hook calls; for any other base layer it returns
None and peft's own dispatch takes over.
"""

from __future__ import annotations

import os

import torch
from peft.tuners.lora.layer import VARIANT_KWARG_KEYS
from peft.tuners.lora.layer import Linear as _PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from qerl_lib.kernels.lora import interpreting
from qerl_lib.models.nvfp4_linear import NVFP4Linear, resolve_impl

try:  # Triton is optional: the CPU paths do not need it
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

__all__ = ["FusedLoraForward", "FusedLoraLinear", "fused_enabled", "lora_layer_for", "fused_lora_add", "expand_add"]

EXPAND_BLOCK_M, EXPAND_BLOCK_N = 64, 128


def fused_enabled() -> bool:
    """The fused path is on unless ``QERL_LORA_FUSED=0``."""
    return os.environ.get("QERL_LORA_FUSED", "1") != "0"


def fused_lora_add(result: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                   scale: float, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``result (+ bias) + scale * (x @ lora_a^T) @ lora_b^T`` as one matmul and one pass over ``result``
    (`expand_add`).

    ``result`` [..., N] (the base output), ``x`` [..., K], ``lora_a`` [r, K], ``lora_b`` [N, r], ``bias`` [N] (a
    frozen base bias the base layer left out, added as the base layer adds it); the adapter weights and the bias are
    cast to ``result``'s dtype (under autocast, to autocast's). Returns a new tensor shaped like ``result``."""
    dtype = torch.get_autocast_dtype(result.device.type) if torch.is_autocast_enabled(result.device.type) \
        else result.dtype
    a, b = lora_a.to(dtype), lora_b.to(dtype)
    h = torch.nn.functional.linear(x.to(dtype), a)
    out = expand_add(result.reshape(-1, result.shape[-1]).to(dtype), h.reshape(-1, h.shape[-1]), b, scale,
                     bias=None if bias is None else bias.to(dtype))
    return out.view(result.shape)


def _expand_kernel_runs(t: torch.Tensor) -> bool:
    return triton is not None and os.environ.get("QERL_LORA_EXPAND_KERNEL", "1") != "0" and \
        (t.is_cuda or interpreting())


def expand_add(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, scale: float,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``base [M, N] + scale * h [M, r] @ b [N, r]^T`` into a new tensor, with gradients; with a frozen ``bias``
    [N], ``round(base + bias)`` takes ``base``'s place (rounded to the dtype, as a base layer that adds its bias
    to its rounded product rounds it: the same bits, without that layer's own pass over its output).

    On GPUs one Triton kernel (`_expand_add_kernel`, small tiles, many per SM): the float32 sum rounded once.
    cuBLAS's ``addmm`` took ~1 ms a call at K = r on the 7B MLP's [18432, 18944] outputs, ~3x the time their bytes
    need, and the kernel cut a 7B trainer step's decoder time by ~3% (dev/LOG.md section 80). Elsewhere, and with
    ``QERL_LORA_EXPAND_KERNEL=0``, ``torch.addmm`` (whose bf16 output rounds the product before the sum)."""
    shapes_fit = base.shape[0] == h.shape[0] and b.shape == (base.shape[1], h.shape[1])
    if base.dtype != h.dtype or b.dtype != h.dtype or base.dim() != 2 or not shapes_fit:
        raise ValueError(f"expand_add: base [M, N], h [M, r] and b [N, r] of one dtype, got {list(base.shape)} "
                         f"{base.dtype}, {list(h.shape)} {h.dtype}, {list(b.shape)} {b.dtype}")
    if bias is not None and (bias.shape != base.shape[1:] or bias.dtype != base.dtype or bias.requires_grad):
        raise ValueError(f"expand_add: the bias must be a frozen [{base.shape[1]}] {base.dtype} tensor, got "
                         f"{list(bias.shape)} {bias.dtype}{' with requires_grad' if bias.requires_grad else ''}")
    if not _expand_kernel_runs(base) or base.numel() == 0:
        return torch.addmm(base if bias is None else base + bias, h, b.t(), alpha=scale)
    return _ExpandAdd.apply(base, h, b, float(scale), bias)


class _ExpandAdd(torch.autograd.Function):
    """Gradients as ``torch.addmm``'s: base's is the output's, h's and b's are scaled on the small side."""

    @staticmethod
    def forward(ctx, base, h, b, scale, bias):
        ctx.scale = scale
        ctx.save_for_backward(h, b)
        base, h, b = base.contiguous(), h.contiguous(), b.contiguous()
        (m, n), r = base.shape, h.shape[1]
        out = torch.empty_like(base)
        grid = (triton.cdiv(n, EXPAND_BLOCK_N), triton.cdiv(m, EXPAND_BLOCK_M))
        _expand_add_kernel[grid](base, h, b, out if bias is None else bias.contiguous(), out, m, n, r, scale,
                                 BLOCK_M=EXPAND_BLOCK_M, BLOCK_N=EXPAND_BLOCK_N,
                                 RP=max(16, triton.next_power_of_2(r)), HAS_BIAS=bias is not None,
                                 PRECISION="ieee" if base.dtype == torch.float32 else "tf32", num_warps=4)
        return out

    @staticmethod
    def backward(ctx, grad):
        h, b = ctx.saved_tensors
        grad_h = torch.mm(grad, b).mul_(ctx.scale) if ctx.needs_input_grad[1] else None
        grad_b = torch.mm(grad.t(), h).mul_(ctx.scale) if ctx.needs_input_grad[2] else None
        return grad if ctx.needs_input_grad[0] else None, grad_h, grad_b, None, None


if triton is not None:

    # M (the token count) changes every step: left unspecialized, a new count's divisibility by 16 does not
    # compile the kernel again (~0.2 s each time on an H200; dev/LOG.md 82, 88). N and R are fixed per layer.
    @triton.jit(do_not_specialize=["M"])
    def _expand_add_kernel(base_ptr, h_ptr, b_ptr, bias_ptr, out_ptr, M, N, R, scale, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, RP: tl.constexpr, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr):
        """Program (block of columns, block of rows) of contiguous tensors: its tile of ``base + scale * h @ b^T``
        (``base``: ``round(base + bias)`` with HAS_BIAS)."""
        pid_n, pid_m = tl.program_id(0), tl.program_id(1)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        ranks = tl.arange(0, RP)
        ok_m, ok_n, ok_r = rows < M, cols < N, ranks < R
        h = tl.load(h_ptr + rows[:, None] * R + ranks[None, :], mask=ok_m[:, None] & ok_r[None, :], other=0.0)
        b = tl.load(b_ptr + cols[:, None] * R + ranks[None, :], mask=ok_n[:, None] & ok_r[None, :], other=0.0)
        acc = tl.dot(h, tl.trans(b), input_precision=PRECISION)
        ok = ok_m[:, None] & ok_n[None, :]
        offsets = rows[:, None].to(tl.int64) * N + cols[None, :]
        base = tl.load(base_ptr + offsets, mask=ok, other=0.0).to(tl.float32)
        if HAS_BIAS:  # the base layer's own addition, rounded as it rounds it
            bias = tl.load(bias_ptr + cols, mask=ok_n, other=0.0).to(tl.float32)
            base = (base + bias[None, :]).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + offsets, (base + scale * acc).to(out_ptr.dtype.element_ty), mask=ok)


class FusedLoraForward:
    """Mixin for peft LoRA layer classes: the forward above where it applies, peft's otherwise."""

    def _fused_adapter(self, kwargs) -> str | None:
        """The one active adapter this path can run, or None for peft's forward."""
        if not fused_enabled() or self.disable_adapters or self.merged or kwargs.get("adapter_names") is not None:
            return None
        active = [a for a in self.active_adapters if a in self.lora_A]
        if len(active) != 1 or active[0] in self.lora_variant or self.lora_B[active[0]].bias is not None:
            return None
        return active[0]

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        adapter = self._fused_adapter(kwargs)
        if adapter is None:
            return super().forward(x, *args, **kwargs)
        for key in ("adapter_names", *VARIANT_KWARG_KEYS):  # peft's forward keeps these from the base layer too
            kwargs.pop(key, None)
        bias = _foldable_bias(self.base_layer, x, args, kwargs)
        result = self.base_layer(x, add_bias=False) if bias is not None else self.base_layer(x, *args, **kwargs)
        return fused_lora_add(result, self.lora_dropout[adapter](x), self.lora_A[adapter].weight,
                              self.lora_B[adapter].weight, float(self.scaling[adapter]), bias=bias)


def _foldable_bias(base: nn.Module, x: torch.Tensor, args, kwargs) -> torch.Tensor | None:
    """An NVFP4 base layer's frozen bias, when the expand kernel adds it instead of the layer (one pass less over
    the output: q/k/v's biases took ~1% of a 7B trainer step as separate adds; dev/LOG.md 95), else None."""
    bias = getattr(base, "bias", None)
    if bias is None or not isinstance(base, NVFP4Linear) or args or kwargs or bias.requires_grad or \
            resolve_impl(base.impl, x.device) != "kernel" or not _expand_kernel_runs(x):
        return None  # (the reference path's F.linear rounds product + bias once: not the kernels' two roundings)
    return bias


class FusedLoraLinear(FusedLoraForward, _PeftLoraLinear):
    """peft ``lora.Linear`` (plain ``nn.Linear`` base) with the fused forward; state dict and save format peft's."""


_FUSED_4BIT: list[type] = []  # built on first use: importing bitsandbytes is slow and it is optional


def _fused_linear4bit() -> type:
    if not _FUSED_4BIT:
        from peft.tuners.lora.bnb import Linear4bit

        cls = type("FusedLoraLinear4bit", (FusedLoraForward, Linear4bit),
                   {"__doc__": "peft's bitsandbytes ``Linear4bit`` LoRA layer with the fused forward.",
                    "__module__": __name__})
        globals()[cls.__name__] = cls  # findable by name, as pickle and copy look classes up
        _FUSED_4BIT.append(cls)
    return _FUSED_4BIT[0]


def _is_bnb_linear4bit(module: nn.Module) -> bool:
    return type(module).__name__ == "Linear4bit" and type(module).__module__.startswith("bitsandbytes")


def lora_layer_for(target: nn.Module, adapter_name: str, config, **kwargs) -> nn.Module | None:
    """peft custom-module factory for ``nn.Linear`` keys: the layer peft's own dispatch would make, with the fused
    forward, for a plain ``nn.Linear`` or a bitsandbytes ``Linear4bit`` base (peft's bnb class for a model
    transformers loaded in 4 bits, its generic ``lora.Linear`` otherwise, e.g. ``models.nf4.to_nf4``'s);
    None, so that peft's dispatch runs, for any other ``nn.Linear`` subclass."""
    base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
    if _is_bnb_linear4bit(base) and kwargs.get("loaded_in_4bit", False):
        return _fused_linear4bit()(target, adapter_name, config=config, compute_dtype=base.compute_dtype,
                                   compress_statistics=base.weight.compress_statistics,
                                   quant_type=base.weight.quant_type, **kwargs)
    if type(base) is nn.Linear or _is_bnb_linear4bit(base):
        return FusedLoraLinear(target, adapter_name, config=config, **kwargs)
    return None
