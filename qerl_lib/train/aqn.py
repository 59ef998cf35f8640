"""Adaptive Quantization Noise (AQN): a staged Gaussian perturbation of the RMSNorm weights.

How it works
------------
QeRL argues that the error NVFP4 adds to the frozen weights (Ŵ - W) raises the policy's entropy
and so helps exploration, and that this noise should be *scheduled*: larger early, smaller late.
The quantization error itself is fixed, so AQN adds a schedulable Gaussian term on top of it.
Adding noise to every weight matrix would cost a copy of the weights. The paper puts it into the
RMSNorm weight that sits in front of the matrices instead, which costs nothing:

    RMSNorm(x)        = w ⊙ x̂,          x̂ = x / sqrt(mean(x²) + eps)
    RMSNorm_noise(x)  = (w + Z) ⊙ x̂,    Z ~ N(0, σ² I), one value per channel (length = hidden)

and since (w + Z) ⊙ x̂ = (1 + Z/w) ⊙ (w ⊙ x̂), the projection that follows sees

    W @ ((w + Z) ⊙ x̂)  =  (W · diag(1 + Z/w)) @ RMSNorm(x)          (W is nn.Linear's [out, in])

so additive noise on the norm weight is *multiplicative* noise (1 + Z_i/w_i) on input column i
of every projection that reads that norm (the paper's "row-wise", in its X·W notation).
`merged_projection_weight` builds that right-hand side, and tests/test_aqn.py checks the identity
on the embedded model's layers. Two consequences the paper states only in passing:

* It is relative noise: a channel with a small |w_i| gets a large relative perturbation. The
  paper picks σ_start = 1e-2 rather than the usual 1e-1 for this reason. Where w_i = 0 the
  multiplicative view is undefined, but the additive form is not.
* Its effect on the weights is not additive. The paper's Eq. 7 writes the combined noise as
  Z + (Ŵ - W). Merged into the norm, the quantized layer actually computes with
  Ŵ·diag(1 + Z/w), so its total error is (Ŵ - W) + Ŵ·diag(Z/w).
* It reaches only the matrices fed by a norm. `input_layernorm` feeds q/k/v, and
  `post_attention_layernorm` feeds gate/up. o_proj and down_proj read attention and MLP
  internals, so no norm noise can reach them. The text and Fig. 6 agree. App. G says "down
  and up" share the noise, which contradicts the algebra.

Schedule (σ per stage)
----------------------
Training steps 0..M-1 are split into K equal stages: stage(step) = min(step·K // M, K-1). When
K does not divide M, stages differ in length by at most one step. The paper uses ⌊M/K⌋ steps
per stage, which leaves a short extra stage at the end. With M = 1000 and K = 10, steps
0-99 are stage 0. Stage 0 adds no noise, so only the quantization error acts there. Stage 1
uses σ_start, stage K-1 uses σ_end exactly, and stages in between use f = (k-1)/(K-2):

    exponential  σ = σ_start · (σ_end/σ_start)^f               (the paper's choice)
    linear       σ = σ_start + (σ_end - σ_start) · f
    cosine       σ = σ_end + (σ_start - σ_end) · (1 + cos(π f)) / 2
    logarithmic  σ = σ_start + (σ_end - σ_start) · log10(1 + 9 f)

The paper's Eq. 8 uses the exponent (k-1)/(K-1), which never reaches σ_end: with K = 10, stage 9
stops at σ_start·r^(8/9). The official code uses j/(K-2), and our exponential schedule matches it
on stages 1..K-1. K = 2 leaves one noisy stage that would have to be both σ_start and σ_end; the
official formula divides 0 by 0 there. We accept K = 2 only with σ_start == σ_end, which gives
constant noise. For the ablation the paper shows linear, cosine and logarithmic decay only as
curves (Fig. 9/15) and gives no formula. Our "logarithmic" is our own definition: it is linear
in log10 of a counter that runs from 1 to 10, so it falls fast early, like exponential, but in
linear space.

When noise is drawn, and where it goes
--------------------------------------
* Each `AQNController.overrides_for_step` call (training makes one per optimizer step that rolls out)
  draws a fresh vector for each
  targeted norm. Every completion is then sampled from one well-defined perturbed policy
  π_{θ+Z}. Resampling on every forward pass (the paper's §3.3 wording) would switch policy in
  the middle of a sequence, and the cached keys and values would come from other draws. Once
  per rollout is Algorithm 1's once per step whenever a step makes one rollout.
* Noise is computed in float32 from the stored base weight: override = cast(w + Z). It is never
  added in place, so it cannot accumulate. `apply_norm_overrides` copies the overrides into the
  parameters' own storage and writes the saved bits back on exit, exception or not. The same
  dict is what the rollout engine's `generate(..., norm_overrides=...)` takes.
* The default target "rollout" perturbs the sampling model only, as the paper and the official
  code do, so the trainer's log-probs come from the clean policy. The ablation target "both"
  also applies the noise in the trainer's forward, reusing the same Z as the rollout that made
  the samples (`trainer_overrides`). The trainer then scores exactly the policy that sampled.
* Norms are found by attribute name (`...layers.3.input_layernorm`), never by class, so any
  Llama/Qwen2-style model works, whatever RMSNorm class its runtime uses. The final
  `model.norm`, which feeds lm_head, is untouched unless "norm" is listed.
* AQN never checks that the model is quantized. "bf16 + AQN" (noise without quantization, a
  user request on the official repo) is an ordinary configuration.
* bf16 rounding: cast(w + Z) lands on the bf16 grid. The grid spacing is 2^-7 ≈ 7.8e-3 for
  |w| in [1, 2), so σ = 5e-4 leaves such channels unchanged. On the embedded SmolLM2 (layer
  norm weights with median |w| ≈ 0.25-0.31), σ = 5e-4 changes about 16-24% of the elements and
  σ = 1e-2 about 93%. In the final norm, 575 of 576 entries have |w| ≥ 1, so σ = 5e-4 can change
  at most the remaining one (|w| = 0.87).
  `AQNController.last_stats` reports the realized noise for each draw, and the test
  `test_embedded_bf16_rounding_matches_docstring` checks these figures.

How the official release differs (from reading its code; we did not run it)
---------------------------------------------------------------------------
1. The noise goes only into vLLM's model, once per optimizer step, through
   `weight.add_(noise)` in place.
2. Modules are selected by `isinstance(m, (Qwen2RMSNorm, LlamaRMSNorm))`, which are the
   transformers classes. vLLM's models use vLLM's own RMSNorm, so most likely no noise is
   ever added.
3. If that check were fixed, the layer norms would be reset every step, because the scripts
   train them (`--ln`: modules_to_save, which the paper never mentions). The final norm is not
   reloaded, so its noise would build up as a random walk across steps. We never accumulate,
   and we leave the final norm alone. Our norms stay frozen, as in the paper (LoRA only). If
   a user trains them anyway, each draw reads the live weight as its base.
4. The scripts use σ 1e-2 → 1e-4, the config defaults use 5e-2 → 5e-4, and Table 4 uses
   1e-2 → 5e-4. Our defaults follow Table 4.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import asdict, dataclass, field
from typing import Iterator, Mapping

import numpy as np
import torch
from torch import nn

SCHEDULES = ("exponential", "linear", "cosine", "logarithmic", "constant")  # constant: σ_start throughout
TARGETS = ("rollout", "both")
# attribute name -> what it feeds. Matching is by name, so any runtime's RMSNorm class is found.
KNOWN_NORM_NAMES = {
    "input_layernorm": "feeds q/k/v",
    "post_attention_layernorm": "feeds gate/up",
    "norm": "the final model norm, feeds lm_head (the paper does not perturb it)",
}
DEFAULT_NORMS = ("input_layernorm", "post_attention_layernorm")
_ACTIVE_ATTR = "_qerl_aqn_active"  # set on a norm module while an override is applied to it


@dataclass(frozen=True, kw_only=True)
class AQNConfig:
    """Adaptive Quantization Noise settings. Defaults follow the paper's Table 4 (1e-2 → 5e-4, 10 stages)."""

    total_steps: int  # optimizer steps of the whole run; stages split these equally
    sigma_start: float = 1e-2  # σ of stage 1 (the first noisy stage)
    sigma_end: float = 5e-4  # σ of the last stage, reached exactly
    num_stages: int = 10  # K; stage 0 is noise-free
    schedule: str = "exponential"  # one of SCHEDULES
    seed: int = 0  # noise of (seed, step, rollout-in-step) is reproducible, on any device
    target: str = "rollout"  # "rollout": sampling model only (paper); "both": also the trainer's forward
    norms: tuple[str, ...] = DEFAULT_NORMS  # attribute names, see KNOWN_NORM_NAMES
    enabled: bool = True  # False: σ = 0 at every step (see `off`)

    @classmethod
    def off(cls, total_steps: int = 10) -> "AQNConfig":
        """AQN disabled: σ = 0 throughout, no overrides are ever produced."""
        return cls(total_steps=total_steps, enabled=False)

    def __post_init__(self):
        object.__setattr__(self, "norms", tuple(self.norms))  # accept lists; stay hashable
        for name in ("total_steps", "num_stages", "seed"):  # accept numpy integers, store plain ints
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, bool):
                object.__setattr__(self, name, int(value))
        if self.schedule not in SCHEDULES:
            raise ValueError(f"unknown AQN schedule {self.schedule!r}: schedule must be one of {SCHEDULES}")
        if self.target not in TARGETS:
            raise ValueError(f"unknown AQN target {self.target!r}: target must be one of {TARGETS}")
        if not self.norms or len(set(self.norms)) != len(self.norms):
            raise ValueError(f"norms={self.norms!r}: list each norm name once and at least one "
                             "(use AQNConfig.off() to disable AQN)")
        unknown = [n for n in self.norms if n not in KNOWN_NORM_NAMES]
        if unknown:
            raise ValueError(f"unknown norm name(s) {unknown}: norms must be among {tuple(KNOWN_NORM_NAMES)}")
        if isinstance(self.num_stages, bool) or not isinstance(self.num_stages, int) or self.num_stages < 2:
            raise ValueError(f"num_stages={self.num_stages!r}: need an integer >= 2 (stage 0 is noise-free, "
                             "stages 1..K-1 carry noise)")
        if isinstance(self.total_steps, bool) or not isinstance(self.total_steps, int) \
                or self.total_steps < self.num_stages:
            raise ValueError(f"total_steps={self.total_steps!r}: need an integer >= num_stages "
                             f"({self.num_stages}) so that every stage has at least one step")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r}: need a non-negative integer")
        for name in ("sigma_start", "sigma_end"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}={value!r}: σ must be a finite number >= 0")
        if self.sigma_start <= 0:
            raise ValueError(f"sigma_start={self.sigma_start!r}: need sigma_start > 0 "
                             "(use AQNConfig.off() to disable AQN)")
        if self.sigma_end > self.sigma_start:
            raise ValueError(f"sigma_end={self.sigma_end} > sigma_start={self.sigma_start}: the noise must decay, "
                             "need sigma_end <= sigma_start")
        if self.schedule == "exponential" and self.sigma_end == 0:
            raise ValueError("sigma_end=0 with schedule='exponential': a geometric decay never reaches 0, need "
                             "sigma_end > 0 (or use schedule='linear'/'cosine'/'logarithmic' to decay to 0)")
        if self.num_stages == 2 and self.sigma_end != self.sigma_start and self.schedule != "constant":
            raise ValueError(f"num_stages=2 leaves one noisy stage, which cannot be both sigma_start "
                             f"({self.sigma_start}) and sigma_end ({self.sigma_end}): set sigma_end == "
                             "sigma_start for constant noise, or use num_stages >= 3")


def _interpolate(schedule: str, start: float, end: float, f: float) -> float:
    """σ at fraction f ∈ [0, 1] of the noisy stages (f=0: stage 1, f=1: the last stage)."""
    if schedule == "constant":
        return start
    if f <= 0.0:
        return start  # exact endpoints, whatever the float arithmetic below would give
    if f >= 1.0:
        return end
    if schedule == "exponential":
        return start * (end / start) ** f
    if schedule == "linear":
        return start + (end - start) * f
    if schedule == "cosine":
        return end + (start - end) * 0.5 * (1.0 + math.cos(math.pi * f))
    if schedule == "logarithmic":
        return start + (end - start) * math.log10(1.0 + 9.0 * f)
    raise ValueError(f"unknown AQN schedule {schedule!r}: schedule must be one of {SCHEDULES}")


class AQNSchedule:
    """σ as a pure function of the optimizer step (counted from 0). Holds no random state."""

    def __init__(self, config: AQNConfig):
        self.config = config

    def stage(self, step: int) -> int:
        """Stage index of `step`; steps at or past total_steps stay in the last stage."""
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ValueError(f"step={step!r}: steps are integers counted from 0")
        c = self.config
        return min(int(step) * c.num_stages // c.total_steps, c.num_stages - 1)

    def stage_first_step(self, stage: int) -> int:
        """The first step of `stage`: ceil(stage·M/K), the inverse of `stage`."""
        if not 0 <= stage < self.config.num_stages:
            raise ValueError(f"stage={stage}: need 0 <= stage < num_stages ({self.config.num_stages})")
        return -(-stage * self.config.total_steps // self.config.num_stages)

    def stage_sigma(self, stage: int) -> float:
        c = self.config
        if not 0 <= stage < c.num_stages:
            raise ValueError(f"stage={stage}: need 0 <= stage < num_stages ({c.num_stages})")
        if stage == 0 or not c.enabled:
            return 0.0
        f = 0.0 if c.num_stages == 2 else (stage - 1) / (c.num_stages - 2)
        return _interpolate(c.schedule, c.sigma_start, c.sigma_end, f)

    def sigma(self, step: int) -> float:
        return self.stage_sigma(self.stage(step))

    def table(self) -> list[float]:
        """σ of every stage, stage 0 first."""
        return [self.stage_sigma(k) for k in range(self.config.num_stages)]

    def state_dict(self) -> dict:
        return {"config": asdict(self.config)}

    def load_state_dict(self, state: Mapping) -> None:
        """Refuse to resume a run under a different schedule (the σ of past steps would change)."""
        _check_same_config(self.config, state["config"])


def _check_same_config(config: AQNConfig, saved: Mapping) -> None:
    mine = asdict(config)
    saved = {**saved, "norms": tuple(saved.get("norms", ()))}
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"AQN checkpoint was written with a different config (field: (saved, current)) {diff}: "
                         "resume with the saved AQNConfig")


# ----------------------------------------------------------------------------- noise on the norms
def find_norms(model: nn.Module, norms: tuple[str, ...] | list[str]) -> dict[str, nn.Module]:
    """{module name: module} for every module whose last attribute name is in `norms`, in model order.

    Every listed name must match at least one module with a 1-D `weight` parameter; otherwise
    ValueError names the norm-like modules the model does have.
    """
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in norms:
            weight = getattr(module, "weight", None)
            if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
                raise ValueError(f"{name} ({type(module).__name__}) has no 1-D weight parameter: AQN needs an "
                                 "RMSNorm with a per-channel weight")
            found[name] = module
    missing = [n for n in norms if not any(k.rsplit(".", 1)[-1] == n for k in found)]
    if missing:
        available = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                            if "norm" in type(m).__name__.lower() or "norm" in n.rsplit(".", 1)[-1].lower()})
        raise ValueError(f"norm name(s) {missing} not found in {type(model).__name__}: "
                         f"this model's norm modules are named {available}")
    return found


def _check_not_active(name: str, module: nn.Module) -> None:
    if getattr(module, _ACTIVE_ATTR, False):
        raise RuntimeError(f"{name} currently holds an AQN override: sample noise and apply overrides "
                           "outside `apply_norm_overrides`, so the base is the true weight (no accumulation)")


def sample_norm_noise(model: nn.Module, sigma: float, generator: torch.Generator,
                      norms: tuple[str, ...] = DEFAULT_NORMS
                      ) -> dict[str, torch.Tensor]:
    """{norm name: Z} with Z = σ·N(0, I) in float32 on the CPU, one fresh vector per norm, model order.

    Drawn on the CPU so the same generator state gives the same noise on any device.
    """
    if not math.isfinite(sigma) or sigma < 0:
        raise ValueError(f"sigma={sigma!r}: σ must be a finite number >= 0")
    noise = {}
    for name, module in find_norms(model, norms).items():
        _check_not_active(name, module)
        z = torch.randn(module.weight.shape, generator=generator, dtype=torch.float32, device="cpu")
        noise[name] = z * sigma
    return noise


def _resolve(model: nn.Module, names) -> dict[str, tuple[str, nn.Module]]:
    """Map each key to a module of `model`: exact name, or a unique suffix match either way.

    The suffix rule lets noise drawn on one wrapping of a model (e.g. the rollout engine's) be
    applied to another (e.g. the PEFT-wrapped trainer model, whose names gain a prefix).
    """
    modules = dict(model.named_modules())
    out = {}
    for key in names:
        if key in modules:
            out[key] = (key, modules[key])
            continue
        hits = [n for n in modules if n and (n.endswith("." + key) or key.endswith("." + n))]
        if len(hits) != 1:
            raise ValueError(f"override {key!r} matches {len(hits)} modules of {type(model).__name__} "
                             f"({hits[:4]}): keys must be module names from model.named_modules()")
        out[key] = (hits[0], modules[hits[0]])
    return out


def noise_to_overrides(model: nn.Module, noise: Mapping[str, torch.Tensor],
                       dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{module name of `model`: cast(w + Z)} computed in float32 from the current (base) weights.

    `dtype` defaults to the parameter's dtype; float32 keeps noise that bf16 would round away,
    for a runtime whose norm weights live in float32.
    """
    targets = {}
    for key, (name, module) in _resolve(model, noise).items():
        _check_not_active(name, module)
        w = module.weight.detach()
        if noise[key].shape != w.shape:
            raise ValueError(f"noise for {name} has shape {tuple(noise[key].shape)}, the weight {tuple(w.shape)}")
        targets[key] = (name, w)
    moved = _float32_on_devices({key: noise[key] for key in targets}, {key: w.device for key, (_, w) in targets.items()})
    return {name: (w.float() + moved[key]).to(dtype or w.dtype) for key, (name, w) in targets.items()}


def _float32_on_devices(tensors: Mapping[str, torch.Tensor],
                        devices: Mapping[str, torch.device]) -> dict[str, torch.Tensor]:
    """float32 copies of ``tensors[key]`` on ``devices[key]``, one copy per pair of source and target device rather
    than one per tensor (a copy from pageable host memory synchronizes its stream first: 56 norms at 7B)."""
    out, groups = {}, {}
    for key, t in tensors.items():
        groups.setdefault((t.device, torch.device(devices[key])), []).append(key)
    for (_, device), keys in groups.items():
        flat = torch.cat([tensors[k].reshape(-1).to(torch.float32) for k in keys]).to(device)
        for k, part in zip(keys, flat.split([tensors[k].numel() for k in keys])):
            out[k] = part.view(tensors[k].shape)
    return out


def sample_norm_overrides(model: nn.Module, sigma: float, generator: torch.Generator,
                          norms: tuple[str, ...] = DEFAULT_NORMS,
                          dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """{module name: base weight + σ·N(0, I)} for each targeted RMSNorm (fresh draw per norm)."""
    return noise_to_overrides(model, sample_norm_noise(model, sigma, generator, norms), dtype)


@contextlib.contextmanager
def apply_norm_overrides(model: nn.Module, overrides: Mapping[str, torch.Tensor]) -> Iterator[nn.Module]:
    """Copy `overrides` into the norm weights for the duration of the block; restore the exact bits after.

    The copy goes into the parameters' own storage (no pointer swap), so anything that captured
    the storage, such as a CUDA graph, sees the noised weights. On exit, also on an exception,
    the saved original bits are written back. Run backward inside the block if the trainer's
    forward used the overrides, and do not step an optimizer on a norm weight inside it,
    because the restore would overwrite that update. An empty dict is a no-op.
    """
    targets = _resolve(model, overrides)
    if len({name for name, _ in targets.values()}) != len(targets):
        raise ValueError(f"overrides {list(overrides)} name the same module twice: give each norm once")
    for key, (name, module) in targets.items():  # validate everything before touching anything
        _check_not_active(name, module)
        if overrides[key].shape != module.weight.shape:
            raise ValueError(f"override for {name} has shape {tuple(overrides[key].shape)}, "
                             f"the weight {tuple(module.weight.shape)}")
    saved = {}
    try:
        with torch.no_grad():
            for key, (name, module) in targets.items():
                saved[name] = (module, module.weight.detach().clone())
                setattr(module, _ACTIVE_ATTR, True)
                module.weight.copy_(overrides[key])
        yield model
    finally:
        with torch.no_grad():
            for module, original in saved.values():
                module.weight.copy_(original)
                setattr(module, _ACTIVE_ATTR, False)


def merged_projection_weight(norm_weight: torch.Tensor, noise: torch.Tensor,
                             proj_weight: torch.Tensor) -> torch.Tensor:
    """The projection weight that, after the clean norm, equals the noised norm: W · diag(1 + Z/w), float32.

    `proj_weight` is nn.Linear's [out, in], so input column i is scaled by (1 + Z_i/w_i).
    """
    if norm_weight.shape != noise.shape or proj_weight.dim() != 2 or proj_weight.shape[1] != norm_weight.numel():
        raise ValueError(f"shapes norm {tuple(norm_weight.shape)}, noise {tuple(noise.shape)}, projection "
                         f"{tuple(proj_weight.shape)}: need norm == noise == [in] and projection [out, in]")
    w = norm_weight.float()
    if bool((w == 0).any()):
        raise ValueError("norm weight has zeros: the multiplicative view (1 + Z/w) is undefined there "
                         "(the additive form w + Z still is)")
    return proj_weight.float() * (1.0 + noise.float() / w)[None, :]


# ----------------------------------------------------------------------------- per-run controller
def _draw_seed(seed: int, step: int, call: int) -> int:
    """A well-mixed 64-bit seed for (run seed, step, rollout number within the step)."""
    words = np.random.SeedSequence([seed, step, call]).generate_state(2, dtype=np.uint32)
    return int(words[0]) << 32 | int(words[1])


@dataclass
class AQNController:
    """What a trainer or rollout loop holds: σ of each step and fresh overrides for each rollout.

    Noise is a function of (seed, step, rollout number within the step), so a run resumed from
    a checkpoint at a step boundary draws the same noise without any saved generator state.
    `state_dict` also carries the position inside a step, for resuming between the rollouts of
    one step.
    """

    config: AQNConfig
    schedule: AQNSchedule = field(init=False, repr=False)
    last_step: int | None = field(default=None, init=False)
    calls_in_step: int = field(default=0, init=False)
    last_noise: dict = field(default_factory=dict, init=False, repr=False)  # {norm name: Z} of the latest rollout
    last_stats: dict = field(default_factory=dict, init=False, repr=False)  # realized noise of the latest draw

    def __post_init__(self):
        self.schedule = AQNSchedule(self.config)

    def sigma(self, step: int) -> float:
        return self.schedule.sigma(step)

    def stage(self, step: int) -> int:
        return self.schedule.stage(step)

    def overrides_for_step(self, model: nn.Module, step: int,
                           dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Overrides for the next rollout at `step`: {} when σ = 0, else a fresh draw per targeted norm."""
        sigma = self.sigma(step)
        if not self.config.enabled:
            return {}
        find_norms(model, self.config.norms)  # fail early on a wrong name, even in stage 0
        if step != self.last_step:
            self.last_step, self.calls_in_step = step, 0
        generator = torch.Generator(device="cpu").manual_seed(_draw_seed(self.config.seed, step, self.calls_in_step))
        self.calls_in_step += 1
        if sigma == 0.0:
            self.last_noise, self.last_stats = {}, {"sigma": 0.0, "stage": self.stage(step)}
            return {}
        self.last_noise = sample_norm_noise(model, sigma, generator, self.config.norms)
        overrides = noise_to_overrides(model, self.last_noise, dtype)
        self.last_stats = {"sigma": sigma, "stage": self.stage(step), **realized_noise_stats(model, overrides)}
        return overrides

    def trainer_overrides(self, model: nn.Module, step: int) -> dict[str, torch.Tensor]:
        """For target="both": the latest rollout's noise Z applied to the trainer's model; {} otherwise."""
        if self.config.target != "both" or self.sigma(step) == 0.0:
            return {}
        if self.last_step != step or not self.last_noise:
            raise RuntimeError(f"no rollout noise drawn for step {step}: call overrides_for_step(model, {step}) "
                               "for the rollout first, so the trainer scores the policy that sampled")
        return noise_to_overrides(model, self.last_noise)

    def state_dict(self) -> dict:
        return {**self.schedule.state_dict(), "last_step": self.last_step, "calls_in_step": self.calls_in_step}

    def load_state_dict(self, state: Mapping) -> None:
        self.schedule.load_state_dict(state)
        self.last_step, self.calls_in_step = state["last_step"], state["calls_in_step"]


def realized_noise_stats(model: nn.Module, overrides: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """What survived the cast to the weight dtype, measured against the current (base) weights.

    realized_rms: RMS of (override - base) over all targeted channels (compare with σ);
    fraction_changed: share of channels whose stored value changed at all.
    """
    if not overrides:
        return {"realized_rms": 0.0, "fraction_changed": 0.0}
    per_device, count = {}, 0  # device sums, read back once per device (a read per norm is a GPU sync each)
    for key, (name, module) in _resolve(model, overrides).items():
        _check_not_active(name, module)
        delta = overrides[key].float() - module.weight.detach().float()
        per_device.setdefault(delta.device, []).append(torch.stack([delta.double().pow(2).sum(),
                                                                    (delta != 0).sum().double()]))
        count += delta.numel()
    sq, changed = 0.0, 0
    for sums in per_device.values():
        total_sq, total_changed = torch.stack(sums).sum(dim=0).tolist()
        sq, changed = sq + total_sq, changed + int(total_changed)
    return {"realized_rms": math.sqrt(sq / count), "fraction_changed": changed / count}


def schedule_curves(configs: AQNConfig | Mapping[str, AQNConfig]) -> dict:
    """σ per stage for plotting (paper Fig. 15). One config expands to every schedule of SCHEDULES.

    Returns {"curves": [{label, schedule, sigma_start, sigma_end, num_stages, total_steps,
    stage_sigmas, stage_first_steps}, ...]}; the writer adds provenance.
    """
    if isinstance(configs, AQNConfig):
        base = asdict(configs)
        configs = {s: AQNConfig(**{**base, "schedule": s}) for s in SCHEDULES}
    curves = []
    for label, cfg in configs.items():
        sched = AQNSchedule(cfg)
        curves.append({"label": label, "schedule": cfg.schedule, "sigma_start": cfg.sigma_start,
                       "sigma_end": cfg.sigma_end, "num_stages": cfg.num_stages, "total_steps": cfg.total_steps,
                       "stage_sigmas": sched.table(),
                       "stage_first_steps": [sched.stage_first_step(k) for k in range(cfg.num_stages)]})
    return {"curves": curves}
