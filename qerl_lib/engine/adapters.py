"""LoRA adapters applied by the rollout engine itself, unmerged: ``y = base(x) + scale * (x @ A^T) @ B^T``.

Two ways to roll out with adapters
----------------------------------
* Pass a peft ``PeftModel`` as the model: its ``LoraLayer`` modules run their own unmerged
  forward (``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling``) when the engine calls them.
* Pass ``lora={module name: LoraAdapter}`` (e.g. ``lora_from_peft(peft_model)``, or random
  adapters in the benchmark): the engine calls the *base* layers and adds the adapters itself.

The second form exists for CUDA graphs. A graph replays fixed addresses, so the engine copies
the adapters into buffers it owns at the start of every ``generate`` call (``LoraBuffers.refresh``):
new values (each GRPO step) take effect without re-capturing, and the caller may hand in new
tensors each time. The copy is cheap next to a rollout (rank 64 on a 7B model: 0.3 GB, ~0.1 ms).
Only a change of *layout* (targets, ranks, scales) forces a re-capture.

It is also cheaper per token: q/k/v read the same input, so their A matrices are stacked and
applied in one matmul (likewise gate/up), and each B is applied by one ``addmm`` that also adds
into the base output: 1 + members launches per projection group instead of 3 per projection. In the
CUDA decode step (``lora_kernels``) the engine runs ``kernels/lora.py`` instead: two Triton
launches per group whatever its members, the first overlapping the base GEMM. Where the group's NVFP4
GEMM runs on the mma.sync kernel (at most 8 rows), that launch may add the adapters itself or make
``xa`` beside its tiles (``gemm_lora_epilogue``; ``lora_in_gemm``, ``QERL_LORA_SHRINK_IN_GEMM``), or only add the
expand of an ``xa`` that the norm before the group made (``QERL_LORA_SHRINK_IN_NORM``, ``engine/forward.py``).

A as rows of a bf16 weight (``QERL_LORA_ROWS=0`` turns it off)
--------------------------------------------------------------
For a bf16 base the shrink ``xa = x @ A_cat^T`` is the same kind of product as the base GEMM, over the
same input: with the group's stacked A appended as ``R`` extra rows of its weight (``models/fused.py``,
``fuse_group(..., extra_rows=R)``; o and down become one-member groups), one cuBLAS GEMM writes
``[out | xa]`` and the shrink launch goes: one launch a group instead of two (``kernels/lora.given_xa``,
then the expand). ``xa`` comes out of cuBLAS's fp32 accumulation rounded once to bf16, as the torch path's
``xa`` tensor does. The A buffer here *is* those weight rows (``a_rows``), so each refresh writes A where
the GEMM reads it; the extra rows cost ``R / N`` more weight bytes (0.1-1.0% of a group at rank 16 on
Qwen2.5-7B). NVFP4 bases cannot do this: their GEMM reads 4-bit codes, A is bf16. On by default since
its measurement at 256 + 2048 tokens (dev/LOG.md section 46).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qerl_lib.kernels import lora as lora_kernels
from qerl_lib.models.fused import PARENT, PROJECTION_GROUPS  # LoRA targets, grouped by the input they read


def canonical_name(name: str) -> str:
    """Module names relative to the transformers CausalLM (peft prefixes them with "base_model.model.")."""
    return name[len("base_model.model."):] if name.startswith("base_model.model.") else name


def unwrap_model(model):
    """The transformers CausalLM inside ``model`` and whether it was a PeftModel (its LoRA-wrapped
    submodules stay in place and run unmerged when called)."""
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        return model.get_base_model(), True
    return model, False


@dataclass
class LoraAdapter:
    """One unmerged LoRA adapter: ``y = base(x) + scale * (x @ A^T) @ B^T``."""

    A: torch.Tensor  # [rank, in_features]
    B: torch.Tensor  # [out_features, rank]
    scale: float = 1.0  # alpha / rank in peft's convention

    def __post_init__(self):
        if self.A.dim() != 2 or self.B.dim() != 2 or self.A.shape[0] != self.B.shape[1]:
            raise ValueError(f"LoraAdapter needs A [rank, in] and B [out, rank] with the same rank, got "
                             f"A {tuple(self.A.shape)} and B {tuple(self.B.shape)}")


class LoraBuffers:
    """Engine-owned copies of LoRA adapters, grouped by shared input, refreshed in place per call.

    Per (layer, group): the present members' A matrices stacked, and a ``kernels.lora.GroupPlan``
    (None when a member's output width is unknown) whose zero-padded ``B`` buffer holds each
    member's B at its columns of the group's output; the per-member B buffers of the torch path
    are views into it, so one refresh serves both paths.

    ``a_rows(layer, group, total_rank)``: optional; returns the tensor ``[total_rank, in]`` to hold a group's
    stacked A (the extra rows of its fused bf16 weight, module docstring) or None for a buffer of its own."""

    def __init__(self, view, adapters: dict[str, LoraAdapter], a_rows=None):
        # (layer, group) -> (stacked A [sum of ranks, in], one slot per group member or None)
        self.layout: dict[tuple[int, str], tuple[torch.Tensor, list]] = {}
        self.plans: dict[tuple[int, str], lora_kernels.GroupPlan | None] = {}
        self._copies: list[tuple[torch.Tensor, str, str]] = []  # (engine buffer, adapter name, "A" or "B")
        by_layer: dict[int, dict[str, str]] = {}
        for name in adapters:
            layer, proj = parse_target(name, view.n_layers)
            by_layer.setdefault(layer, {})[proj] = name
        for layer, targets in sorted(by_layer.items()):
            for group, members in PROJECTION_GROUPS.items():
                present = [m for m in members if m in targets]
                if not present:
                    continue
                in_features = {adapters[targets[m]].A.shape[1] for m in present}
                if len(in_features) != 1:
                    raise ValueError(f"LoRA A matrices of layer {layer} {group} disagree on in_features {in_features}")
                total_rank = sum(adapters[targets[m]].A.shape[0] for m in present)
                k = in_features.pop()
                a_cat = a_rows(layer, group, total_rank) if a_rows is not None else None
                if a_cat is None or tuple(a_cat.shape) != (total_rank, k) or a_cat.dtype != view.dtype:
                    a_cat = torch.empty(total_rank, k, dtype=view.dtype, device=view.device)
                widths = [_out_features(view.projection(layer, m)) for m in members]
                spans, placed, start, col = [], [], 0, 0  # spans: (n_start, n_end, r_start, rank, scale)
                for m, width in zip(members, widths):
                    if m in targets:
                        name, ad = targets[m], adapters[targets[m]]
                        if width is not None and ad.B.shape[0] != width:
                            raise ValueError(f"LoRA B of {name} has {ad.B.shape[0]} rows, the layer has {width} outputs")
                        r = ad.A.shape[0]
                        spans.append((col, col + ad.B.shape[0], start, r, float(ad.scale)))
                        placed.append(m)
                        start += r
                    col += width if width is not None else 0
                plan = None
                if all(w is not None for w in widths):
                    plan = lora_kernels.build_plan(a_cat, col, spans)
                slots = []
                for m in members:
                    if m not in placed:
                        slots.append(None)
                        continue
                    i = placed.index(m)
                    name, (_, _, r0, r, scale) = targets[m], spans[i]
                    b_buf = plan.b_view(i) if plan is not None else \
                        torch.empty(tuple(adapters[name].B.shape), dtype=view.dtype, device=view.device)
                    self._copies += [(a_cat[r0:r0 + r], name, "A"), (b_buf, name, "B")]
                    slots.append((r0, r0 + r, b_buf, scale))
                self.layout[(layer, group)] = (a_cat, slots)
                self.plans[(layer, group)] = plan

    def refresh(self, adapters: dict[str, LoraAdapter]) -> None:
        """Copy the adapters' current values into the buffers (a graph keeps reading the same addresses)."""
        with torch.no_grad():
            for buf, name, which in self._copies:
                buf.copy_(getattr(adapters[name], which))


def lora_signature(adapters: dict[str, LoraAdapter]) -> tuple:
    """What a captured graph depends on: target names, shapes and scales (not the values)."""
    return tuple(sorted((n, tuple(a.A.shape), tuple(a.B.shape), float(a.scale)) for n, a in adapters.items()))


def _out_features(module) -> int | None:
    """Output width of a Linear / NVFP4Linear (through a peft wrapper), or None if it has no such attribute."""
    if hasattr(module, "out_features"):
        return int(module.out_features)
    base = getattr(module, "base_layer", None)
    return _out_features(base) if base is not None else None


def parse_target(name: str, n_layers: int) -> tuple[int, str]:
    parts = canonical_name(name).split(".")
    ok = (len(parts) == 5 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit()
          and parts[4] in PARENT and parts[3] == PARENT[parts[4]] and int(parts[2]) < n_layers)
    if not ok:
        raise ValueError(f"LoRA target {name!r} is not a projection of this model: use names like "
                         "'model.layers.0.self_attn.q_proj' (q/k/v/o_proj, gate/up/down_proj)")
    return int(parts[2]), parts[4]


def lora_from_peft(model, adapter_name: str | None = None) -> dict[str, LoraAdapter]:
    """Read a peft model's LoRA adapters as ``{module name: LoraAdapter}`` (views, no copies), e.g.
    to hand them to the engine while it calls the base layers."""
    out = {}
    lm, _ = unwrap_model(model)
    for name, module in lm.named_modules():
        if not hasattr(module, "lora_A"):
            continue
        key = adapter_name or (module.active_adapters[0] if module.active_adapters else None)
        if key is None or key not in module.lora_A:
            continue
        out[canonical_name(name)] = LoraAdapter(module.lora_A[key].weight.detach(), module.lora_B[key].weight.detach(),
                                                 float(module.scaling[key]))
    return out


def gemm_lora_epilogue(plan, x: torch.Tensor, in_gemm: bool, shrink_in_gemm: bool, fp4_kernel: bool, member,
                       given: torch.Tensor | None = None):
    """The ``kernels.mma.LoraEpilogue`` that a group's NVFP4 GEMM launch takes, or None: with ``in_gemm`` the
    launch adds the adapters itself, with ``shrink_in_gemm`` it only makes ``xa`` beside its tiles (the expand
    stays ``kernels/lora.py``'s), with ``given`` (float32 ``xa`` an earlier kernel made) it only adds the expand.
    Only where ``plan`` exists, the group runs one ``fp4_linear`` call (``fp4_kernel``) and that call takes the
    mma.sync kernel (decode, at most 8 rows)."""
    if plan is None or not fp4_kernel or not (in_gemm or shrink_in_gemm or given is not None):
        return None
    from qerl_lib.kernels.fp4_gemm import uses_mma

    m, k = x.numel() // x.shape[-1], x.shape[-1]
    if not uses_mma(m, k, x.device, member.small_m_backend):
        return None  # before the epilogue: a shrink-only one allocates its plan's workspace on first use
    epilogue = plan.epilogue(given=given) if given is not None else plan.epilogue(expand=in_gemm)
    return epilogue if epilogue.supported(m, k) else None


def add_lora_torch(entry: tuple, x: torch.Tensor, xa: torch.Tensor | None, outs: list) -> list:
    """The plain-torch adapters of one group (``LoraBuffers.layout`` entry ``(a_cat, slots)``): ``xa = x @
    A_cat^T`` (or the given ``xa``, rounded to x's dtype), then one ``addmm`` per member with an adapter.

    The expand adds into the member's output in place (``addmm_``) wherever its rows flatten to a view: a fused
    group's members are column slices of one GEMM output, and BLAS takes such a slice as it is (its row stride as
    the leading dimension), where the out-of-place ``addmm`` would first copy it, strided, into a new tensor (a
    prefill's gate/up expand at 7B, 2048 rows: two 77 MB copies a layer, dev/LOG.md section 128). The same sum
    either way: out-of-place ``addmm`` is that copy followed by the same in-place product."""
    a_cat, slots = entry
    xa = x.reshape(-1, x.shape[-1]) @ a_cat.t() if xa is None else xa.reshape(-1, a_cat.shape[0]).to(x.dtype)
    for j, slot in enumerate(slots):
        if slot is not None:
            start, end, b, scale = slot
            o = outs[j]
            rows = o.reshape(-1, o.shape[-1])
            if rows.data_ptr() == o.data_ptr() and not o.requires_grad:  # a view: add in place
                rows.addmm_(xa[:, start:end], b.t(), alpha=scale)
            else:
                outs[j] = torch.addmm(rows, xa[:, start:end], b.t(), alpha=scale).view(o.shape)
    return outs
