"""compressed-tensors NVFP4 checkpoints on disk: the config block, tensor validation, writing.

What an NVFP4A16 checkpoint is (verified against llm-compressor 0.14.0.1 / compressed-tensors
0.19.0; docs/nvfp4_format.md):

* ``config.json`` carries a ``quantization_config`` with ``quant_method: "compressed-tensors"``,
  ``format: "nvfp4-pack-quantized"`` and one config group whose ``weights`` are
  ``num_bits 4, type float, strategy tensor_group, group_size 16, symmetric`` and whose
  ``input_activations`` are null (weights only = "A16"). ``targets: ["Linear"]`` with
  ``ignore: ["lm_head"]`` selects the layers: a module is quantized when its name or any of its
  classes matches a target and nothing in ``ignore`` matches it; a pattern ``"re:..."`` is a
  regex (``re.match``) on the module name, anything else an exact name or class name.
* Each quantized Linear ``<p>`` stores ``<p>.weight_packed`` (U8 ``[N, K/2]``),
  ``<p>.weight_scale`` (F8_E4M3 ``[N, K/16]``) and ``<p>.weight_global_scale`` (F32 ``[1]``), and
  no ``<p>.weight``. Everything else (embeddings, norms, the ignored ``lm_head``) is stored
  dense under its usual name; a tied ``lm_head`` is not stored at all.
* Shards: ``model.safetensors`` or ``model.safetensors.index.json`` + shards. Only safetensors.

Loading validates every tensor against the model skeleton *before* any data is read (the
safetensors header has names, dtypes and shapes), so a missing, mis-shaped or mis-typed tensor
raises an error that names the tensor and the file; nothing is ever cast into a format buffer.

Any other quantization (another compressed-tensors format, W4A4 ``NVFP4`` with activation
scales, GPTQ/AWQ/bitsandbytes...) is rejected with a message naming what is supported.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path

import torch
from torch import nn

from qerl_lib.errors import UserError
from qerl_lib.io import atomic_directory, refuse_overlap, write_text_atomic

NVFP4_FORMAT = "nvfp4-pack-quantized"
COMPRESSED_TENSORS_VERSION = "0.19.0"  # the version whose output we reproduce byte for byte
SUPPORTED = ("compressed-tensors checkpoints with format 'nvfp4-pack-quantized' and scheme NVFP4A16 "
             "(4-bit float weights, group 16, bf16 activations), or unquantized models")

# The weights block llm-compressor writes for scheme NVFP4A16 (spec 2.3, keys sorted as CT writes them).
NVFP4A16_WEIGHTS = {
    "actorder": None, "block_structure": None, "dynamic": False, "group_size": 16, "num_bits": 4,
    "observer": "memoryless_minmax", "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn",
    "strategy": "tensor_group", "symmetric": True, "type": "float", "zp_dtype": None,
}

SAFETENSORS_DTYPES = {
    "U8": torch.uint8, "I8": torch.int8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "F16": torch.float16,
    "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64, "BOOL": torch.bool,
}

# Files copied next to a written checkpoint so it is usable on its own (tokenizer, chat template...).
_SIDE_FILE_PATTERNS = ("tokenizer*", "special_tokens_map.json", "added_tokens.json", "vocab.*", "merges.txt",
                       "chat_template*", "generation_config.json", "*.model", "recipe.yaml")


def nvfp4a16_quantization_config(ignore: list[str]) -> dict:
    """The ``quantization_config`` block of an NVFP4A16 checkpoint, verbatim as CT 0.19.0 writes it."""
    return {
        "config_groups": {"group_0": {
            "format": NVFP4_FORMAT, "input_activations": None, "output_activations": None,
            "targets": ["Linear"], "weights": dict(NVFP4A16_WEIGHTS),
        }},
        "format": NVFP4_FORMAT,
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": COMPRESSED_TENSORS_VERSION,
    }


def read_quantization_config(config: dict, source: str = "config.json") -> dict | None:
    """Return ``{"targets": [...], "ignore": [...]}`` for an NVFP4A16 checkpoint, ``None`` for a dense
    model, and raise ``UserError`` (naming what is supported) for anything else."""
    qc = config.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise UserError(f"{source}: quant_method {method!r} is not supported; the kit loads {SUPPORTED}")
    groups = qc.get("config_groups") or {}
    problems = []
    if qc.get("quantization_status") != "compressed":
        problems.append(f"quantization_status {qc.get('quantization_status')!r} (need 'compressed')")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            problems.append(f"{key} is set")
    if not groups:
        problems.append("no config_groups")
    if qc.get("format") not in (NVFP4_FORMAT, "mixed-precision", None):
        problems.append(f"format {qc.get('format')!r}")
    targets: list[str] = []
    for gname, group in groups.items():
        weights = group.get("weights") or {}
        fmt = group.get("format") or qc.get("format")
        wanted = {k: NVFP4A16_WEIGHTS[k] for k in ("num_bits", "type", "strategy", "group_size", "symmetric")}
        got = {k: weights.get(k) for k in wanted}
        if fmt != NVFP4_FORMAT:
            problems.append(f"{gname}: format {fmt!r}")
        if got != wanted:
            problems.append(f"{gname}: weights {got}")
        if group.get("input_activations") or group.get("output_activations"):
            problems.append(f"{gname}: activation quantization (W4A4 'NVFP4' needs calibrated input scales)")
        targets += list(group.get("targets") or [])
    if problems:
        raise UserError(f"{source}: unsupported compressed-tensors checkpoint ({'; '.join(problems)}); "
                        f"the kit loads {SUPPORTED}")
    return {"targets": targets, "ignore": list(qc.get("ignore") or [])}


# ----------------------------------------------------------------------------- which layers
def _name_matches(name: str, pattern: str) -> bool:
    if pattern.startswith("re:"):
        return re.match(pattern[3:], name) is not None
    return pattern == name


def _class_matches(module: nn.Module, pattern: str) -> bool:
    return any(cls.__name__ == pattern for cls in type(module).__mro__ if issubclass(cls, nn.Module))


def quantized_linear_names(model: nn.Module, targets: list[str], ignore: list[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules a compressed-tensors config quantizes (CT's matching rules)."""
    selected = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        hit = any(_name_matches(name, t) or _class_matches(module, t) for t in targets)
        skip = any(_name_matches(name, i) or _class_matches(module, i) for i in ignore)
        if hit and not skip:
            selected.append(name)
    return selected


# ----------------------------------------------------------------------------- reading
def checkpoint_files(folder: str | Path) -> list[Path]:
    """The safetensors files of a model folder (index.json or a single file), or ``UserError``."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise UserError(f"{folder}: shard(s) {missing[:3]} listed in model.safetensors.index.json are missing; "
                            "re-download or re-write the checkpoint")
        return [folder / s for s in shards]
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    found = sorted(folder.glob("*.safetensors"))
    if found:
        return found
    raise UserError(f"{folder}: no .safetensors weights found (the kit loads safetensors only; "
                    "convert .bin checkpoints with transformers' save_pretrained(safe_serialization=True))")


def load_checked_state_dict(folder: str | Path, expected: dict[str, torch.Tensor], optional: set[str] = frozenset(),
                            device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                            exact_dtype: set[str] = frozenset(), ignore_unexpected: tuple[str, ...] = ()) -> dict:
    """Read every tensor ``expected`` names (meta tensors giving dtype and shape) from the folder's shards.

    Raises ``ValueError`` naming the tensor when one is missing (unless in ``optional``), has the
    wrong shape, or the wrong dtype: names in ``exact_dtype`` must match exactly (the NVFP4 format
    buffers); other floating tensors may be any float dtype and are cast to ``dtype``; integer
    tensors must match exactly. Unexpected tensors raise too (regexes in ``ignore_unexpected``
    excepted), because a checkpoint that does not fit the model is the wrong checkpoint.
    """
    from safetensors import safe_open

    files = checkpoint_files(folder)
    headers: dict[str, tuple[Path, str, list[int]]] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                headers[key] = (path, sl.get_dtype(), list(sl.get_shape()))

    for key, want in expected.items():
        if key not in headers:
            if key in optional:
                continue
            hint = ""
            if key.endswith(".weight_packed") and key.replace(".weight_packed", ".weight") in headers:
                hint = " (the layer is stored dense: add it to quantization_config.ignore or re-quantize)"
            raise ValueError(f"{folder}: checkpoint is missing tensor {key!r} "
                             f"(expected {want.dtype} {list(want.shape)}){hint}")
        path, st_dtype, shape = headers[key]
        got_dtype = SAFETENSORS_DTYPES.get(st_dtype)
        if shape != list(want.shape):
            raise ValueError(f"{path.name}: tensor {key!r} has shape {shape}, expected {list(want.shape)}")
        dtype_ok = got_dtype == want.dtype if (key in exact_dtype or not want.dtype.is_floating_point) else (
            got_dtype is not None and got_dtype.is_floating_point and got_dtype.itemsize >= 2)
        if not dtype_ok:
            raise ValueError(f"{path.name}: tensor {key!r} has dtype {st_dtype}, expected {want.dtype}")
    unexpected = [k for k in headers if k not in expected
                  and not any(re.search(p, k) for p in ignore_unexpected)]
    if unexpected:
        raise ValueError(f"{folder}: checkpoint has {len(unexpected)} tensor(s) the model does not have, "
                         f"e.g. {unexpected[:3]} (wrong architecture, or a quantization format the config does not declare)")

    state: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for key in expected:
        if key in headers:
            by_file.setdefault(headers[key][0], []).append(key)
    for path, keys in by_file.items():
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            for key in keys:
                tensor = f.get_tensor(key)
                if key not in exact_dtype and tensor.is_floating_point() and tensor.dtype != dtype:
                    tensor = tensor.to(dtype)
                state[key] = tensor
    return state


# ----------------------------------------------------------------------------- writing
def copy_side_files(source: str | Path | None, dest: Path) -> list[str]:
    """Copy tokenizer / chat template / generation config files from a model folder, if it is local."""
    if source is None or not Path(source).is_dir():
        return []
    copied = []
    for pattern in _SIDE_FILE_PATTERNS:
        for path in sorted(Path(source).glob(pattern)):
            if path.is_file() and not (dest / path.name).exists():
                shutil.copyfile(path, dest / path.name)  # contents only: the mode comes from the umask
                copied.append(path.name)
    return copied


def save_nvfp4_checkpoint(model: nn.Module, out_dir: str | Path, source_dir: str | Path | None = None,
                          force: bool = False) -> Path:
    """Write a model holding ``NVFP4Linear`` layers as a compressed-tensors NVFP4A16 checkpoint, atomically.

    Tensors: exactly what llm-compressor writes (``weight_packed``/``weight_scale``/``weight_global_scale``
    for each quantized Linear, everything else dense in the model's dtype, tied weights once).
    ``config.json``: the model config plus the verbatim ``quantization_config`` of CT 0.19.0, with
    ``ignore`` = every Linear left dense, serialised as CT writes it (sorted keys, indent 2, no final
    newline), so the file is byte-identical to llm-compressor's. Tokenizer and generation files are
    copied from ``source_dir`` (default: the folder the model was loaded from, when it is local).

    ``out_dir`` is never ``source_dir``, a folder around it or inside it (``io.refuse_overlap``); an
    existing ``out_dir`` that is not an empty folder is replaced only with ``force=True`` or when
    ``io.prepare_output_folder`` cleared it (``io.atomic_directory``), otherwise ``UserError``.
    """
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    nvfp4_layers = {n for n, m in model.named_modules() if isinstance(m, NVFP4Linear)}
    if not nvfp4_layers:
        raise ValueError("save_nvfp4_checkpoint: the model has no NVFP4Linear layers; "
                         "quantize it first with loader.replace_linear_with_nvfp4")
    wrapped = [n for n, m in model.named_modules() if type(m).__name__.startswith("Lora") or hasattr(m, "lora_A")]
    if wrapped:
        raise ValueError(f"save_nvfp4_checkpoint: the model carries LoRA adapters (e.g. {wrapped[0]}); save the base "
                         "model, or merge with lora.merge_to_bf16 and re-quantize (lora.export_model)")
    dense_linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    config = copy.deepcopy(model.config)
    config.quantization_config = nvfp4a16_quantization_config(ignore=dense_linears)
    source_dir = source_dir if source_dir is not None else getattr(model.config, "_name_or_path", None)
    source_dir = source_dir or None  # "" (a model built from a config) is no folder, not the working directory

    out_dir = refuse_overlap(out_dir, [source_dir], flag="out_dir")
    with atomic_directory(out_dir, force=force) as tmp:
        original = model.config
        model.config = config
        try:
            # save_pretrained handles tied weights (stored once), sharding, the index and config.json.
            model.save_pretrained(tmp, safe_serialization=True)
        finally:
            model.config = original
        _rewrite_config_as_ct(tmp / "config.json")
        _check_written(tmp, nvfp4_layers)
        copy_side_files(source_dir, tmp)
    return out_dir


def _rewrite_config_as_ct(path: Path) -> None:
    """Re-serialise config.json the way CT's ``ModelCompressor.update_config`` does after llm-compressor's
    save (``json.dump(..., indent=2, sort_keys=True)``: transformers' text without its final newline)."""
    write_text_atomic(path, json.dumps(json.loads(path.read_text(encoding="utf-8")), indent=2, sort_keys=True))


def _check_written(folder: Path, nvfp4_layers: set[str]) -> None:
    """Refuse to publish a checkpoint whose tensors do not match the format (cheap: headers only)."""
    from safetensors import safe_open

    seen = {}
    for path in checkpoint_files(folder):
        with safe_open(str(path), framework="pt") as f:
            for key in f.keys():
                seen[key] = f.get_slice(key).get_dtype()
    wanted = {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32"}
    for layer in sorted(nvfp4_layers):
        for suffix, st_dtype in wanted.items():
            if seen.get(f"{layer}.{suffix}") != st_dtype:
                raise RuntimeError(f"writing {folder}: {layer}.{suffix} came out as {seen.get(f'{layer}.{suffix}')}, "
                                   f"expected {st_dtype}")
        if f"{layer}.weight" in seen:
            raise RuntimeError(f"writing {folder}: {layer}.weight must not be stored for a quantized layer")
    config = json.loads((folder / "config.json").read_text())
    if config.get("quantization_config", {}).get("format") != NVFP4_FORMAT:
        raise RuntimeError(f"writing {folder}: config.json lost its quantization_config")

