"""LoRA merged into an engine-owned copy of a dense base for the rollout: ``y = x (W + s B A)^T``, one GEMM.

Why merge, and why a copy
-------------------------
During one rollout the adapter does not change, so for a bf16 (or any dense) base the adapted layer is a plain
linear layer with the weight ``W + s B A``. Run that way, a decode step is exactly the step without an adapter:
no shrink, no expand, no extra launch. The unmerged kernels (``engine/adapters.py``, ``kernels/lora.py``) cost a
bf16 rollout ~6% of its tokens/s at rank 16 (dev/LOG.md sections 46-57), nearly all of it per-launch latency.

TRL's GRPO trainer merges too, before each weight sync to vLLM (``trl/generation/vllm_generation.py`` in the pinned
TRL): ``merge_adapter`` writes ``W += s B A`` into the trained model's own base weight and ``unmerge_adapter``
subtracts it again afterwards. In bf16 the pair does not give ``W`` back bit for bit, so the frozen base drifts a
little at every step. Here the base is never written: the
engine owns one merged copy per projection group, ``round(W + s B A)`` (the sum in float32, rounded once to the
weight's dtype), and ``refresh`` rewrites it in place at every ``generate`` call, so captured CUDA graphs keep
reading the same addresses and each rollout samples from the adapter as it is now.

What it costs (``RolloutEngine(lora_merge=True)``, ``qerl train --rollout-lora-merge``; off by default)
-------------------------------------------------------------------------------------------------------
* Memory: a second copy of every merged group's weights. Qwen2.5-7B with adapters on all seven projections:
  6.53 B parameters, 12.2 GiB in bf16. At 32B (61 GiB of base) the copy does not fit beside it on one 80 GB GPU.
  ``RolloutEngine.release()`` gives the copies' memory back with the KV cache: with ``remap_cache`` (CUDA's virtual
  memory, ``engine/remap.py``) they keep their addresses and the next call maps and rewrites them, graphs kept;
  otherwise they are freed, and the next call allocates them and captures its graphs again.
* Time: each ``generate`` reads every merged weight and writes its copy: one Triton kernel per member on CUDA, ~10 ms
  at 7B on an H200 at rank 16 and 64 (torch's float32 temporaries took ~60 ms; dev/LOG.md sections 58-61), counted in
  every timed rollout of ``qerl bench rollout``.
* Numerics: the sampled distribution differs from the unmerged engine's by bf16 rounding only (both approximate the
  same float32 function: one rounds the merged weight, the other the base output, ``x A^T`` and the sum). Rollout
  logprobs then sit a rounding further from the trainer's unmerged forward.

Where this deviates from the paper: QeRL's point is that an NVFP4 base *cannot* be merged (its 4-bit codes are the
frozen policy; merging would re-quantize it, dev/LOG.md section 58), so its adapters always run unmerged. Groups
whose members are not plain ``nn.Linear`` (NVFP4, bitsandbytes NF4) are left to the unmerged path; so is any
projection group without an adapter, which keeps running on the base weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

try:  # Triton is optional: the CPU path is torch's
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

from qerl_lib.engine.adapters import LoraAdapter, parse_target
from qerl_lib.engine.remap import DriverError, Remappable, RemappableBuffer, map_or_raise
from qerl_lib.kernels.lora import interpreting
from qerl_lib.models.fused import PROJECTION_GROUPS

ROWS_PER_PASS = 4096  # weight rows merged per float32 temporary (bounds it to ROWS_PER_PASS x in_features x 4 bytes)
MERGE_BLOCK_N, MERGE_BLOCK_K = 32, 128  # the merge kernel's tile: weight rows x input columns per program


class MergedAdapters(Remappable):
    """Per (layer, group) with an adapter on a dense base: the merged weight ``[sum of N, K]`` and bias.

    ``groups``: the engine's ``[{group: [base modules]}]`` per layer (``ForwardPass._groups``). ``targets``: the
    adapter names this object merged (the caller runs the rest unmerged)."""

    def __init__(self, groups: list[dict[str, list[nn.Module]]], adapters: dict[str, LoraAdapter],
                 remappable: bool = False):
        by_layer: dict[int, dict[str, str]] = {}
        for name in adapters:
            layer, proj = parse_target(name, len(groups))
            by_layer.setdefault(layer, {})[proj] = name
        # (layer, group) -> (weight copy, bias copy or None, [(member module, row start, adapter name or None)])
        self.layout: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None, list]] = {}
        self.targets: set[str] = set()
        specs = []  # ((layer, group), rows, k, biased, placed, a base weight): every copy's shape, checked first
        for layer, named in sorted(by_layer.items()):
            for group, names in PROJECTION_GROUPS.items():
                members = groups[layer][group]
                if not any(p in named for p in names) or not all(type(m) is nn.Linear for m in members):
                    continue
                k = members[0].in_features
                if any(m.in_features != k for m in members):
                    continue
                rows = sum(m.out_features for m in members)
                biased = any(m.bias is not None for m in members)
                placed, start = [], 0
                for m, p in zip(members, names):
                    adapter = named.get(p)
                    if adapter is not None:
                        a = adapters[adapter]
                        if a.A.shape[1] != k or a.B.shape[0] != m.out_features:
                            raise ValueError(f"LoRA {adapter}: A {tuple(a.A.shape)} / B {tuple(a.B.shape)} do not fit "
                                             f"the layer's weight {tuple(m.weight.shape)} (A [rank, {k}], "
                                             f"B [{m.out_features}, rank])")
                        self.targets.add(adapter)
                    placed.append((m, start, adapter))
                    start += m.out_features
                specs.append(((layer, group), rows, k, biased, placed, members[0].weight))
        # remappable: every copy in one `engine.remap.RemappableBuffer`, whose memory `unmap` gives back between
        # rollouts and `refresh` maps again at the same addresses (graphs that read the copies stay valid)
        self._buffer = None
        if remappable and specs:
            try:
                self._buffer = _remappable_buffer(specs)
            except DriverError:  # the driver refused its virtual memory API here: plain copies, freed on release
                self._buffer = None
        raw, offset = (self._buffer.view(), 0) if self._buffer is not None else (None, 0)
        for key, rows, k, biased, placed, first in specs:
            if raw is None:
                weight = _allocate((rows, k), first)
                bias = torch.zeros(rows, dtype=first.dtype, device=first.device) if biased else None
            else:
                weight, offset = _carve(raw, offset, (rows, k), first.dtype)
                bias, offset = _carve(raw, offset, (rows,), first.dtype) if biased else (None, offset)
            self.layout[key] = (weight, bias, placed)

    def refresh(self, adapters: dict[str, LoraAdapter]) -> None:
        """Rewrite every copy in place: ``round(W + scale * B @ A)`` from the base's and the adapters' current
        values (float32 sum, one rounding), the base's own rows where a member has no adapter (every byte of
        every copy, so remapped memory needs no zero-fill)."""
        if self._buffer is not None:
            map_or_raise(self._buffer)
        with torch.no_grad():
            for weight, bias, placed in self.layout.values():
                for module, start, name in placed:
                    rows = module.out_features
                    target = weight[start:start + rows]
                    if name is None:
                        target.copy_(module.weight)
                    else:
                        merge_into(target, module.weight, adapters[name])
                    if bias is not None:
                        if module.bias is None:
                            bias[start:start + rows].zero_()
                        else:
                            bias[start:start + rows].copy_(module.bias)

    def covers(self, layer: int, group: str) -> bool:
        return (layer, group) in self.layout

    def project(self, layer: int, group: str, x: torch.Tensor) -> list[torch.Tensor]:
        """The group's members' outputs for ``x``, from one GEMM over the merged copy."""
        weight, bias, placed = self.layout[(layer, group)]
        full = F.linear(x, weight, bias)
        return list(full.split([m.out_features for m, _, _ in placed], dim=-1))

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() + (b.numel() * b.element_size() if b is not None else 0)
                   for w, b, _ in self.layout.values())


def merge_into(out: torch.Tensor, weight: torch.Tensor, adapter: LoraAdapter) -> torch.Tensor:
    """``out <- round(weight + scale * B @ A)``: the sum in float32, rounded once to ``out``'s dtype (``out`` may be
    ``weight`` itself). On CUDA one Triton kernel (``_merge_kernel``): each output's rank-r sum in float32 in
    registers (16 ranks per ``tl.dot``, never TF32 whatever torch's setting), so it reads and writes each weight
    once. Elsewhere torch with float32 temporaries of ``ROWS_PER_PASS`` rows at a time."""
    if triton is not None and (out.is_cuda or interpreting()) and out.stride(-1) == weight.stride(-1) == 1:
        a, b = adapter.A.to(out.device), adapter.B.to(out.device)
        n, k = out.shape
        grid = (triton.cdiv(n, MERGE_BLOCK_N), triton.cdiv(k, MERGE_BLOCK_K))
        # 16-bit adapters on the tensor cores; float32 ones (and anything under Triton's interpreter, whose 16-bit
        # dots are not emulated) by float32 multiply-adds
        fp32 = interpreting() or not (a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16))
        _merge_kernel[grid](weight, a, b, out, n, k, a.shape[0], weight.stride(0), a.stride(0), a.stride(1),
                            b.stride(0), b.stride(1), out.stride(0), float(adapter.scale),
                            BLOCK_N=MERGE_BLOCK_N, BLOCK_K=MERGE_BLOCK_K, BLOCK_R=16, FP32=fp32, num_warps=4)
        return out
    a = adapter.A.to(device=out.device, dtype=torch.float32)
    b = adapter.B.to(device=out.device, dtype=torch.float32)
    scale = float(adapter.scale)
    for i in range(0, out.shape[0], ROWS_PER_PASS):
        j = min(i + ROWS_PER_PASS, out.shape[0])
        out[i:j].copy_(torch.addmm(weight[i:j].float(), b[i:j], a, alpha=scale))
    return out


def _allocate(shape: tuple[int, int], like: torch.Tensor) -> torch.Tensor:
    try:
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    except torch.OutOfMemoryError as e:  # one line that names the fix, not a bare allocator message
        raise _no_room(shape[0] * shape[1] * like.element_size(), "per group") from e


def _no_room(nbytes: int, what: str) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(f"lora_merge: no room for the merged weight copies ({nbytes / 2**30:.2f} GiB more "
                                  f"{what}): roll out with lora_merge=False (the adapters then run unmerged)")


_ALIGN = 512  # bytes: each copy starts on a boundary every kernel's vector loads accept


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _remappable_buffer(specs):
    total = sum(_aligned(rows * k * first.element_size()) + (_aligned(rows * first.element_size()) if biased else 0)
                for _, rows, k, biased, _, first in specs)
    return RemappableBuffer(total, specs[0][5].device, str(_no_room(total, "in all")))


def _carve(raw: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
    """A ``shape`` tensor of ``dtype`` at byte ``offset`` of ``raw`` (uint8), and the next aligned offset."""
    n = math.prod(shape) * dtype.itemsize
    return raw[offset:offset + n].view(dtype).view(shape), offset + _aligned(n)


if triton is not None:

    @triton.jit
    def _merge_kernel(w_ptr, a_ptr, b_ptr, o_ptr, N, K, R, sw, sa_r, sa_k, sb_n, sb_r, so, scale,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, FP32: tl.constexpr):
        """Program (block of weight rows, block of input columns): ``sum_r B[n, r] A[r, k]`` in float32, ``BLOCK_R``
        ranks per ``tl.dot`` (bf16 / fp16 adapters: exact products, float32 sums; otherwise float32 multiply-adds,
        never TF32), then ``W + scale * sum`` in float32, rounded once to the output's dtype."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
        rr = tl.arange(0, BLOCK_R)
        ok_n, ok_k = rows < N, cols < K
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for r0 in range(0, R, BLOCK_R):
            ok_r = (r0 + rr) < R
            b = tl.load(b_ptr + rows[:, None] * sb_n + (r0 + rr)[None, :] * sb_r, mask=ok_n[:, None] & ok_r[None, :],
                        other=0.0)
            a = tl.load(a_ptr + (r0 + rr)[:, None] * sa_r + cols[None, :] * sa_k, mask=ok_r[:, None] & ok_k[None, :],
                        other=0.0)
            if FP32:
                acc = tl.dot(b.to(tl.float32), a.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(b, a, acc)
        ok = ok_n[:, None] & ok_k[None, :]
        w = tl.load(w_ptr + rows[:, None] * sw + cols[None, :], mask=ok, other=0.0).to(tl.float32)
        tl.store(o_ptr + rows[:, None] * so + cols[None, :], (w + scale * acc).to(o_ptr.dtype.element_ty), mask=ok)
