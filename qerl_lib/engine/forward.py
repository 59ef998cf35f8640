"""The engine's own forward pass over a Hugging Face Llama / Qwen2 model's modules.

Why write the forward instead of calling ``model(...)``
-------------------------------------------------------
``model(input_ids, past_key_values=...)`` grows a ``DynamicCache`` by concatenation, builds masks
in Python on every call and cannot be captured as one CUDA graph. The decoder itself is small:
per layer ``x += o_proj(attn(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))`` then
``x += down_proj(silu(gate_proj(n2(x))) * up_proj(n2(x)))``. So the engine walks the modules
itself (gpt-fast and nanochat do the same) and owns the KV cache. The arithmetic follows
transformers 5.17 ``modeling_llama`` / ``modeling_qwen2`` operation for operation, so that greedy
tokens match ``model.generate`` on CPU:

* **RMSNorm**: upcast to float32, ``x * rsqrt(mean(x^2) + eps)``, cast back to the activation
  dtype, *then* multiply by the weight (HF's order; multiplying in float32 rounds differently).
* **RoPE**: cos/sin come from the model's own ``rotary_emb`` module (float32 angles, cast to the
  activation dtype), so rope_theta, head_dim and static ``rope_scaling`` types (linear, llama3,
  yarn) are handled exactly as HF does. Dynamic types, which depend on the sequence length, are
  refused. ``rotate_half`` pairs dimension ``i`` with ``i + head_dim/2``.
* **Attention**: SDPA with grouped-query attention on CPU and in prefill (HF's own rule: GQA
  through ``enable_gqa`` when there is no mask, repeated K/V otherwise). In the CUDA decode step
  a single query token attends through ``engine/attention.py``'s split-KV Triton kernel (float32
  online softmax, K and V read once; the math fallback SDPA takes for GQA + mask would copy them
  7x for Qwen2.5-7B), or through two batched matmuls over the cache with the query heads of one
  KV head folded into the matmul's M dimension (``decode_attention="matmul"``, HF's eager rounding).
* Qwen2's q/k/v biases, Llama's optional attention/MLP biases and tied or untied embeddings
  need no code: the engine calls ``q_proj(x)``, ``lm_head(h)`` etc. as modules.

Calling every projection as a module is what makes one engine serve bf16, NVFP4 and LoRA:
an ``NVFP4Linear`` (packed FP4 weights + Triton kernel) or a peft ``LoraLayer`` (base output +
``B(A(x)) * scale``, unmerged) is just another module with ``forward(x)``.

Engine-owned weights: AQN norms and LoRA
-----------------------------------------
Every RMSNorm weight is *copied into an engine-owned buffer* at the start of each ``generate``
call, from the model or from ``norm_overrides`` (AQN's noisy weights). A CUDA graph replays fixed
addresses, so a new noisy weight each call takes effect without re-capturing, and the model's
parameters are never written. LoRA adapters passed as ``lora=`` get the same treatment
(``engine/adapters.py``). On CUDA each projection group's adapters run as ``kernels/lora.py``'s
shrink and expand launches after the group's GEMM; above 8 rows the gate/up group's expand is
instead added by the SiLU * up kernel that reads its output (``lora_fold``, ``engine/glue.py``). A bf16
group's GEMM also makes ``xa``, without a shrink launch (``engine/adapters.py``; ``QERL_LORA_ROWS=0``: off).
With ``QERL_LORA_SHRINK_IN_NORM=1`` (off by default: slower on an H200, dev/LOG.md 67) an NVFP4 q/k/v or gate/up
group at <= 8 rows launches nothing for its adapters: the residual add + RMSNorm before it also makes its ``xa``
(``glue.norm_shrink``) and its mma.sync GEMM adds ``xa @ B^T`` in the epilogue (``LoraEpilogue(given=)``); o and
down keep their two launches.
With ``lora_merge`` a dense group runs one GEMM over an engine-owned merged copy instead (``engine/merged.py``).

Fused projections
-----------------
On CUDA, q/k/v and gate/up each run as one wider matmul over storage the members share
(``models/fused.py``): three launches fewer per layer, and no 1 MB k/v GEMMs that cannot reach
bandwidth. The modules themselves keep working as they did (their tensors become views).

Fused glue
----------
Between the matmuls sit elementwise steps (residual add + RMSNorm, RoPE, softmax, SiLU * up).
Run eagerly they are ~30 small kernel launches per layer, which at batch 8 cost as much as the
weight-bound matmuls of an NVFP4 model. The ``Glue`` functions are written so that
``torch.compile`` can turn each into one kernel; the decode step uses the compiled ones when
asked (``fuse_elementwise``), CPU runs the plain ones. With ``glue_kernels`` (the CUDA default) the norms and
SiLU * up run as ``engine/glue.py``'s Triton kernels instead, which let the next NVFP4 matmul launch while they run
(programmatic dependent launch). The prefill takes them too, and RoPE as ``glue.rope_qk`` (``prefill_glue_ops``;
the plain ones spent 12 of a 7B 8 x 256-token prefill's 66 ms of GPU time on an H200: seven float32 kernels per
norm, SiLU x up over the strided halves of the fused gate/up output, and RoPE is ten eager launches a layer). In a
same-process A/B on an H200 they took that prefill's wall from 76 to 63 ms with a rank-16 adapter, and 65 to 52
without (dev/LOG.md section 128); ``QERL_PREFILL_GLUE=0`` keeps the plain ones.

Where an NVFP4 GEMM runs a Gluon kernel (``fp4_gemm.takes_relabeled_x``: decode batches 32-128 on Qwen2.5),
it reads x in its own K relabeling, which the kernel that produced x also stores (``relabeled=``,
``out_relabeled=``): no permute launch (``QERL_FP4_RELABEL_X=0``: off; H100, 7B + r16: +2-3%, dev/LOG.md 38).
Where a group's FP4 GEMM cuts K into at most 4 slices (`launch_rule` on Qwen2.5-7B's shapes with 132 SMs: down at
24-64 and 129-192 rows, q/k/v at 25-32 and 97-192, o at 25-32 and 129-192), the group's LoRA expand sums its fp32
partials (``kernels/lora.expand_(..., base=)``, same bits): one reduction launch
fewer (H100, 7B + r16: +0.4-0.9%, dev/LOG.md 39; more slices lost 3.8%). ``QERL_LORA_SUMS_SPLITS=0``: off.
"""

from __future__ import annotations

import os

import torch

from qerl_lib.engine import glue as engine_glue
from qerl_lib.engine.adapters import (LoraAdapter, LoraBuffers, add_lora_torch, canonical_name, gemm_lora_epilogue,
                                      lora_signature, unwrap_model)
from qerl_lib.engine.attention import AttentionLaunch, rope_cache_attention
from qerl_lib.engine.merged import MergedAdapters
from qerl_lib.engine.reference_ops import (Glue, _rope_in_attention, attention_probs, gated_act,
                                           matmul_decode_attention, residual_rms_norm, rms_norm, rope_qk, sdpa_attention)
from qerl_lib.kernels import lora as lora_kernels_mod
from qerl_lib.models.fused import PARENT, PROJECTION_GROUPS, PROJECTIONS, fuse_group
from qerl_lib.models.nvfp4_linear import NVFP4Linear, resolve_impl

RELABEL_ENV = "QERL_FP4_RELABEL_X"  # "0": the Gluon FP4 launches permute x themselves (module docstring)
SPLIT_FOLD_ENV = "QERL_LORA_SUMS_SPLITS"  # "0": never let the LoRA expand sum a K-split GEMM's partials (docstring)
SHRINK_IN_GEMM_ENV = "QERL_LORA_SHRINK_IN_GEMM"  # "1": NVFP4 groups on the mma.sync kernel make xa in their launch
LORA_ROWS_ENV = "QERL_LORA_ROWS"  # "0": bf16 groups' LoRA A not as extra rows of their weight (engine/adapters.py)
SHRINK_IN_NORM_ENV = "QERL_LORA_SHRINK_IN_NORM"  # "1": the norm before an NVFP4 q/k/v or gate/up group makes its xa
PREFILL_GLUE_ENV = "QERL_PREFILL_GLUE"  # "0": the prefill keeps torch's eager norms, RoPE, SiLU x up

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
DECODE_ATTENTION = ("sdpa", "matmul", "kernel")
_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class ModelView:
    """Handles on the modules the engine calls, plus the shape facts it needs. Validates the model."""

    def __init__(self, model):
        lm, self.is_peft = unwrap_model(model)
        config = lm.config
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported architecture {model_type!r} ({type(lm).__name__}): the rollout engine "
                             f"supports the model types {', '.join(SUPPORTED_MODEL_TYPES)} "
                             "(LlamaForCausalLM, Qwen2ForCausalLM)")
        layer_types = getattr(config, "layer_types", None) or ()
        if getattr(config, "use_sliding_window", False) and "sliding_attention" in layer_types:
            raise ValueError("sliding-window attention is not supported by the rollout engine: "
                             "set config.use_sliding_window=False (Qwen2.5 checkpoints ship with it off)")
        rope = getattr(config, "rope_parameters", None) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(f"rope type {rope_type!r} depends on the sequence length and is not supported: "
                             f"the engine supports {', '.join(_STATIC_ROPE_TYPES)}")
        self.default_stop_ids = _eos_ids(getattr(lm, "generation_config", None), config)
        self.config = config  # no reference to `lm` itself: the engine cache must not keep the model alive
        body = lm.model
        self.embed = body.embed_tokens
        self.layers = list(body.layers)
        self.final_norm = body.norm
        self.rotary = body.rotary_emb
        self.lm_head = lm.lm_head
        self.n_layers = len(self.layers)
        self.n_heads = config.num_attention_heads
        self.n_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.vocab_size = self.embed.weight.shape[0]
        self.scaling = getattr(self.layers[0].self_attn, "scaling", self.head_dim ** -0.5)
        self.eps = [(layer.input_layernorm.variance_epsilon, layer.post_attention_layernorm.variance_epsilon)
                    for layer in self.layers]
        self.final_eps = self.final_norm.variance_epsilon
        self.max_positions = getattr(config, "max_position_embeddings", None)
        self.dtype = self.embed.weight.dtype
        self.device = self.embed.weight.device
        # RMSNorm modules by canonical name, in the engine's buffer order (2 per layer, then the final one).
        self.norm_names = [f"model.layers.{i}.{n}" for i in range(self.n_layers)
                           for n in ("input_layernorm", "post_attention_layernorm")] + ["model.norm"]
        self.norm_modules = [m for l in self.layers for m in (l.input_layernorm, l.post_attention_layernorm)]
        self.norm_modules.append(self.final_norm)

    def projection(self, layer: int, name: str, base: bool = False):
        """The module that computes ``name`` in ``layer``; ``base=True`` skips a peft LoRA wrapper."""
        module = getattr(getattr(self.layers[layer], PARENT[name]), name)
        return module.base_layer if base and hasattr(module, "base_layer") else module

    def signature(self) -> tuple:
        """Identity of every module a captured graph calls, and of peft's adapter switches: when it
        changes (modules swapped, an adapter disabled or merged) cached graphs are stale."""
        sig = [id(self.embed), id(self.lm_head), id(self.final_norm)]
        for i in range(self.n_layers):
            for name in PROJECTIONS:
                m = self.projection(i, name)
                sig.append(id(m))
                if hasattr(m, "lora_A"):
                    sig.append((bool(m.disable_adapters), bool(m.merged), tuple(m.active_adapters)))
        return tuple(sig)


def _eos_ids(generation_config, config) -> tuple[int, ...]:
    """Stop tokens: the generation config's eos_token_id (int or list), else the model config's."""
    eos = getattr(generation_config, "eos_token_id", None) if generation_config is not None else None
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))


class ForwardPass:
    """Prefill and one decode step over a ``ModelView``, with engine-owned norm weights and LoRA buffers.

    ``decode_attention``: "sdpa" (HF's numerics; CPU default), "matmul" (K/V read once, torch ops) or
    "kernel" (``engine/attention.py``: one split-KV Triton kernel per layer; CUDA default).
    ``fuse_elementwise``: in the decode step, run the elementwise glue between matmuls through
    ``torch.compile``: residual add + RMSNorm, RoPE of q and k, the attention softmax, SiLU * up.
    ~30 launches a layer eagerly, ~6 fused: worth it inside a CUDA graph. Prefill runs ``prefill_ops``: the eager
    functions, or on CUDA (unless ``QERL_PREFILL_GLUE=0``) the glue kernels' norms, RoPE and SiLU x up
    (``prefill_glue_ops``).
    ``glue_kernels`` (with ``fuse_elementwise``, on CUDA): the norms and SiLU * up through
    ``engine/glue.py``'s Triton kernels rather than ``torch.compile``. ``attention_launch``: the
    decode-attention kernel's launch shape (``engine.attention.AttentionLaunch``; None:
    ``attention.pick_launch``'s by batch).
    """

    def __init__(self, view: ModelView, decode_attention: str = "sdpa", fuse_elementwise: bool = False,
                 bypass_peft: bool = False, fuse_projections: bool = False, glue_kernels: bool = False,
                 attention_launch: AttentionLaunch | None = None, lora_kernels: bool = False,
                 lora_in_gemm: bool = False, lora_fold: bool | None = None, lora_merge: bool = False,
                 remap_merged: bool = False):
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {DECODE_ATTENTION}, got {decode_attention!r}")
        self.view = view
        self.decode_attention = decode_attention
        self.attention_launch = attention_launch
        with torch.no_grad():
            self.norm_weights = [m.weight.detach().clone() for m in view.norm_modules]
        self.lora: LoraBuffers | None = None
        # lora_merge: dense groups' adapters merged into engine-owned weight copies (engine/merged.py)
        self.lora_merge, self.merged, self._lora_signature = bool(lora_merge), None, None
        self.remap_merged = bool(remap_merged)  # the copies in CUDA virtual memory (RolloutEngine's remap_cache)
        # lora_kernels: adapters through kernels/lora.py's two launches per group (CUDA, <= 256 rows)
        self.lora_kernels = bool(lora_kernels) and lora_kernels_mod.triton is not None and (
            view.device.type == "cuda" or lora_kernels_mod.interpreting())
        # lora_in_gemm: with lora_kernels, an NVFP4 group on the mma.sync path adds its adapters in its own GEMM
        # (off by default: slower than kernels/lora.py's two launches on an H100, dev/LOG.md section 25)
        self.lora_in_gemm = bool(lora_in_gemm)
        # lora_fold: with lora_kernels and the glue kernels, gate/up's expand is added by SiLU x up; None: above
        # kernels/lora.FEW_ROWS rows only (H100: -0.7 to -1.3 points at batch 32 / 64, +6 at 8; dev/LOG.md 29)
        self.lora_fold = None if lora_fold is None else bool(lora_fold)
        # bypass_peft: call peft's base layers, because the engine applies the adapters itself (lora=...)
        self._groups = [{g: [view.projection(i, p, base=bypass_peft) for p in members]
                         for g, members in PROJECTION_GROUPS.items()} for i in range(view.n_layers)]
        # fuse_projections: q/k/v and gate/up as one matmul each over shared storage (models/fused.py);
        # a group that cannot be fused (peft wrappers called as modules, mixed types) runs member by member
        self._fused = [{g: (fuse_group(ms) if fuse_projections and len(ms) > 1 else None) for g, ms in groups.items()}
                       for groups in self._groups]
        # One activation object for every layer (all use config.hidden_act): a compiled function
        # guards on the module it is given, and 28 different SiLU instances would mean 28 compiles.
        self._act = view.layers[0].mlp.act_fn
        self.eager_ops = Glue(rms_norm, residual_rms_norm, rope_qk, attention_probs, gated_act)
        self.decode_ops = self.prefill_ops = self.prefill_glue_ops = self.eager_ops
        if fuse_elementwise:
            # dynamic=None: a shape that changes (the attention length bucket) turns dynamic after one
            # recompile instead of compiling once per bucket.
            self.decode_ops = Glue(*(torch.compile(f) for f in self.eager_ops))
            if glue_kernels and view.device.type == "cuda" and engine_glue.triton is not None:
                silu = getattr(view.config, "hidden_act", None) == "silu"
                self.decode_ops = self.decode_ops._replace(
                    norm=engine_glue.rms_norm, residual_norm=engine_glue.residual_rms_norm,
                    gated=engine_glue.silu_mul if silu else self.decode_ops.gated)
                # the same kernels for the prefill (its shapes change from call to call: no compiled ops), where
                # torch's eager norm (seven float32 kernels) and SiLU x up over strided halves of gate/up took 12 of a
                # 7B 8 x 256 prefill's 66 ms of GPU time on an H200, and RoPE as one kernel for q and one for k
                # (transformers' bits) instead of ten eager ones a layer (dev/LOG.md sections 126, 128)
                self.prefill_glue_ops = self.eager_ops._replace(
                    norm=engine_glue.rms_norm, residual_norm=engine_glue.residual_rms_norm,
                    rope=engine_glue.rope_qk, gated=engine_glue.silu_mul if silu else self.eager_ops.gated)
                if os.environ.get(PREFILL_GLUE_ENV, "1") != "0":
                    self.prefill_ops = self.prefill_glue_ops
        self._columns = torch.arange(0, dtype=torch.long, device=view.device)
        self._rope_table: tuple[torch.Tensor, torch.Tensor] | None = None
        # the decode step's launch folds (module docstring), read from the environment once per forward pass
        self.relabel_x = os.environ.get(RELABEL_ENV, "1") != "0" and view.device.type == "cuda"
        self.lora_sums_splits = os.environ.get(SPLIT_FOLD_ENV, "1") == "1" and view.device.type == "cuda"
        self.lora_rows = os.environ.get(LORA_ROWS_ENV, "1") != "0" and self.lora_kernels and fuse_projections
        self.lora_shrink_in_gemm = os.environ.get(SHRINK_IN_GEMM_ENV, "0") == "1" and self.lora_kernels
        self.lora_shrink_in_norm = (os.environ.get(SHRINK_IN_NORM_ENV, "0") == "1" and self.lora_kernels
                                    and not (self.lora_in_gemm or self.lora_shrink_in_gemm))
        self._relabel_plan: dict[tuple[int, str, int], bool] = {}  # (layer, group, rows) -> takes_relabeled

    def reserve_columns(self, length: int) -> None:
        """Allocate, before any capture (not inside one), the column index used by decode masks and
        the RoPE table: cos/sin of every position below ``length``, from the model's own rotary
        module (the same elementwise arithmetic as a per-step call, so the same values), which the
        decode step gathers from instead of recomputing them with ~8 small kernels per step."""
        if self._columns.numel() < length:
            self._columns = torch.arange(length, dtype=torch.long, device=self.view.device)
        if self._rope_table is None or self._rope_table[0].shape[0] < length:
            probe = torch.zeros(1, 1, 1, dtype=self.view.dtype, device=self.view.device)
            with torch.no_grad():
                cos, sin = self.view.rotary(probe, self._columns[:length][None])
            self._rope_table = (cos[0], sin[0])  # [length, head_dim]

    # ---- per-call state -------------------------------------------------------------------------
    def load_norm_weights(self, overrides: dict[str, torch.Tensor] | None) -> None:
        """Copy each RMSNorm weight (or its override) into the engine's buffer; the model is not touched."""
        overrides = {canonical_name(k): v for k, v in (overrides or {}).items()}
        unknown = sorted(set(overrides) - set(self.view.norm_names))
        if unknown:
            raise ValueError(f"norm_overrides names {unknown[:3]} are not RMSNorm modules of this model: "
                             f"use names like {self.view.norm_names[0]!r}, {self.view.norm_names[1]!r} "
                             "or 'model.norm'")
        with torch.no_grad():
            for name, module, buf in zip(self.view.norm_names, self.view.norm_modules, self.norm_weights):
                src = overrides.get(name, module.weight)
                if tuple(src.shape) != tuple(buf.shape):
                    raise ValueError(f"norm_overrides[{name!r}] has shape {tuple(src.shape)}, "
                                     f"expected {tuple(buf.shape)}")
                buf.copy_(src)  # cast to the norm weight's dtype, as HF would multiply in it

    def load_lora(self, adapters: dict[str, LoraAdapter] | None) -> bool:
        """Point the engine at these adapters (copying their values). Returns True when the layout
        changed, which invalidates captured graphs."""
        signature = lora_signature(adapters) if adapters else None
        changed = signature != self._lora_signature
        if changed:
            self.merged = self.lora = None  # the old copies go before the new ones are allocated
            self.merged = (MergedAdapters(self._groups, adapters, remappable=self.remap_merged)
                           if adapters and self.lora_merge else None)
            rest = {n: a for n, a in (adapters or {}).items() if self.merged is None or n not in self.merged.targets}
            self.lora = LoraBuffers(self.view, rest, a_rows=self._a_rows if self.lora_rows else None) if rest else None
            self._lora_signature = signature
        for buffers in (self.merged, self.lora):
            if buffers is not None:
                buffers.refresh(adapters)
        return changed

    def drop_merged(self) -> None:
        """Free the merged weight copies (``lora_merge``); the next ``load_lora`` builds them again."""
        if self.merged is not None:
            self.merged, self._lora_signature = None, None

    def _a_rows(self, layer: int, group: str, rank: int) -> torch.Tensor | None:
        """``LoraBuffers``' ``a_rows``: the group re-fused with ``rank`` extra weight rows (bf16 groups only)."""
        fused = fuse_group(self._groups[layer][group], extra_rows=rank)
        if fused is not None:
            self._fused[layer][group] = fused
        return None if fused is None else fused.extra_weight()

    # ---- the decoder ----------------------------------------------------------------------------
    def fused_groups(self) -> int:
        return sum(f is not None for groups in self._fused for f in groups.values())

    def is_stale(self) -> bool:
        """True when a fused group's members no longer read the shared buffers (tensors replaced)."""
        return any(f is not None and not f.is_current() for groups in self._fused for f in groups.values())

    def folds_gate_up(self, rows: int) -> bool:
        """Whether a step of ``rows`` tokens adds the gate/up adapters inside SiLU x up (``lora_fold``; where
        the LoRA kernels, the glue kernels and fused gate/up all apply)."""
        return self.lora_fold if self.lora_fold is not None else rows > lora_kernels_mod.FEW_ROWS

    def takes_relabeled(self, layer: int, group: str, rows: int) -> bool:
        """Whether the group's GEMM, at ``rows`` rows of x, reads a relabeled copy of x (module docstring):
        an NVFP4 group (fused, or one ``NVFP4Linear`` on the kernel path) whose launch is a Gluon one."""
        key = (layer, group, rows)
        if key not in self._relabel_plan:
            self._relabel_plan[key] = self._plan_relabeled(layer, group, rows)
        return self._relabel_plan[key]

    def _plan_relabeled(self, layer: int, group: str, rows: int) -> bool:
        from qerl_lib.kernels.fp4_gemm import takes_relabeled_x

        prepared = self._fp4_weight(layer, group)
        if not self.relabel_x or prepared is None:
            return False
        return prepared.shape[1] % 128 == 0 and takes_relabeled_x(rows, prepared, self.view.device,
                                                                  self._groups[layer][group][0].small_m_backend)

    def _fp4_weight(self, layer: int, group: str):
        """The group's ``PreparedFP4Weight`` where one ``fp4_linear`` call runs it (a fused NVFP4 group, or one
        ``NVFP4Linear`` on the kernel path), else None."""
        fused, members = self._fused[layer][group], self._groups[layer][group]
        if fused is not None:
            return fused.prepared if fused.kind == "nvfp4" else None
        if len(members) == 1 and type(members[0]) is NVFP4Linear \
                and resolve_impl(members[0].impl, self.view.device) == "kernel":
            return members[0].prepare_kernel()
        return None

    def prefill_launches(self, tokens: int) -> tuple:
        """The kernel launch of every NVFP4 group's GEMM at a prefill of ``tokens`` rows of x (layer 0's: every
        layer has the same shapes): "mma" or ``fp4_gemm.planned_launch``'s config. Each distinct launch is a kernel
        variant Triton compiles the first time it runs (``engine/continuous.warm_prefill_launches``)."""
        from qerl_lib.kernels.fp4_gemm import planned_launch, uses_mma

        device, launches = self.view.device, []
        for group, members in self._groups[0].items():
            prepared = self._fp4_weight(0, group)
            if prepared is not None:
                mma = uses_mma(tokens, prepared.shape[1], device, members[0].small_m_backend)
                launches.append((group, "mma" if mma else planned_launch(tokens, prepared, device)))
        return tuple(launches)

    def norm_shrink_plan(self, layer: int, group: str, rows: int):
        """The group's ``kernels/lora.GroupPlan`` where the norm before it makes its ``xa`` (``glue.norm_shrink``)
        and its GEMM's epilogue adds the expand (``QERL_LORA_SHRINK_IN_NORM=1``, module docstring), else None:
        an NVFP4 group with adapters that one ``fp4_linear`` call runs on the mma.sync kernel (at most 8 rows)."""
        if not self.lora_shrink_in_norm or self.lora is None or rows > lora_kernels_mod.FEW_ROWS:
            return None
        plan, prepared = self.lora.plans.get((layer, group)), self._fp4_weight(layer, group)
        if plan is None or prepared is None:
            return None
        from qerl_lib.kernels.fp4_gemm import uses_mma

        member = self._groups[layer][group][0]
        return plan if uses_mma(rows, prepared.shape[1], self.view.device, member.small_m_backend) else None

    def _project(self, layer: int, group: str, x: torch.Tensor, x_relabeled: torch.Tensor | None = None):
        return self._project_parts(layer, group, x, x_relabeled=x_relabeled)[0]

    def _project_parts(self, layer: int, group: str, x: torch.Tensor, defer: bool = False,
                       x_relabeled: torch.Tensor | None = None, given_xa: torch.Tensor | None = None):
        """``(outputs of the group's members, None)``; with ``defer``, where the LoRA kernels take the group,
        only their shrink runs and the second item is its ``kernels/lora.Shrunk``: the outputs then lack the
        adapters, and the caller's consumer kernel must add the expand (``glue.silu_mul(..., lora=)``).
        ``x_relabeled``: x's relabeled copy, where ``takes_relabeled`` says the group's GEMM reads one.
        ``given_xa``: float32 ``x @ A_cat^T`` that the norm made (``norm_shrink_plan``); no shrink runs."""
        if self.merged is not None and self.merged.covers(layer, group):  # one GEMM over the merged copy
            return self.merged.project(layer, group, x), None
        fused, xa_cols = self._fused[layer][group], None  # xa_cols: xa made by the base GEMM's launch
        entry = self.lora.layout.get((layer, group)) if self.lora is not None else None
        plan = self.lora.plans.get((layer, group)) if entry is not None and self.lora_kernels else None
        # an NVFP4 GEMM on the mma.sync kernel may add the adapters itself, or make xa beside its tiles
        members = self._groups[layer][group]
        fp4 = plan is not None and self._fp4_weight(layer, group) is not None  # one fp4_linear call runs the group
        epilogue = gemm_lora_epilogue(plan, x, self.lora_in_gemm, self.lora_shrink_in_gemm, fp4, members[0],
                                      given=None if defer else given_xa)
        # the expand kernel may sum a K-split GEMM's partials (module docstring): collect them instead of reducing
        splits = [] if fp4 and epilogue is None and not defer and self.lora_sums_splits and plan.covers_all() else None
        if fused is not None:
            full = fused.full(x, lora=epilogue, x_relabeled=x_relabeled, defer_reduce=splits)
            outs = fused.outputs(full)
            if plan is not None and fused.extra_rows and plan.a_cat.data_ptr() == fused.extra_weight().data_ptr():
                full, xa_cols = full[..., :fused.width], full[..., fused.width:]
        elif x_relabeled is not None or splits is not None or epilogue is not None:  # one NVFP4Linear: its forward
            from qerl_lib.kernels.fp4_gemm import fp4_linear

            (m,) = members
            outs = [fp4_linear(x, m.prepare_kernel(), m.bias, small_m_backend=m.small_m_backend, mma_rule=m.mma_rule,
                               x_relabeled=x_relabeled, defer_reduce=splits, lora=epilogue)]
            full = outs[0]
        else:
            outs = [module(x) for module in members]
            full = outs[0] if len(outs) == 1 else None
        if epilogue is not None:
            if epilogue.expand:  # the GEMM has added the adapters
                return outs, None
            xa_cols = epilogue.xa(x.numel() // x.shape[-1], x.shape[-1])
        elif given_xa is not None:
            xa_cols = given_xa
        if plan is not None and full is not None:
            full2, x2 = full.reshape(-1, full.shape[-1]), x.reshape(-1, x.shape[-1])
            if full2.data_ptr() == full.data_ptr() and lora_kernels_mod.supported(full2, x2):
                lora_kernels_mod.check_shapes(full2, x2, plan)
                base = lora_kernels_mod.split_base(splits, full2)  # None: nothing deferred, or reduced just now
                shrunk = lora_kernels_mod.shrink_(x2, plan) if xa_cols is None else \
                    lora_kernels_mod.given_xa(xa_cols.reshape(-1, xa_cols.shape[-1]), plan)
                if defer:
                    return outs, shrunk
                lora_kernels_mod.expand_(full2, shrunk, base)  # in place: the outputs are views of it
                return outs, None
        lora_kernels_mod.split_base(splits, None)  # not taken by an expand: reduce the partials now
        return (add_lora_torch(entry, x, xa_cols, outs) if entry is not None else outs), None

    def _decoder(self, x: torch.Tensor, cos, sin, attend, ops: "Glue", attend_relabels: bool = False) -> torch.Tensor:
        """All layers, then the final norm: ``x [B, T, hidden]`` -> normed hidden states.

        HF's order per layer: ``h = n1(x); x = x + o_proj(attn(h)); h = n2(x); x = x + mlp(h)``.
        Written so that each residual add is fused with the norm that follows it (the next layer's
        input norm, or the final norm after the last layer). With the glue kernels, a kernel whose output
        feeds a GEMM that ``takes_relabeled`` also writes x's relabeled copy (``attend_relabels``: so can
        ``attend(..., relabeled=True)``, returning ``(attention, copy)``), and a norm before a group that
        ``norm_shrink_plan`` names also makes that group's LoRA ``xa``."""
        view, w = self.view, self.norm_weights
        bsz, seq, _ = x.shape
        rows = bsz * seq
        glue = ops.residual_norm is engine_glue.residual_rms_norm and ops.norm is engine_glue.rms_norm

        def relabels(i: int, group: str) -> bool:
            return glue and self.takes_relabeled(i, group, rows)

        def norm_into(i: int, group: str | None, x, delta, weight, eps):
            """(x + delta or x, its norm, the relabeled copy or None, the group's xa or None), for the group of
            layer ``i`` that reads the norm (None: the final norm)."""
            plan = self.norm_shrink_plan(i, group, rows) if glue and group is not None else None
            if plan is not None:  # the norm makes the group's xa; its GEMM adds the expand
                summed, h, xa = engine_glue.norm_shrink(x, delta, weight, eps, plan.a_cat)
                return summed, h, None, xa
            copy = group is not None and relabels(i, group)
            if delta is None:
                return (x, *ops.norm(x, weight, eps, relabeled=True), None) if copy else \
                    (x, ops.norm(x, weight, eps), None, None)
            if copy:
                return (*ops.residual_norm(x, delta, weight, eps, relabeled=True), None)
            return (*ops.residual_norm(x, delta, weight, eps), None, None)

        _, h, hr, xa = norm_into(0, "qkv", x, None, w[0], view.eps[0][0])
        # lora_fold: the gate/up group's expand runs inside the SiLU x up kernel (glue.silu_mul's lora=)
        silu_glue = ops.gated is engine_glue.silu_mul
        fold = self.folds_gate_up(rows) and silu_glue
        for i in range(view.n_layers):
            (q, k, v), _ = self._project_parts(i, "qkv", h, x_relabeled=hr, given_xa=xa)
            q = q.view(bsz, seq, -1, view.head_dim).transpose(1, 2)
            k = k.view(bsz, seq, -1, view.head_dim).transpose(1, 2)
            v = v.view(bsz, seq, -1, view.head_dim).transpose(1, 2)
            q, k = ops.rope(q, k, cos, sin)
            attn_r = None
            if attend_relabels and relabels(i, "o"):
                attn, attn_r = attend(i, q, k, v, ops, relabeled=True)
            else:
                attn = attend(i, q, k, v, ops)
            attn = attn.transpose(1, 2).reshape(bsz, seq, -1)
            (o,) = self._project(i, "o", attn, attn_r)
            x, h, hr, xa = norm_into(i, "gate_up", x, o, w[2 * i + 1], view.eps[i][1])
            defer = fold and self._fused[i]["gate_up"] is not None
            (gate, up), shrunk = self._project_parts(i, "gate_up", h, defer=defer, x_relabeled=hr, given_xa=xa)
            act_r = None
            if (shrunk is not None or silu_glue) and relabels(i, "down"):
                act_in, act_r = engine_glue.silu_mul(self._act, gate, up, lora=shrunk, relabeled=True)
            elif shrunk is not None:
                act_in = engine_glue.silu_mul(self._act, gate, up, lora=shrunk)
            else:
                act_in = ops.gated(self._act, gate, up)
            (down,) = self._project(i, "down", act_in, act_r)
            last = i == view.n_layers - 1
            weight, eps = (w[-1], view.final_eps) if last else (w[2 * i + 2], view.eps[i + 1][0])
            x, h, hr, xa = norm_into(i + 1, None if last else "qkv", x, down, weight, eps)
        return h

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache,
                rows: torch.Tensor | None = None, start: int = 0) -> torch.Tensor:
        """Run left-padded prompts ``tokens [B, P]`` through the model, writing K/V into cache columns
        ``[start, start + P)`` of cache rows ``rows`` (int64 ``[B]``; None: rows ``0 .. B-1``); return
        float32 logits of the last column ``[B, V]``. ``mask [B, 1, P, P]`` (bool, True = may attend) or
        None for unpadded prompts (plain causal attention). The prompts attend only to each other's
        columns, never to what the cache held before."""
        bsz, plen = tokens.shape
        x = self.view.embed(tokens)
        cos, sin = self.view.rotary(x, positions)

        def attend(i, q, k, v, ops):
            if rows is None:
                cache.k[i, :bsz, :, start:start + plen].copy_(k)
                cache.v[i, :bsz, :, start:start + plen].copy_(v)
            else:
                cache.k[i, :, :, start:start + plen].index_copy_(0, rows, k)
                cache.v[i, :, :, start:start + plen].index_copy_(0, rows, v)
            return sdpa_attention(q, k, v, mask, self.view.scaling, causal=True)

        h = self._decoder(x, cos, sin, attend, self.prefill_ops)
        return self.view.lm_head(h[:, -1:])[:, -1].float()

    def decode_step(self, tokens: torch.Tensor, column: torch.Tensor, pad: torch.Tensor, kv_len: int,
                    cache, masked: bool = True) -> torch.Tensor:
        """One token per row: ``tokens [b]`` written at cache ``column`` (a 1-element tensor, the
        same for every row in the left-padded layout); row ``r`` sits at RoPE position
        ``column - pad[r]`` and attends to cache columns ``pad[r] .. column`` among the first
        ``kv_len``. Returns float32 logits ``[b, V]``. Pure tensor work, so it can be captured."""
        bsz = tokens.shape[0]
        x = self.view.embed(tokens[:, None])
        if self._rope_table is not None and self._rope_table[0].shape[0] >= kv_len:  # positions < kv_len
            positions = column - pad
            cos = self._rope_table[0].index_select(0, positions)[:, None]
            sin = self._rope_table[1].index_select(0, positions)[:, None]
        else:
            cos, sin = self.view.rotary(x, (column - pad)[:, None])
        mask = None
        if masked and self.decode_attention != "kernel":  # the kernel masks by pad and column itself
            if self._columns.numel() < kv_len:
                self.reserve_columns(cache.length)  # eager paths; graph paths reserved before capturing
            idx = self._columns[:kv_len][None, :]
            mask = ((idx >= pad[:, None]) & (idx <= column))[:, None, None, :]

        def attend(i, q, k, v, ops, relabeled=False):
            k_all, v_all = cache.k[i, :bsz], cache.v[i, :bsz]
            if self.decode_attention == "kernel":  # q, k arrive un-rotated (see below): one kernel does
                # RoPE, the cache write and the attention (attention.rope_cache_attention)
                out_r = torch.empty(bsz, q.shape[1] * q.shape[-1], dtype=q.dtype, device=q.device) if relabeled else None
                out = rope_cache_attention(q, k, v, cos, sin, k_all[:, :, :kv_len], v_all[:, :, :kv_len], pad,
                                           column, self.view.scaling, launch=self.attention_launch,
                                           out_relabeled=out_r)[:, :, None]
                return (out, out_r) if relabeled else out
            k_all.index_copy_(2, column, k)
            v_all.index_copy_(2, column, v)
            k_all, v_all = k_all[:, :, :kv_len], v_all[:, :, :kv_len]
            if self.decode_attention == "matmul":
                return matmul_decode_attention(q, k_all, v_all, mask, self.view.scaling, ops.attention_probs)
            return sdpa_attention(q, k_all, v_all, mask, self.view.scaling, causal=False)

        ops = self.decode_ops
        if self.decode_attention == "kernel":  # RoPE happens in the attention kernel, fused with the cache write
            ops = ops._replace(rope=_rope_in_attention)
        h = self._decoder(x, cos, sin, attend, ops, attend_relabels=self.decode_attention == "kernel")
        return self.view.lm_head(h)[:, -1].float()
