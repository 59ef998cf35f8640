"""Checkpoint validation: whole files, well-formed tensors, values the NVFP4 format allows.

Always on and cheap. Before any tensor is read, every safetensors file's header is parsed and each
tensor's byte range checked against the file size and its dtype x shape (``safetensors_index``): a
truncated download or a disk-full write fails naming the first damaged tensor and the file. After
reading, ``check_nvfp4_values`` checks what the format allows: global scales finite and > 0, block
scales (FP8 E4M3, checked on their bytes) not NaN and not negative, every dense floating tensor
(norms, embeddings, biases, lm_head) finite. Packed codes need no check: every byte is two valid E2M1
codes. Each failure is one ``UserError`` line naming the tensor, the file and the fix. Quantizing
refuses a dense checkpoint with a non-finite tensor the same way, on either backend, before any
output is written (``refuse_non_finite``).

`qerl_lib.models.loader` runs these checks and re-exports the public names.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from qerl_lib.errors import UserError
from qerl_lib.models.checkpoint import checkpoint_files

__all__ = ["safetensors_index", "check_nvfp4_values", "first_non_finite", "refuse_non_finite", "REWRITE_HINT"]

REWRITE_HINT = "the checkpoint is damaged or is not this model's: re-download it or write it again with `qerl quantize`"
_ST_ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
                "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _safetensors_header(path: Path) -> dict[str, tuple[str, list[int]]]:
    """``{key: (dtype, shape)}`` of one safetensors file, after checking every byte range fits the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else None
        if length is None or length > size - 8:
            raise UserError(f"{path}: truncated safetensors file ({size} bytes, header cut off): {REWRITE_HINT}")
        try:
            header = json.loads(f.read(length))
        except ValueError:
            header = None
    if not isinstance(header, dict):
        raise UserError(f"{path}: unreadable safetensors header: {REWRITE_HINT}")
    data_bytes = size - 8 - length
    tensors, damaged = {}, []
    for key, info in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise UserError(f"{path}: unreadable header entry for tensor {key!r}: {REWRITE_HINT}") from None
        numel = 1
        for dim in shape:
            numel *= dim
        if dtype not in _ST_ITEMSIZE:
            raise UserError(f"{path}: tensor {key!r} has unknown dtype {dtype!r}: {REWRITE_HINT}")
        if end > data_bytes:
            damaged.append((start, key, end))
        elif end - start != numel * _ST_ITEMSIZE[dtype]:
            raise UserError(f"{path}: tensor {key!r} holds {end - start} bytes but is declared {dtype} {shape} "
                            f"({numel * _ST_ITEMSIZE[dtype]} bytes): {REWRITE_HINT}")
        tensors[key] = (dtype, shape)
    if damaged:
        start, key, end = min(damaged)
        raise UserError(f"{path}: truncated file: tensor {key!r} needs bytes {start}-{end} of the data, the file holds "
                        f"{data_bytes} ({len(damaged)} tensor(s) cut off): {REWRITE_HINT}")
    return tensors


def safetensors_index(folder: str | os.PathLike) -> dict[str, Path]:
    """``{tensor name: file}`` over a model folder's safetensors files, each checked whole (headers only, no
    tensor data is read): ``UserError`` naming the first damaged tensor and its file otherwise."""
    index: dict[str, Path] = {}
    for path in checkpoint_files(folder):
        for key in _safetensors_header(path):
            index[key] = path
    return index


def _first_bad(mask: torch.Tensor) -> list[int]:
    return [int(i) for i in torch.nonzero(mask)[0].tolist()]


def _first_non_finite(tensor: torch.Tensor, chunk: int = 1 << 24) -> list[int] | None:
    """Index of the first NaN/Inf of ``tensor`` (None if all finite), in chunks of ``chunk`` elements so the
    check never needs a mask as large as an embedding."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), chunk):
        bad = ~torch.isfinite(flat[start:start + chunk])
        if bool(bad.any()):
            index = start + int(torch.nonzero(bad)[0, 0])
            return [int(i) for i in torch.unravel_index(torch.tensor(index), tuple(tensor.shape))]
    return None


def check_nvfp4_values(state: dict[str, torch.Tensor], quantized: set[str], where: dict[str, Path]) -> None:
    """Raise ``UserError`` naming the tensor and its file for a value an NVFP4A16 checkpoint cannot hold.

    ``<layer>.weight_global_scale`` of a quantized layer: finite and > 0 (it divides every block scale).
    ``<layer>.weight_scale`` (FP8 E4M3, checked on its bytes: 0x7F/0xFF is NaN, sign bit with a nonzero
    magnitude is negative): not NaN and >= 0. ``<layer>.weight_packed``: any byte is valid. Every other
    floating tensor (norms, embeddings, biases, dense layers): finite.
    """
    for key, tensor in state.items():
        layer, _, suffix = key.rpartition(".")
        problem = None
        if layer in quantized and suffix == "weight_global_scale":
            bad = ~(torch.isfinite(tensor) & (tensor > 0))
            if bool(bad.any()):
                value = float(tensor.flatten()[bad.flatten()][0])
                problem = f"global scale {value} at index {_first_bad(bad)} (must be finite and > 0)"
        elif layer in quantized and suffix == "weight_scale":
            raw = tensor.view(torch.uint8)
            nan, negative = (raw & 0x7F) == 0x7F, raw > 0x80
            if bool(nan.any()):
                problem = f"NaN block scale at index {_first_bad(nan)} (block scales must be finite and >= 0)"
            elif bool(negative.any()):
                problem = f"negative block scale at index {_first_bad(negative)} (block scales must be finite and >= 0)"
        elif layer in quantized and suffix == "weight_packed":
            continue
        elif tensor.is_floating_point():
            index = _first_non_finite(tensor)
            if index is not None:
                problem = f"non-finite value at index {index} (weights must be finite)"
        if problem is not None:
            raise UserError(f"{where.get(key, 'checkpoint')}: tensor {key!r} has a {problem}: {REWRITE_HINT}")


def first_non_finite(model: nn.Module) -> tuple[str, list[int]] | None:
    """``(tensor name, index)`` of the first NaN/Inf among the model's floating tensors, None if all finite."""
    for key, tensor in model.state_dict().items():
        index = _first_non_finite(tensor) if tensor.is_floating_point() else None
        if index is not None:
            return key, index
    return None


def refuse_non_finite(model: nn.Module, folder: Path) -> None:
    """``UserError`` naming the tensor and its file when a dense model holds NaN or Inf (before quantizing)."""
    bad = first_non_finite(model)
    if bad is not None:
        key, index = bad
        raise UserError(f"{safetensors_index(folder).get(key, folder)}: tensor {key!r} holds NaN or Inf (e.g. at index "
                        f"{index}); NVFP4 needs finite weights: fix or re-download the model, then quantize again")
