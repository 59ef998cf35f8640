"""Fused projection groups: q/k/v as one matmul and gate/up as one, without a second copy of the weights.

Why fuse
--------
A decode step reads every weight once, for a handful of tokens. Qwen2.5-7B's seven projections
per layer are then seven weight-streaming kernels (fourteen for NVFP4 at small M, each with its
split-K reduction), and the small ones cannot reach memory bandwidth at all: k_proj and v_proj
are 512 x 3584, 1 MB in NVFP4, a fraction of a microsecond at the roof but several microseconds
of launch, ramp-up and tail. q/k/v read the same input, and so do gate/up, so each group can be
one wider matmul whose output is split afterwards. vLLM does the same (``QKVParallelLinear``,
``MergedColumnParallelLinear``), and the paper's throughput numbers come from vLLM.

How (``fuse_group``)
--------------------
The members' weights are moved into one buffer ``[sum of N, K]`` and each module is re-pointed at
its own rows (views). Values, ``nn.Parameter`` objects (optimizers and peft keep theirs) and
every module's own ``forward`` stay as they were, and no memory is added: the old per-module
storage is freed. Called again on a group that already shares one buffer, it reuses it.

* ``nn.Linear`` members (exactly that type: subclasses such as bitsandbytes' ``Linear4bit``
  are left alone): weights and biases are concatenated.
* ``NVFP4Linear`` members: the packed codes and the E4M3 block scales are concatenated along N
  (per-row data, so the concatenation *is* the NVFP4 encoding of the stacked weight) and one
  ``PreparedFP4Weight`` feeds the FP4 kernel. NVFP4's per-tensor global scale must then be one
  number for the group: llm-compressor gives q/k/v and gate/up a shared global scale for exactly
  this reason, and ``replace_linear_with_nvfp4`` follows it. Members with different global
  scales are left unfused (``fuse_group`` returns None).

Where this differs from calling the modules one by one: a wider matmul may pick another kernel
configuration (tile width, K-split), so fp32 partial sums can be grouped differently and an
output can differ in its last bf16 bit. The rollout engine therefore fuses on CUDA only, where it
makes no bit-for-bit claim against ``transformers``; on CPU it calls the modules as HF does.
Anything that replaces a member's tensors later (``.to()``, ``set_nvfp4_weight``, assigning a new
``weight``) breaks the sharing; ``FusedProjection.is_current`` notices and the engine re-fuses.
In-place writes into the views (``load_state_dict``, ``copy_``) keep it.

Extra rows (``extra_rows``, ``nn.Linear`` members only): the buffer can also hold rows that belong to no
member, zero until the caller writes them (``FusedProjection.extra_weight``); ``full`` then returns their
products as its last columns and ``outputs`` leaves them out. The engine stores a bf16 group's LoRA A
matrices there (``engine/adapters.py``): one GEMM then also makes the adapters' ``x @ A^T``.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from qerl_lib.models.nvfp4_linear import NVFP4Linear, resolve_impl

# The seven projections of a Llama / Qwen2 decoder layer (what NVFP4 quantizes and LoRA targets),
# the submodule of the layer that holds each, and the groups that read one input: q/k/v and gate/up
# are the groups ``fuse_group`` turns into one matmul (and that share one NVFP4 global scale,
# ``quant.nvfp4.FUSED_GROUPS``).
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
PROJECTION_GROUPS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",),
                     "gate_up": ("gate_proj", "up_proj"), "down": ("down_proj",)}


def layer_projection_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """``{projection: (N, K)}`` (out, in features) of one decoder layer of a transformers config given as a
    dict (e.g. ``paths.load_model_config``), in ``PROJECTIONS`` order."""
    hidden, inter = int(config["hidden_size"]), int(config["intermediate_size"])
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    q_dim, kv_dim = heads * head_dim, int(config.get("num_key_value_heads") or heads) * head_dim
    return {"q_proj": (q_dim, hidden), "k_proj": (kv_dim, hidden), "v_proj": (kv_dim, hidden),
            "o_proj": (hidden, q_dim), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
            "down_proj": (hidden, inter)}


class FusedProjection:
    """One matmul for a group of projections reading the same input; call it to get the members' outputs."""

    def __init__(self, members: Sequence[nn.Module], kind: str, tensors: dict[str, torch.Tensor],
                 prepared=None, extra_rows: int = 0):
        self.members = tuple(members)
        self.kind = kind  # "linear" or "nvfp4"
        self.splits = tuple(int(m.out_features) for m in members)
        self.width = sum(self.splits)  # the members' outputs; ``extra_rows`` more columns follow in ``full``
        self.extra_rows = extra_rows
        self.tensors = tensors  # the fused buffers the members' tensors are views of
        self.prepared = prepared  # kernels.fp4_gemm.PreparedFP4Weight for "nvfp4"
        # NVFP4 global scales are not fused (one per member, equal): remember which tensors and versions
        self._scale_keys = [_scale_key(m) for m in members] if kind == "nvfp4" else []

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        return self.outputs(self.full(x))

    def outputs(self, full: torch.Tensor) -> list[torch.Tensor]:
        """The members' outputs (views) of a ``full`` result, without the extra rows' columns."""
        return list(full[..., :self.width].split(self.splits, dim=-1))

    def extra_weight(self) -> torch.Tensor:
        """The weight buffer's ``extra_rows`` rows after the members' (``fuse_group(..., extra_rows=)``): what
        the caller writes there, ``full`` multiplies too (its last ``extra_rows`` output columns)."""
        return self.tensors["weight"][self.width:]

    def full(self, x: torch.Tensor, lora=None, x_relabeled: torch.Tensor | None = None,
             defer_reduce: list | None = None) -> torch.Tensor:
        """The members' outputs side by side, ``[..., sum of N + extra_rows]`` (what ``outputs`` splits);
        ``lora``: a ``kernels.mma.LoraEpilogue`` for the mma.sync GEMM (``engine/adapters.gemm_lora_epilogue``);
        ``x_relabeled``, ``defer_reduce``: NVFP4 only, ``fp4_linear``'s arguments of those names."""
        if self.kind == "nvfp4":
            from qerl_lib.kernels.fp4_gemm import fp4_linear

            first = self.members[0]  # the small-M kernel choice of the group's first member
            out = fp4_linear(x, self.prepared, self.tensors.get("bias"), small_m_backend=first.small_m_backend,
                             mma_rule=first.mma_rule, lora=lora, x_relabeled=x_relabeled, defer_reduce=defer_reduce)
        else:
            out = F.linear(x, self.tensors["weight"], self.tensors.get("bias"))
        return out

    def is_current(self) -> bool:
        """True while every member still reads its rows of the fused buffers (cheap: pointer checks)."""
        row = 0
        for module, n in zip(self.members, self.splits):
            own = _member_tensors(module, self.kind)
            for name, fused in self.tensors.items():
                t = own.get(name)
                if t is None or t.data_ptr() != fused[row:row + n].data_ptr() or t.shape != fused[row:row + n].shape:
                    return False
            row += n
        return self._scale_keys == ([_scale_key(m) for m in self.members] if self.kind == "nvfp4" else [])

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def fuse_group(members: Sequence[nn.Module], extra_rows: int = 0) -> FusedProjection | None:
    """Re-point ``members`` (same input, e.g. q/k/v of one layer) at one shared buffer and return the
    fused matmul, or None when they cannot share one (mixed types, dtypes, devices, biases, input
    sizes, NVFP4 global scales, an NVFP4 layer not on the kernel path, fewer than two members).

    ``extra_rows`` (``nn.Linear`` members only; then one member is enough): the buffer gets that many zero
    rows after the members' (weight and bias), for the caller to fill (``FusedProjection.extra_weight``): the
    engine puts a bf16 group's LoRA A matrices there, so that the base GEMM also computes ``x @ A^T``."""
    members = list(members)
    if len(members) < (1 if extra_rows else 2):
        return None
    kind = _kind(members)
    if kind is None or (extra_rows and kind != "linear"):
        return None
    owned = [_member_tensors(m, kind) for m in members]
    if any(own.keys() != owned[0].keys() for own in owned):
        return None  # bias on some members only
    tensors = {}
    with torch.no_grad():
        for name in owned[0]:
            parts = [own[name] for own in owned]
            fused = None if extra_rows else _adjacent(parts)
            if fused is None:
                tail = [parts[0].new_zeros(extra_rows, *parts[0].shape[1:])] if extra_rows else []
                fused = torch.cat([p.detach() for p in parts] + tail, dim=0)
                row = 0
                for m, p in zip(members, parts):
                    _rebind(m, kind, name, fused[row:row + p.shape[0]])
                    row += p.shape[0]
            tensors[name] = fused
    prepared = None
    if kind == "nvfp4":
        from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights

        for m in members:
            m._forget_derived()
        prepared = prepare_fp4_weights(tensors["weight_packed"], tensors["weight_scale"],
                                       members[0].weight_global_scale)
    return FusedProjection(members, kind, tensors, prepared, extra_rows)


# ---------------------------------------------------------------------------------------------- helpers
def _kind(members: list[nn.Module]) -> str | None:
    first = members[0]
    if all(type(m) is nn.Linear for m in members):
        ws = [m.weight for m in members]
        if all(w.dtype == ws[0].dtype and w.device == ws[0].device and w.shape[1] == ws[0].shape[1]
               and w.is_contiguous() for w in ws):
            return "linear"
        return None
    if all(isinstance(m, NVFP4Linear) for m in members):
        ok = all(m.in_features == first.in_features and m.weight_packed.device == first.weight_packed.device
                 and m.compute_dtype == first.compute_dtype and m.weight_packed.is_contiguous()
                 and m.weight_scale.is_contiguous() for m in members)
        on_kernel = all(resolve_impl(m.impl, m.weight_packed.device) == "kernel" for m in members)
        if ok and on_kernel and all(_same_scale(m, first) for m in members[1:]):
            return "nvfp4"
    return None


def _scale_key(m: NVFP4Linear) -> tuple:
    return (m.weight_global_scale.data_ptr(), m.weight_global_scale._version)


def _same_scale(a: NVFP4Linear, b: NVFP4Linear) -> bool:
    return bool(torch.equal(a.weight_global_scale, b.weight_global_scale))  # one host sync per member


def _member_tensors(m: nn.Module, kind: str) -> dict[str, torch.Tensor]:
    """The per-row tensors of a member, by name (bias only when present): parameters of an
    ``nn.Linear``, format buffers of an ``NVFP4Linear``."""
    store = m._parameters if kind == "linear" else m._buffers
    names = ("weight", "bias") if kind == "linear" else ("weight_packed", "weight_scale", "bias")
    return {name: store[name] for name in names if store.get(name) is not None}


def _rebind(m: nn.Module, kind: str, name: str, view: torch.Tensor) -> None:
    if kind == "linear":
        m._parameters[name].data = view  # same Parameter object, new storage
    else:
        m._buffers[name] = view


def _adjacent(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """The [sum of rows, ...] tensor the parts are consecutive row blocks of, if they already are."""
    first = parts[0]
    storage = first.untyped_storage()
    offset = first.storage_offset()
    for p in parts:
        if not p.is_contiguous() or p.untyped_storage().data_ptr() != storage.data_ptr() \
                or p.storage_offset() != offset or p.dtype != first.dtype or p.shape[1:] != first.shape[1:]:
            return None
        offset += p.numel()
    rows = sum(p.shape[0] for p in parts)
    return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
