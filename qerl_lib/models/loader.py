"""Models in, models out: load bf16 or NVFP4 checkpoints, quantize in memory, build random models.

The two-phase pattern (gpt-fast, Marlin)
----------------------------------------
1. *Offline*: quantize once and write a compressed-tensors checkpoint (``quantize_checkpoint``,
   with llm-compressor itself or with our bit-identical native quantizer).
2. *Load*: build the model skeleton from ``config.json`` on the ``meta`` device (no memory),
   swap every quantized ``nn.Linear`` for an ``NVFP4Linear`` whose buffers already have the
   packed shapes, check every tensor of the checkpoint against the skeleton (present, shape,
   dtype: ``checkpoint.load_checked_state_dict``), then ``load_state_dict(assign=True)``: the
   tensors read from disk *become* the module's buffers. No bf16 copy of a quantized weight
   exists at any point, so a 7B model loads in ~5.9 GB instead of 15.2 GB.

Checkpoint validation (always on, cheap)
----------------------------------------
Every checkpoint is checked before and after its tensors are read (`qerl_lib.models.validate`:
whole files, present / well-shaped / well-typed tensors, values the format allows); each failure
is one ``UserError`` line naming the tensor, the file and the fix.

Which Linears are quantized is read from the checkpoint's ``quantization_config`` (targets /
ignore, matched like compressed-tensors), never from a file name.

Fused global scales
-------------------
vLLM runs q/k/v (and gate/up) as one GEMM with a single ``1/gs``, so llm-compressor gives the
members of each group one global scale computed from the group's joint absmax
(``nvfp4.FUSED_GROUPS``). ``replace_linear_with_nvfp4`` does the same, which is what makes our
native checkpoints byte-identical to llm-compressor's.

Random models
-------------
``build_random_model("qwen2.5-7b", nvfp4=True)`` builds a random-weight model of a real
architecture from ``data/configs/`` for memory and speed measurements offline. It quantizes one
fused group at a time, so peak memory is the NVFP4 model plus one bf16 MLP block. On a CPU the
quantizer costs ~0.2 us/weight (~20 min for 7B); ``init="random_codes"`` draws random codes and
block scales directly instead (same tensors, same bytes, seconds), which is what memory checks use.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from qerl_lib.quant import nvfp4 as nvfp4_format  # the module; `nvfp4` is a flag of build_random_model
from qerl_lib.models.checkpoint import (copy_side_files, load_checked_state_dict, quantized_linear_names,
                                        read_quantization_config, save_nvfp4_checkpoint)
from qerl_lib.errors import UserError
from qerl_lib.io import atomic_directory, prepare_output_folder
from qerl_lib.models.nvfp4_linear import FORMAT_BUFFERS, IMPLS, NVFP4Linear
from qerl_lib.models.validate import (REWRITE_HINT, check_nvfp4_values, first_non_finite, refuse_non_finite,
                                      safetensors_index)
from qerl_lib.paths import CONFIGS_DIR

__all__ = ["load_model", "replace_linear_with_nvfp4", "save_nvfp4_checkpoint", "quantize_checkpoint",
           "linear_weight_bytes", "build_random_model", "build_skeleton", "resolve_model_dir", "is_nvfp4_checkpoint",
           "safetensors_index", "check_nvfp4_values", "first_non_finite", "refuse_non_finite"]

SCHEMES = ("NVFP4A16",)
BACKENDS = ("llmcompressor", "native")
DEFAULT_IGNORE = ("lm_head",)
# Buffers some checkpoints carry that the model recomputes (old transformers saved RoPE tables).
_IGNORED_CHECKPOINT_KEYS = (r"rotary_emb\.inv_freq$",)


# ----------------------------------------------------------------------------- paths
def resolve_model_dir(path_or_id: str | os.PathLike) -> Path:
    """A local model folder for what the user typed (``embedded.resolve_model``: the embedded model's
    alias, a local folder, or a hub id)."""
    from qerl_lib.models.embedded import resolve_model

    return Path(resolve_model(path_or_id))


def _read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text(encoding="utf-8"))


def is_nvfp4_checkpoint(path_or_id: str | os.PathLike) -> bool:
    """True for an NVFP4A16 compressed-tensors folder, False for a dense one; UserError for others."""
    folder = resolve_model_dir(path_or_id)
    return read_quantization_config(_read_config(folder), source=str(folder / "config.json")) is not None


# ----------------------------------------------------------------------------- loading
def load_model(path_or_id: str | os.PathLike, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
               impl: str = "auto", trust_remote_code: bool = False) -> nn.Module:
    """Load a causal LM: dense safetensors checkpoints through transformers, NVFP4A16 compressed-tensors
    checkpoints into ``NVFP4Linear`` layers (forward path ``impl``; ignored for dense models). Returns the
    model in eval mode.

    Raises ``UserError`` for unsupported quantization formats, and ``UserError`` naming the tensor and the
    file for a checkpoint whose files are truncated or whose tensors are missing, mis-shaped, mis-typed or
    hold values the format does not allow (NVFP4 checkpoints; dense ones get the file checks only).
    """
    from transformers import AutoModelForCausalLM

    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    folder = resolve_model_dir(path_or_id)
    quant = read_quantization_config(_read_config(folder), source=str(folder / "config.json"))
    if quant is None:
        safetensors_index(folder)  # safetensors only, files whole: fail with the fix, not a transformers traceback
        model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, trust_remote_code=trust_remote_code,
                                                     use_safetensors=True)
        return model.to(device).eval()
    return _load_nvfp4(folder, quant, torch.device(device), dtype, impl, trust_remote_code)


def build_skeleton(config, dtype: torch.dtype = torch.bfloat16, trust_remote_code: bool = False) -> nn.Module:
    """The model with parameters on ``meta`` (no memory) and real non-persistent buffers (RoPE tables)."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=trust_remote_code)
    model.tie_weights()
    return model


def _swap_in_nvfp4_skeletons(model: nn.Module, names: list[str], impl: str, dtype: torch.dtype) -> None:
    for name in names:
        linear = model.get_submodule(name)
        layer = NVFP4Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, impl=impl,
                            compute_dtype=dtype, device="meta", name=name)
        model.set_submodule(name, layer)


def _load_nvfp4(folder: Path, quant: dict, device: torch.device, dtype: torch.dtype, impl: str,
                trust_remote_code: bool) -> nn.Module:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(folder), trust_remote_code=trust_remote_code)
    # The model itself is plain transformers; the quantization lives in our modules. Leaving the dict in
    # the config would make transformers/peft treat it as one of their quantizers.
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    model = build_skeleton(config, dtype, trust_remote_code)
    names = quantized_linear_names(model, quant["targets"], quant["ignore"])
    if not names:
        raise UserError(f"{folder}: quantization_config targets {quant['targets']} (ignore {quant['ignore']}) match "
                        "no Linear layer of this architecture")
    _swap_in_nvfp4_skeletons(model, names, impl, dtype)

    # Expected tensors = the skeleton's parameters and persistent buffers; tied copies are optional.
    expected, optional, canonical = {}, set(), {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        expected[key] = tensor
        first = canonical.setdefault(id(tensor), key)
        if first != key:
            optional.add(key)
    exact = {f"{n}.{b}" for n in names for b in FORMAT_BUFFERS}
    ignore_unexpected = _IGNORED_CHECKPOINT_KEYS + tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    where = safetensors_index(folder)
    try:
        state = load_checked_state_dict(folder, expected, optional=optional, device=device, dtype=dtype,
                                        exact_dtype=exact, ignore_unexpected=ignore_unexpected)
    except UserError:
        raise
    except ValueError as e:  # missing / mis-shaped / mis-typed tensor, named by load_checked_state_dict
        raise UserError(f"{e}; {REWRITE_HINT}") from None
    check_nvfp4_values(state, set(names), where)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    leftovers = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if leftovers:
        raise ValueError(f"{folder}: no checkpoint tensor for {leftovers[:3]} (the checkpoint does not fit the model)")
    model.to(device)
    model.config._name_or_path = str(folder)
    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(folder))
    return model.eval()


# ----------------------------------------------------------------------------- quantizing in memory
def _fused_group_of(name: str) -> tuple[str, tuple[str, ...]] | None:
    parent, _, leaf = name.rpartition(".")
    for group in nvfp4_format.FUSED_GROUPS:
        if leaf in group:
            return parent, group
    return None


def _check_not_tied(model: nn.Module, name: str, linear: nn.Linear) -> None:
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and linear.weight is getattr(embeddings, "weight", None):
        raise ValueError(f"{name}: weight is tied to the input embeddings; quantizing it would untie them "
                         f"(keep {name!r} in ignore, as llm-compressor's recipe does)")


def replace_linear_with_nvfp4(model: nn.Module, name_filter: Callable[[str], bool] | None = None, impl: str = "auto",
                              ignore: tuple[str, ...] | list[str] = DEFAULT_IGNORE) -> nn.Module:
    """Quantize ``nn.Linear`` layers of an in-memory model to ``NVFP4Linear``, in place, one at a time.

    Selected: every Linear whose name is not in ``ignore`` (CT patterns: exact name or ``"re:regex"``)
    and passes ``name_filter``. Members of a fused group (q/k/v, gate/up) share one global scale over
    the members being quantized, as llm-compressor does, so the bytes match its checkpoints.
    Non-finite weights or ``in_features % 16 != 0`` raise ``ValueError`` naming the layer.
    """
    selected = [n for n in quantized_linear_names(model, ["Linear"], list(ignore))
                if name_filter is None or name_filter(n)]
    chosen = set(selected)
    shared_scales: dict[tuple[str, tuple[str, ...]], torch.Tensor] = {}
    for name in selected:
        linear = model.get_submodule(name)
        _check_not_tied(model, name, linear)
        gs = None
        group = _fused_group_of(name)
        if group is not None:
            parent, members = group
            if group not in shared_scales:
                member_names = [f"{parent}.{m}" if parent else m for m in members]
                weights = []
                for member in member_names:
                    if member in chosen:
                        w = model.get_submodule(member).weight.detach()
                        nvfp4_format.global_scale(w, name=member)  # validates each member under its own name
                        weights.append(w)
                shared_scales[group] = nvfp4_format.global_scale(*weights, name=f"{parent}.{'/'.join(members)}")
            gs = shared_scales[group]
        model.set_submodule(name, NVFP4Linear.from_linear(linear, global_scale=gs, impl=impl, name=name))
    return model


# ----------------------------------------------------------------------------- offline quantization
def quantize_checkpoint(model_path: str | os.PathLike, out_dir: str | os.PathLike, scheme: str = "NVFP4A16",
                        backend: str = "llmcompressor", ignore: tuple[str, ...] = DEFAULT_IGNORE,
                        device: str = "cpu", force: bool = False) -> Path:
    """Quantize a dense checkpoint to a compressed-tensors NVFP4A16 folder (written atomically).

    ``backend="llmcompressor"`` runs llm-compressor's data-free ``oneshot`` (the reference tool);
    ``backend="native"`` uses this kit's quantizer. Both load the source the same way, in the dtype it
    is stored in (``dtype="auto"``, as llm-compressor's examples do), so the native output is byte for
    byte llm-compressor's for bf16, fp16 and fp32 sources alike: scales are computed in the source
    dtype (fp32 weights give other global and block scales than the same weights rounded to bf16;
    fp16 reproduces compressed-tensors' small-amax overflow, ``quant.nvfp4``) and the dense tensors
    (embeddings, norms, ``lm_head``, biases) stay in it. llm-compressor also writes ``recipe.yaml``.
    Before anything is loaded, ``out_dir`` is checked (``io.prepare_output_folder``: an existing
    non-empty folder only with ``force``, never the model folder or a folder around or inside it); a
    model holding NaN or Inf is refused on both backends before anything is written.
    """
    if scheme not in SCHEMES:
        raise UserError(f"scheme {scheme!r} is not supported; use one of {SCHEMES} "
                        "(W4A4 'NVFP4' also quantizes activations and needs calibration data)")
    if backend not in BACKENDS:
        raise UserError(f"backend {backend!r} is not supported; use one of {BACKENDS}")
    src = resolve_model_dir(model_path)
    out_dir = prepare_output_folder(out_dir, [src], force)
    if read_quantization_config(_read_config(src), source=str(src / "config.json")) is not None:
        raise UserError(f"{src} is already quantized; pass the dense (bf16) model to quantize")
    model = _load_source(src, device if backend == "native" else "cpu")
    if backend == "native":
        replace_linear_with_nvfp4(model, ignore=ignore)
        return save_nvfp4_checkpoint(model, out_dir, source_dir=src, force=force)

    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier

    oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme=scheme, ignore=list(ignore)))
    with atomic_directory(out_dir, force=force) as tmp:
        model.save_pretrained(tmp, save_compressed=True)
        copy_side_files(src, tmp)
    return out_dir


def _load_source(src: Path, device: str) -> nn.Module:
    """The dense model to quantize, in its stored dtype, refused if any tensor is NaN or Inf.

    Both backends start here, so they quantize the same numbers. oneshot re-reads
    ``config._name_or_path``, so the model comes from the local folder ``src``.
    """
    from transformers import AutoModelForCausalLM

    safetensors_index(src)  # safetensors only, files whole
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype="auto", use_safetensors=True)
    model = model.to(device).eval()
    refuse_non_finite(model, src)  # llm-compressor would write NaN scales without a word
    return model


# ----------------------------------------------------------------------------- memory accounting
def storage_bytes(tensors, seen: set) -> int:
    """Bytes of the storages behind ``tensors``, each storage once (``seen`` collects them across calls)."""
    total = 0
    for t in tensors:
        if t is None or t.is_meta:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), t.device)
        if key not in seen:  # count shared storages (tied weights) once
            seen.add(key)
            total += storage.nbytes()
    return total


def linear_weight_bytes(model: nn.Module) -> dict:
    """Resident bytes of the model's Linear weights vs. the same weights in bf16.

    ``nvfp4_*``: the quantized layers (packed codes + block scales + global scale, measured from the
    tensors' storage) against ``N * K * 2`` bytes. ``dense_*``: Linear layers kept dense (``lm_head``).
    ``total_*``: both. LoRA adapter matrices and biases are not counted.
    """
    seen: set = set()
    nvfp4_bytes = nvfp4_bf16 = dense_bytes = dense_bf16 = n_nvfp4 = n_dense = 0
    for name, module in model.named_modules():
        if any(part.startswith("lora_") for part in name.split(".")):
            continue  # adapter matrices are trainable state, not base weights
        if isinstance(module, NVFP4Linear):
            n_nvfp4 += 1
            nvfp4_bytes += storage_bytes([getattr(module, b) for b in FORMAT_BUFFERS], seen)
            nvfp4_bf16 += module.in_features * module.out_features * 2
        elif isinstance(module, nn.Linear):
            n_dense += 1
            dense_bytes += storage_bytes([module.weight], seen)
            dense_bf16 += module.weight.numel() * 2
    total, total_bf16 = nvfp4_bytes + dense_bytes, nvfp4_bf16 + dense_bf16
    return {
        "nvfp4_layers": n_nvfp4, "nvfp4_bytes": nvfp4_bytes, "nvfp4_bf16_bytes": nvfp4_bf16,
        "nvfp4_ratio": nvfp4_bytes / nvfp4_bf16 if nvfp4_bf16 else None,
        "dense_layers": n_dense, "dense_bytes": dense_bytes, "dense_bf16_bytes": dense_bf16,
        "total_bytes": total, "total_bf16_bytes": total_bf16, "total_ratio": total / total_bf16 if total_bf16 else None,
    }


# ----------------------------------------------------------------------------- random models
def _config_path(config_name_or_path: str | os.PathLike) -> Path:
    path = Path(config_name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path / "config.json"
    if path.is_file():
        return path
    named = CONFIGS_DIR / f"{config_name_or_path}.json"
    if named.is_file():
        return named
    known = sorted(p.stem for p in CONFIGS_DIR.glob("*.json"))
    raise UserError(f"unknown model config {str(config_name_or_path)!r}: use one of {known} or a path to a config.json")


def _random_nvfp4(linear: nn.Module, generator: torch.Generator, std: float, device: torch.device
                  ) -> nvfp4_format.NVFP4Weight:
    """Random codes and plausible block scales (what N(0, std) weights would roughly get)."""
    n, k = linear.out_features, linear.in_features
    packed = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=device, generator=generator)
    gs = torch.tensor([nvfp4_format.GLOBAL_SCALE_NUMERATOR / (5.0 * std)], dtype=torch.float32, device=device)
    spread = 0.75 + 0.5 * torch.rand(n, k // nvfp4_format.GROUP_SIZE, device=device, generator=generator)
    scale = (gs * (2.5 * std / nvfp4_format.FP4_MAX) * spread).to(torch.float8_e4m3fn)
    return nvfp4_format.NVFP4Weight(packed, scale, gs)


def build_random_model(config_name_or_path: str | os.PathLike, dtype: torch.dtype = torch.bfloat16,
                       device: str | torch.device = "cpu", nvfp4: bool = False, impl: str = "auto", seed: int = 0,
                       init: str = "quantize", ignore: tuple[str, ...] = DEFAULT_IGNORE) -> nn.Module:
    """A random-weight causal LM of a real architecture (``data/configs/<name>.json`` or a config path).

    Weights ~ N(0, initializer_range), norms = 1, biases = 0. With ``nvfp4=True`` every Linear except
    ``ignore`` is an ``NVFP4Linear`` built one fused group at a time (the whole bf16 model never exists):
    ``init="quantize"`` quantizes random bf16 weights (exact pipeline), ``init="random_codes"`` draws codes
    and block scales directly (same shapes and bytes, much faster on CPU; the values are not Gaussian).
    """
    from transformers import AutoConfig

    if init not in ("quantize", "random_codes"):
        raise ValueError(f"init must be 'quantize' or 'random_codes', got {init!r}")
    config = AutoConfig.from_pretrained(str(_config_path(config_name_or_path)))
    device = torch.device(device)
    std = float(getattr(config, "initializer_range", 0.02))
    generator = torch.Generator(device=device).manual_seed(seed)
    model = build_skeleton(config, dtype, trust_remote_code=False)

    def randn(shape):
        return torch.empty(shape, dtype=dtype, device=device).normal_(0.0, std, generator=generator)

    if nvfp4:
        names = quantized_linear_names(model, ["Linear"], list(ignore))
        done: set[str] = set()
        for name in names:
            if name in done:
                continue
            group = _fused_group_of(name)
            members = [name] if group is None else [f"{group[0]}.{m}" for m in group[1] if f"{group[0]}.{m}" in names]
            linears = {m: model.get_submodule(m) for m in members}
            if init == "random_codes":
                weights = {m: _random_nvfp4(lin, generator, std, device) for m, lin in linears.items()}
            else:
                dense = {m: randn((lin.out_features, lin.in_features)) for m, lin in linears.items()}
                gs = nvfp4_format.global_scale(*dense.values(), name=name)
                weights = {m: nvfp4_format.quantize(w, global_scale=gs, name=m) for m, w in dense.items()}
                del dense
            for m, q in weights.items():
                lin = linears[m]
                layer = NVFP4Linear(lin.in_features, lin.out_features, bias=lin.bias is not None, impl=impl,
                                    compute_dtype=dtype, device="meta", name=m)
                layer.set_nvfp4_weight(q)
                if lin.bias is not None:
                    layer.bias = torch.zeros(lin.out_features, dtype=dtype, device=device)
                model.set_submodule(m, layer)
                done.add(m)

    materialized: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules():
        for pname, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            if id(param) not in materialized:  # tied parameters are materialised once
                if pname == "bias":
                    data = torch.zeros(param.shape, dtype=dtype, device=device)
                elif param.dim() >= 2:
                    data = randn(param.shape)
                else:  # RMSNorm / LayerNorm scales
                    data = torch.ones(param.shape, dtype=dtype, device=device)
                materialized[id(param)] = nn.Parameter(data, requires_grad=param.requires_grad)
            module._parameters[pname] = materialized[id(param)]
    model.tie_weights()
    return model.to(device).eval()
