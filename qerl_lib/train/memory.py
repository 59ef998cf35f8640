"""The rollout phase's memory, from the architecture alone: base weights + the engine's KV cache (+ merged copy).

A GRPO step has two phases that do not overlap in memory when ``release_engine_cache`` is on (the
default): the rollout (base weights, the engine's KV cache, CUDA-graph pools) and the training step
(base weights, LoRA, gradients, optimizer state, activations; `train.metrics.memory_accounting`
counts the fixed part of it every step). The rollout phase is the one a preset can size in advance,
exactly: the engine allocates its cache up front for ``rows x (prompt + completion)`` columns, rounded
up to its buckets, whatever length the completions end at. At Qwen2.5-32B each cached token costs
256 KiB (64 layers x K and V x 8 heads x 128 x bf16), so 64 rows of 256 + 4096 tokens hold 68 GiB,
which with the 4-bit weights no longer fits an 80 GB GPU: the presets' ``rollout_batch`` (the rows
the engine runs at once; when a step has more completions, they queue for the rows by continuous
batching, whose cache holds ``engine.continuous.headroom_columns()`` columns more) is sized here.

Counted exactly (tests compare with a built model's tensors and with the engine's cache):

* weights: bf16 ``2`` bytes per weight; NVFP4 ``0.5 + 1/16`` (packed codes + one FP8 scale per 16)
  plus 4 bytes of global scale per Linear; biases, norms and the embedding (and an untied
  ``lm_head``) in bf16. NF4 (bitsandbytes, double quantization) is counted as ``0.5 + 1/64`` bytes per
  weight, within a percent of bitsandbytes' own layout (its second-level statistics are left out).
* KV cache: ``layers x 2 x rows x kv_heads x columns x head_dim x 2`` bytes, rows and columns rounded
  up as the engine's CUDA-graph path does (`engine.cache.batch_bucket`, `length_bucket`).
* the merged copy (``lora_merge``, a bf16 base only; `engine.merged`): every decoder Linear's weight and bias
  once more in bf16, with adapters on all seven projections (the presets' targets). At 7B that is 12.2 GiB and
  the GSM8K preset keeps its 128 rows; at 14B (24.6 GiB) its rows fall from 32 to 8; at 32B nothing fits.

Not counted: CUDA-graph memory pools and the logits of a step (a few hundred MB at these sizes), and
everything of the training phase beyond the weights.
"""

from __future__ import annotations

from qerl_lib.engine.cache import BATCH_BUCKETS, batch_bucket, length_bucket
from qerl_lib.engine.continuous import headroom_columns
from qerl_lib.models.fused import layer_projection_shapes

# mxfp4 bases are fake-quantized (MXFP4's values held in bf16, `quant.formats.fake_quantize_`): bf16 bytes
BYTES_PER_WEIGHT = {"bf16": 2.0, "nvfp4": 0.5 + 1 / 16, "nf4": 0.5 + 1 / 64, "mxfp4": 2.0}
ROLLOUT_BUDGET_BYTES = 0.85 * 80e9  # an 80 GB GPU, with room for graph pools, logits and fragmentation


def _kv_shape(arch: dict) -> tuple[int, int, int]:
    """(layers, KV heads, head dim) of an architecture."""
    heads = arch["num_attention_heads"]
    head_dim = arch.get("head_dim") or arch["hidden_size"] // heads
    return arch["num_hidden_layers"], arch.get("num_key_value_heads") or heads, head_dim


def _layer_linear_elements(arch: dict) -> tuple[int, int, int]:
    """(Linears, weight elements, bias elements) of one decoder layer: the seven projections, and q/k/v's biases
    where the architecture has them (Qwen2, or ``attention_bias``)."""
    shapes = layer_projection_shapes(arch)
    biased = arch.get("model_type") == "qwen2" or arch.get("attention_bias")
    biases = sum(shapes[name][0] for name in ("q_proj", "k_proj", "v_proj")) if biased else 0
    return len(shapes), sum(n * k for n, k in shapes.values()), biases


def base_weight_bytes(arch: dict, base: str) -> int:
    """Bytes of a model of architecture ``arch`` (a transformers config as a dict) with its decoder Linears
    in ``base`` format (bf16, nvfp4, nf4, mxfp4) and everything else in bf16."""
    if base not in BYTES_PER_WEIGHT:
        raise ValueError(f"unknown base {base!r}: choose one of {', '.join(BYTES_PER_WEIGHT)}")
    hidden, layers, vocab = arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"]
    linears, weights, biases = _layer_linear_elements(arch)
    per_layer = weights * BYTES_PER_WEIGHT[base] + (4 * linears if base == "nvfp4" else 0)
    norms = 2 * hidden * 2
    embeddings = vocab * hidden * 2 * (1 if arch.get("tie_word_embeddings", False) else 2)
    return int(round(layers * (per_layer + biases * 2 + norms) + hidden * 2 + embeddings))


def merged_copy_bytes(arch: dict, dtype_bytes: int = 2) -> int:
    """Bytes of the engine's merged weight copies (``RolloutEngine(lora_merge=True)``) with adapters on all seven
    projections of every layer: each decoder Linear's weight and bias once more, in the base's dtype."""
    _, weights, biases = _layer_linear_elements(arch)
    return arch["num_hidden_layers"] * (weights + biases) * dtype_bytes


def kv_cache_bytes(arch: dict, rows: int, columns: int, length_step: int = 256,
                   buckets: tuple[int, ...] = BATCH_BUCKETS, dtype_bytes: int = 2) -> int:
    """The engine's KV cache for ``rows`` sequences of ``columns`` cached tokens (prompt + completion - 1),
    rounded up to its batch and length buckets as on CUDA."""
    layers, kv_heads, head_dim = _kv_shape(arch)
    rows = batch_bucket(rows, buckets)
    columns = length_bucket(columns, length_step, max(columns, arch.get("max_position_embeddings", columns)))
    return layers * 2 * rows * kv_heads * columns * head_dim * dtype_bytes


def rollout_phase_bytes(arch: dict, base: str, rows: int, prompt_tokens: int, completion_tokens: int,
                        continuous: bool = False, lora_merge: bool = False) -> dict:
    """``{"weights": ..., "kv_cache": ..., "merged_copy": ..., "total": ...}`` in bytes for a rollout of ``rows``
    at once; ``continuous``: more prompts than rows, so the cache has the continuous-batching headroom too;
    ``lora_merge``: the adapters run merged into a copy of the bf16 base (`merged_copy_bytes`)."""
    if lora_merge and base != "bf16":
        raise ValueError(f"lora_merge needs a bf16 base, not {base!r}: a quantized base's adapters run unmerged")
    weights = base_weight_bytes(arch, base)
    extra = headroom_columns() if continuous else 0
    cache = kv_cache_bytes(arch, rows, prompt_tokens + completion_tokens - 1 + extra)
    copy = merged_copy_bytes(arch) if lora_merge else 0
    return {"weights": weights, "kv_cache": cache, "merged_copy": copy, "total": weights + cache + copy}


def rollout_rows_that_fit(arch: dict, base: str, prompt_tokens: int, completion_tokens: int,
                          budget_bytes: float = ROLLOUT_BUDGET_BYTES, most: int = 128, continuous: bool = False,
                          lora_merge: bool = False) -> int:
    """The largest power of two <= ``most`` rows whose rollout phase fits ``budget_bytes`` (0 if none does)."""
    rows = most
    while rows >= 1:
        plan = rollout_phase_bytes(arch, base, rows, prompt_tokens, completion_tokens, continuous, lora_merge)
        if plan["total"] <= budget_bytes:
            return rows
        rows //= 2
    return 0
