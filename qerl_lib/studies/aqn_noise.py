"""What notebooks/04 measures about AQN: the norm/projection equivalence on a real layer, and entropy vs σ.

Two questions, each answered on the embedded model:

1. **Is noise on the RMSNorm weight really noise on the projections?** `equivalence_on_layer` takes
   the real input of one decoder layer's ``input_layernorm`` and computes q/k/v two ways:
   (a) the norm with weight ``w + Z``, written out by hand, followed by the unchanged projections, and
   (b) the clean norm followed by projections whose input columns are scaled by ``1 + Z/w``
   (`qerl_lib.train.aqn.merged_projection_weight`). Algebraically (a) == (b). In float32 they differ
   by rounding only. The report sets that gap against the size of the noise's own effect (a minus the
   clean output), so "small" has a scale. The float64 rerun shows the gap shrinks with the precision,
   which is what rounding does and an algebra error would not. A separate check runs the norm module's
   own forward with the override applied through `qerl_lib.train.aqn.apply_norm_overrides` (the path
   training uses) and compares it with the by-hand norm of (a).

2. **How much next-token entropy does each σ add on top of NVFP4?** `entropy_vs_sigma` scores fixed
   completions (teacher-forced, the same tokens at every σ) under AQN noise on the
   ``input_layernorm`` and ``post_attention_layernorm`` weights, and compares each σ with σ = 0
   per problem (`qerl_lib.evals.entropy.paired_bootstrap`). One noise draw per σ, and the same standard
   normal direction at every σ (only the scale changes), so the curve is smooth in σ and the
   differences between σ are due to σ, not to a new draw. One draw means the interval covers the
   problems, not the noise: a second seed can move the numbers by about the draw-to-draw spread.

Noise is built in float32 (``dtype=torch.float32``) on a float32 model: in bf16 most of a small σ
would be rounded away (`qerl_lib.train.aqn`, "bf16 rounding"). The report also gives the share of
channels that *would* change if the override were cast to bf16, which is what a bf16 runtime sees.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F

from qerl_lib.train.aqn import (DEFAULT_NORMS, apply_norm_overrides, find_norms, merged_projection_weight,
                                realized_noise_stats, sample_norm_overrides)
from qerl_lib.evals.entropy import NO_TOKENS, mean_token_entropy, paired_bootstrap, per_sequence_mean, token_entropies

PROJECTIONS = ("q_proj", "k_proj", "v_proj")  # what input_layernorm feeds in a Llama/Qwen2 layer


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder layers of a Llama/Qwen2-style causal LM (``model.model.layers``)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: pass a Llama/Qwen2-style causal LM")
    return layers


@torch.no_grad()
def capture_norm_input(model, input_ids: torch.Tensor, layer_index: int) -> torch.Tensor:
    """The hidden states that enter ``layers[layer_index].input_layernorm`` for `input_ids` ([batch, seq])."""
    layers = decoder_layers(model)
    if not 0 <= layer_index < len(layers):
        raise ValueError(f"layer_index={layer_index}: need 0 <= layer_index < {len(layers)} (the model's layers)")
    captured = []
    handle = layers[layer_index].input_layernorm.register_forward_pre_hook(
        lambda module, args: captured.append(args[0].detach().clone()))
    try:
        model(input_ids=input_ids)
    finally:
        handle.remove()
    return captured[0]


def _projections(layer, normed: torch.Tensor, weights: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for name in PROJECTIONS:
        proj = getattr(layer.self_attn, name)
        bias = None if proj.bias is None else proj.bias.detach().to(dtype)
        out[name] = F.linear(normed.to(dtype), weights[name].to(dtype), bias)
    return out


@torch.no_grad()
def equivalence_on_layer(model, hidden: torch.Tensor, layer_index: int, sigma: float, seed: int = 0) -> dict:
    """Compare noised-norm→projections with clean-norm→merged projections on one layer (see module docstring).

    Needs a dense model (projection weights readable as ``.weight``). Returns, per projection and in
    float32 and float64: ``max_abs_diff`` (a vs b), ``max_abs_noise_effect`` (a vs clean) and their ratio
    (null, with ``diff_over_effect_note``, when the noise had no effect); and
    ``module_vs_by_hand_max_abs_diff``: the norm module's forward under `apply_norm_overrides` against
    ``(w + Z) ⊙ x̂`` computed by hand in float32.
    """
    if not sigma > 0:
        raise ValueError(f"sigma={sigma!r}: need sigma > 0, otherwise there is no noise to compare")
    layer = decoder_layers(model)[layer_index]
    norm = layer.input_layernorm
    weights = {}
    for name in PROJECTIONS:
        w = getattr(getattr(layer.self_attn, name), "weight", None)
        if not isinstance(w, torch.Tensor) or w.dim() != 2:
            raise ValueError(f"layer {layer_index} {name} has no dense weight: run the check on the bf16 model")
        weights[name] = w.detach()
    generator = torch.Generator().manual_seed(seed)
    name = f"model.layers.{layer_index}.input_layernorm"
    noise = sample_norm_overrides(model, sigma, generator, norms=("input_layernorm",), dtype=torch.float32)[name]
    z = noise - norm.weight.detach().float()
    eps = norm.variance_epsilon
    report = {"sigma": sigma, "layer_index": layer_index, "tokens": int(hidden.shape[0] * hidden.shape[1]),
              "norm_weight_abs_min": float(norm.weight.abs().min()), "precisions": {}}
    for label, dtype in (("float32", torch.float32), ("float64", torch.float64)):
        x = hidden.to(dtype)
        x_hat = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        w = norm.weight.detach().to(dtype)
        if dtype == torch.float32:  # the library's function (it works in float32)
            merged = {n: merged_projection_weight(norm.weight.detach(), z, p) for n, p in weights.items()}
        else:  # the same formula in float64, so no float32 rounding of the merged weight hides in the gap
            merged = {n: p.to(dtype) * (1.0 + z.to(dtype) / w)[None, :] for n, p in weights.items()}
        clean = _projections(layer, w * x_hat, weights, dtype)
        noised = _projections(layer, (w + z.to(dtype)) * x_hat, weights, dtype)
        via_merge = _projections(layer, w * x_hat, merged, dtype)
        rows = {}
        for n in PROJECTIONS:
            diff = float((noised[n] - via_merge[n]).abs().max())
            effect = float((noised[n] - clean[n]).abs().max())
            rows[n] = {"max_abs_diff": diff, "max_abs_noise_effect": effect,
                       "diff_over_effect": diff / effect if effect else None}
            if not effect:  # JSON has no NaN: null, and why
                rows[n]["diff_over_effect_note"] = "the noise did not change this projection's output"
        report["precisions"][label] = rows
    # the mechanism itself: the module's own forward with the override applied equals the by-hand (w + Z) ⊙ x̂
    with apply_norm_overrides(model, {name: noise.to(norm.weight.dtype)}):
        module_out = norm(hidden)
    by_hand = (norm.weight.detach().float() + z) * (hidden.float() * torch.rsqrt(
        hidden.float().pow(2).mean(-1, keepdim=True) + eps))
    report["module_vs_by_hand_max_abs_diff"] = float((module_out.float() - by_hand).abs().max())
    return report


@torch.no_grad()
def dequantize_nvfp4_linears_(model, dtype: torch.dtype = torch.float32):
    """Replace every `NVFP4Linear` with an `nn.Linear` holding its dequantized weight, in place; returns `model`.

    The values are exactly NVFP4's (dequantization is bit-exact with compressed-tensors), so the
    logits match the packed model's reference path. On a CPU the packed layer dequantizes on every
    forward, which makes a teacher-forced pass several times slower; dequantizing once removes that
    and costs a dense copy of the weights (0.5 GB for SmolLM2-135M in float32).
    """
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    names = [n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)]
    for name in names:
        layer = model.get_submodule(name)
        weight = layer.dequantize(dtype)
        dense = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                                device=weight.device, dtype=dtype)
        dense.weight.copy_(weight)
        if layer.bias is not None:
            dense.bias.copy_(layer.bias.to(dtype))
        dense.requires_grad_(False)
        model.set_submodule(name, dense)
    return model


def _summary(entropies: list[torch.Tensor]) -> dict:
    """Token-mean entropy (null with ``entropy_note`` when there are no tokens) and per-problem means."""
    mean = mean_token_entropy(entropies)
    if math.isnan(mean):
        return {"entropy": None, "entropy_note": NO_TOKENS, "per_problem": per_sequence_mean(entropies)}
    return {"entropy": mean, "per_problem": per_sequence_mean(entropies)}


@torch.no_grad()
def entropy_vs_sigma(model, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                     sigmas: Sequence[float], seed: int = 0, norms: tuple[str, ...] = DEFAULT_NORMS,
                     batch_size: int = 16, n_boot: int = 2000) -> list[dict]:
    """Teacher-forced entropy of `completions` under AQN noise of each σ, paired against σ = 0.

    σ = 0 is added in front when `sigmas` lacks it. Each point: sigma, entropy (token mean, nats; null with
    ``entropy_note`` if no completion has tokens), per_problem (null for an empty completion), diff_vs_sigma0
    (paired bootstrap, per-problem, 95%) and its `verdict`, realized_rms and fraction_changed of the float32
    noise, and fraction_changed_if_bf16 (the share of norm channels a bf16 cast would leave changed).
    """
    sigmas = [float(s) for s in sigmas]
    if any(not math.isfinite(s) or s < 0 for s in sigmas):
        raise ValueError(f"sigmas={sigmas}: each σ must be a finite number >= 0")
    if 0.0 not in sigmas:
        sigmas = [0.0] + sigmas  # the baseline every σ is paired against
    base = _summary(token_entropies(model, prompts, completions, batch_size=batch_size))
    points = []
    for sigma in sigmas:
        if sigma == 0.0:
            point = {"sigma": 0.0, **base, "realized_rms": 0.0, "fraction_changed": 0.0,
                     "fraction_changed_if_bf16": 0.0}
        else:
            generator = torch.Generator().manual_seed(seed)  # same direction at every σ, only the scale changes
            overrides = sample_norm_overrides(model, sigma, generator, norms, dtype=torch.float32)
            as_bf16 = {k: v.to(torch.bfloat16) for k, v in overrides.items()}
            stats = {**realized_noise_stats(model, overrides),  # measured against the base, so before applying
                     "fraction_changed_if_bf16": realized_noise_stats(model, as_bf16)["fraction_changed"]}
            with apply_norm_overrides(model, overrides):
                entropies = token_entropies(model, prompts, completions, batch_size=batch_size)
            point = {"sigma": sigma, **_summary(entropies), **stats}
        point["diff_vs_sigma0"] = paired_bootstrap(base["per_problem"], point["per_problem"], n_boot=n_boot,
                                                   seed=seed)
        point["verdict"] = verdict(point["diff_vs_sigma0"])
        points.append(point)
    return points


def median_norm_weight(model, norms: tuple[str, ...] = DEFAULT_NORMS) -> float:
    """The median |w| over every channel of the norms AQN perturbs: noise Z on w is the relative jitter Z/w on the
    projection inputs that read the norm, so σ / median |w| is that jitter's size on a typical channel."""
    weights = torch.cat([m.weight.detach().float().abs().flatten().cpu() for m in find_norms(model, norms).values()])
    return float(weights.quantile(0.5))  # torch's median() would take the lower of two middle values


def verdict(diff: dict) -> str:
    """Read a paired interval: 'raises' / 'lowers' when it excludes 0, 'no data' without pairs, else 'no
    detectable change'."""
    if diff.get("n", 0) == 0 or diff.get("low") is None:
        return "no data"
    if diff["low"] > 0:
        return "raises"
    if diff["high"] < 0:
        return "lowers"
    return "no detectable change"
