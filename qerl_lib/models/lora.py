"""LoRA on a frozen NVFP4 (or bf16) base: attach, save/load, merge, export.

How LoRA rides on a 4-bit base
------------------------------
QeRL never updates the quantized weights. Each targeted projection becomes

    y = base(x) + (alpha / r) * B(A(dropout(x)))      A: [r, K], B: [N, r], B initialised to 0

where ``base`` is an ``NVFP4Linear`` (packed codes + scales, see ``models/nvfp4_linear.py``) or a
frozen bf16 ``nn.Linear``. Only A and B (fp32, peft's default upcast) receive gradients; the base's
buffers are not parameters at all, so no optimizer can touch them, and the base's backward pass
computes ``dL/dx`` only (``nvfp4_linear._FrozenNVFP4Matmul``), which is all the adapters of
earlier layers need.

We use peft (0.21.2) for the adapters, so checkpoints are ordinary peft folders
(``adapter_config.json`` + ``adapter_model.safetensors``) and TRL accepts the model as is.
peft does not know ``NVFP4Linear``; ``NVFP4LoraLinear`` teaches it through peft's custom-module
hook (``LoraConfig._register_custom_module``). It is peft's own ``lora.Linear`` (same
state-dict names, so the engine and TRL see a normal LoRA layer) with these changes: in/out
features and the adapter dtype come from the NVFP4 layer without dequantizing it;
``merge``/``unmerge`` raise instead of silently writing into a temporary dequantized copy
(peft's merge does ``base.weight.data += delta``); and the forward is ``models/lora_forward.py``'s
(the shrink as one matmul, the expand added into the base output in one pass, instead of peft's
casts, scaling and add passes), which the same hook also gives plain ``nn.Linear`` (bf16) and
bitsandbytes NF4 bases. Merging is ``merge_to_bf16``: it builds a new dense model
``W = dequantize(base) + (alpha/r) B A`` (summed in fp32, rounded once to bf16) and leaves the
trained model untouched.

Defaults and where they come from
---------------------------------
* ``rank=32``: the paper's main setting (all Fig. 4/5 curves are "r32").
* ``alpha=None`` -> ``alpha = rank`` (scale 1). The official scripts use rank 16, alpha 16,
  i.e. also scale 1; the paper does not state alpha.
* targets q, k, v, o, gate, up, down (``models.fused.PROJECTIONS``): the official scripts.
* ``train_norms=True`` reproduces the scripts' ``--ln True``: the two RMSNorms of every decoder
  layer become trainable through peft's ``modules_to_save`` (the final ``model.norm`` stays frozen),
  and are saved with the adapters. The paper does not mention this; the default is off.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import torch
from peft.tuners.lora.layer import Linear as _PeftLoraLinear
from torch import nn

from qerl_lib.io import atomic_directory, prepare_output_folder
from qerl_lib.models.fused import PROJECTIONS
from qerl_lib.models.lora_forward import FusedLoraForward, lora_layer_for
from qerl_lib.models.nvfp4_linear import NVFP4Linear

DEFAULT_TARGETS = PROJECTIONS  # every projection of a decoder layer
NORM_MODULES = ("input_layernorm", "post_attention_layernorm")

__all__ = ["attach_lora", "save_adapters", "load_adapters", "merge_to_bf16", "merged_state_dict", "export_model",
           "lora_config", "NVFP4LoraLinear", "trainable_parameter_names", "DEFAULT_TARGETS"]


class NVFP4LoraLinear(FusedLoraForward, _PeftLoraLinear):
    """peft ``lora.Linear`` around an ``NVFP4Linear`` base (state dict and save format unchanged; the forward is
    ``models.lora_forward``'s, as on the other bases)."""

    def __init__(self, base_layer, adapter_name, config, r=0, lora_alpha=1, **kwargs):
        if config.use_dora:
            raise ValueError("DoRA is not supported on NVFP4 base layers (it needs the dense base weight norm "
                             "every step); use plain LoRA")
        super().__init__(base_layer, adapter_name, config=config, r=r, lora_alpha=lora_alpha, **kwargs)

    def _get_in_out_features(self, module):
        return module.in_features, module.out_features

    def _get_base_layer_device_and_dtype(self, base_layer):
        # peft moves new adapters to the base's device/dtype; read them without dequantizing.
        return base_layer.weight_packed.device, base_layer.compute_dtype

    def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
        raise NotImplementedError(
            "an NVFP4 base cannot absorb a LoRA delta in place (its weight is packed 4-bit); "
            "use qerl_lib.models.lora.merge_to_bf16(model) for a dense model, or export_model(..., requantize=True)")

    def unmerge(self) -> None:
        raise NotImplementedError("NVFP4 LoRA layers are never merged, so there is nothing to unmerge")


def _register(config):
    # NVFP4 layers, and the fused forward for plain nn.Linear / bitsandbytes Linear4bit bases (lora_layer_for
    # returns None for other nn.Linear subclasses, and peft's own dispatch then runs)
    config._register_custom_module({NVFP4Linear: NVFP4LoraLinear, nn.Linear: lora_layer_for})
    return config


def lora_config(rank: int = 32, alpha: float | None = None, dropout: float = 0.0,
                targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS, train_norms: bool = False):
    """The peft ``LoraConfig`` ``attach_lora`` uses (NVFP4 layers registered); also usable with TRL."""
    from peft import LoraConfig

    if rank <= 0:
        raise ValueError(f"rank must be a positive integer, got {rank}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout must be in [0, 1), got {dropout}")
    if not targets:
        raise ValueError("targets must name at least one module (e.g. 'q_proj')")
    config = LoraConfig(r=rank, lora_alpha=rank if alpha is None else alpha, lora_dropout=dropout,
                        target_modules=list(targets), bias="none", task_type="CAUSAL_LM",
                        modules_to_save=list(NORM_MODULES) if train_norms else None)
    return _register(config)


def attach_lora(model: nn.Module, rank: int = 32, alpha: float | None = None, dropout: float = 0.0,
                targets: tuple[str, ...] | list[str] = DEFAULT_TARGETS, train_norms: bool = False):
    """Wrap ``model`` (bf16 or NVFP4) with fresh LoRA adapters; returns a peft ``PeftModel``.

    Only the adapters (and, with ``train_norms``, copies of the decoder RMSNorm weights) require grad.
    The base model is modified in place (its targeted modules are wrapped), as with peft.
    """
    from peft import PeftModel, get_peft_model

    if isinstance(model, PeftModel):
        raise ValueError("the model already carries adapters; attach_lora expects the base model")
    peft_model = get_peft_model(model, lora_config(rank, alpha, dropout, targets, train_norms))
    leaked = [name for name, m in peft_model.named_modules() if isinstance(m, NVFP4Linear)
              and any(b.requires_grad for b in m.buffers())]
    if leaked:  # cannot happen with peft 0.21.2 (buffers are not parameters); the invariant matters enough to check
        raise RuntimeError(f"NVFP4 buffers require grad after attaching LoRA: {leaked[:3]}")
    return peft_model


def trainable_parameter_names(model: nn.Module) -> list[str]:
    """Names of the parameters that require grad (what an optimizer built from the model would update)."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


# ----------------------------------------------------------------------------- save / load
# what peft's save_pretrained writes into an adapter folder; a folder holding only these may be replaced
ADAPTER_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors", "README.md"})


def save_adapters(model, adapter_dir: str | os.PathLike, force: bool = False) -> Path:
    """Save the adapters (and trainable norms) in peft format, atomically: adapter_config.json +
    adapter_model.safetensors.

    An existing ``adapter_dir`` is replaced (by rename, once the new one is complete) only when it holds
    nothing but adapter files (``ADAPTER_FILES``), or with ``force``; anything else there is refused
    with a ``UserError`` before the model is touched (``io.prepare_output_folder``).
    """
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        raise ValueError("save_adapters expects the PeftModel returned by attach_lora / load_adapters")
    adapter_dir = Path(adapter_dir)
    only_adapter_files = adapter_dir.is_dir() and not adapter_dir.is_symlink() and all(
        p.is_file() and p.name in ADAPTER_FILES for p in adapter_dir.iterdir())
    prepare_output_folder(adapter_dir, force=force or only_adapter_files, flag="adapter folder")
    with atomic_directory(adapter_dir) as tmp:
        model.save_pretrained(str(tmp), safe_serialization=True)
    return adapter_dir


def check_adapter_dir(adapter_dir: str | os.PathLike) -> Path:
    """``adapter_dir`` as a Path if it is an adapter folder the kit loads (``adapter_config.json`` and
    ``adapter_model.safetensors``: safetensors only, never a pickled ``.bin``); else a one-line `UserError`.
    Cheap: commands call it before they load a model."""
    from qerl_lib.errors import UserError

    adapter_dir = Path(adapter_dir)
    if not adapter_dir.is_dir():
        raise UserError(f"adapter folder {adapter_dir} does not exist: pass the adapter/ folder of a run "
                        "(qerl train writes RUN/adapter)")
    if not (adapter_dir / "adapter_config.json").is_file():
        raise UserError(f"{adapter_dir} has no adapter_config.json: pass a folder written by save_adapters "
                        "(or peft's save_pretrained)")
    if not (adapter_dir / "adapter_model.safetensors").is_file():
        raise UserError(f"{adapter_dir} has no adapter_model.safetensors: the kit loads safetensors adapters only "
                        "(re-save it with peft's save_pretrained(..., safe_serialization=True))")
    return adapter_dir


def load_adapters(model: nn.Module, adapter_dir: str | os.PathLike, adapter_name: str = "default",
                  is_trainable: bool = True):
    """Load a peft adapter folder onto a base model (bf16 or NVFP4) or into an existing PeftModel."""
    from peft import LoraConfig, PeftModel

    adapter_dir = check_adapter_dir(adapter_dir)
    config = _register(LoraConfig.from_pretrained(str(adapter_dir)))
    config.inference_mode = not is_trainable
    if isinstance(model, PeftModel):
        if adapter_name not in model.peft_config:
            model.add_adapter(adapter_name, config)
        model.load_adapter(str(adapter_dir), adapter_name=adapter_name, is_trainable=is_trainable)
        model.set_adapter(adapter_name)
        return model
    return PeftModel.from_pretrained(model, str(adapter_dir), adapter_name=adapter_name, is_trainable=is_trainable,
                                     config=config)


# ----------------------------------------------------------------------------- merge / export
def _dense_weight(module: nn.Module) -> torch.Tensor:
    if isinstance(module, NVFP4Linear):
        return module.dequantize(torch.float32)  # exact fp4 * fl32(s / gs); rounded once below
    return module.weight.detach().float()


def merged_state_dict(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Dense state dict of the base architecture with every active adapter merged:
    ``W = dequantize(base) + sum(scale * B @ A)`` in fp32, rounded once to ``dtype``; trained norm copies
    (``modules_to_save``) replace the originals. The model itself is not modified."""
    from peft import PeftModel
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import ModulesToSaveWrapper

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state: dict[str, torch.Tensor] = {}
    handled: list[str] = []

    def under_handled(name: str) -> bool:
        return any(name == h or name.startswith(h + ".") for h in handled)

    with torch.no_grad():
        for name, module in base.named_modules():
            if under_handled(name):
                continue
            if isinstance(module, BaseTunerLayer):
                inner = module.get_base_layer()
                weight = _dense_weight(inner)
                if module.merged:
                    raise ValueError(f"{name}: adapters are merged into a dense base already; unmerge first")
                for adapter in module.active_adapters:
                    if adapter in module.lora_A:
                        weight = weight + module.get_delta_weight(adapter).float()
                state[f"{name}.weight"] = weight.to(dtype)
                if getattr(inner, "bias", None) is not None:
                    state[f"{name}.bias"] = inner.bias.detach().to(dtype)
                handled.append(name)
            elif isinstance(module, ModulesToSaveWrapper):
                active = module.active_adapters[0] if module.active_adapters else None
                source = module.modules_to_save[active] if active in module.modules_to_save else module.original_module
                for key, tensor in source.state_dict().items():
                    state[f"{name}.{key}"] = tensor.detach().to(dtype) if tensor.is_floating_point() else tensor
                handled.append(name)
            elif isinstance(module, NVFP4Linear):
                state[f"{name}.weight"] = _dense_weight(module).to(dtype)
                if module.bias is not None:
                    state[f"{name}.bias"] = module.bias.detach().to(dtype)
                handled.append(name)
            else:
                prefix = f"{name}." if name else ""
                own = list(module._parameters.items()) + [(k, b) for k, b in module._buffers.items()
                                                          if k not in module._non_persistent_buffers_set]
                for key, tensor in own:  # this module's own tensors; children are visited themselves
                    if tensor is not None:
                        tensor = tensor.detach()
                        state[prefix + key] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def merge_to_bf16(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """A new plain transformers model (dense ``dtype`` weights) = dequantized base + LoRA deltas.

    The input (PeftModel or NVFP4 model) is left untouched; memory for the dense copy is needed.
    """
    from peft import PeftModel

    from qerl_lib.models.loader import build_skeleton

    base = model.get_base_model() if isinstance(model, PeftModel) else model
    state = merged_state_dict(model, dtype=dtype)
    config = copy.deepcopy(base.config)
    merged = build_skeleton(config, dtype)
    device = next(iter(state.values())).device
    missing, unexpected = merged.load_state_dict(state, strict=False, assign=True)
    merged.tie_weights()
    still_meta = [n for n, t in list(merged.named_parameters()) + list(merged.named_buffers()) if t.is_meta]
    if still_meta or unexpected:
        raise RuntimeError(f"merge_to_bf16: state does not fit the architecture (meta {still_meta[:3]}, "
                           f"unexpected {unexpected[:3]})")
    merged.generation_config = copy.deepcopy(base.generation_config)
    return merged.to(device).eval()


def export_model(model_path: str | os.PathLike, lora_dir: str | os.PathLike, out_dir: str | os.PathLike,
                 requantize: bool = False, device: str = "cpu", force: bool = False) -> Path:
    """Base checkpoint + adapter folder -> a standalone checkpoint, written atomically.

    ``requantize=False``: merged dense bf16 (loads anywhere). ``requantize=True``: the merged weights
    quantized again to NVFP4A16 (compressed-tensors, loads in vLLM); note that re-quantizing rounds the
    merged weight to the 4-bit grid again, so small LoRA deltas can partly vanish. ``out_dir`` is checked
    before anything loads (``io.prepare_output_folder``): an existing non-empty folder only with ``force``,
    never the model or adapter folder, a folder around one of them, or one inside them. A merged model
    holding NaN or Inf (a diverged adapter) is refused before anything is written.
    """
    from qerl_lib.errors import UserError
    from qerl_lib.models.checkpoint import copy_side_files
    from qerl_lib.models.loader import (first_non_finite, load_model, replace_linear_with_nvfp4, resolve_model_dir,
                                        save_nvfp4_checkpoint)

    check_adapter_dir(lora_dir)
    source = resolve_model_dir(model_path)
    out_dir = prepare_output_folder(out_dir, [source, lora_dir], force)
    base = load_model(source, device=device)
    dense_linears = [n for n, m in base.named_modules() if isinstance(m, nn.Linear)]  # kept dense (lm_head)
    merged = merge_to_bf16(load_adapters(base, lora_dir, is_trainable=False))
    bad = first_non_finite(merged)
    if bad is not None:
        raise UserError(f"{lora_dir}: merging this adapter gives NaN or Inf in {bad[0]!r} (e.g. at index {bad[1]}); "
                        "the adapter is broken (a diverged run?): export an adapter from a finite run")
    if requantize:
        replace_linear_with_nvfp4(merged, ignore=dense_linears or ("lm_head",))
        return save_nvfp4_checkpoint(merged, out_dir, source_dir=source)
    with atomic_directory(out_dir) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        copy_side_files(source, tmp)
    return out_dir
