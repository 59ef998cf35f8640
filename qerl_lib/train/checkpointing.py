"""Partial gradient checkpointing: recompute only some decoder layers in the backward pass.

With gradient checkpointing a decoder layer keeps only its input from the forward pass and runs its
forward again inside the backward pass to rebuild the activations its gradients need. That costs one
more forward per layer (on a quantized base, one more dequantization of each weight too) and saves
the layer's activations, which grow with the tokens of a micro-batch (RL's long completions). Checkpointing every
layer is the safe default; where memory is left over, some layers can keep their activations and skip
the recompute. A 4-bit base leaves more memory over than a bf16 one, so under one memory budget it can
recompute fewer layers: the memory-for-speed trade behind the paper's single-GPU claims (Sec. 1),
measured here per phase (``qerl bench train --checkpoint-layers``, dev/LOG.md section 42). The trade is
steep: on an H100 at Qwen2.5-7B shapes and 8 x 2304 tokens per micro-batch, each kept layer cost 3.7 GiB
from 28 to 14 recomputing and saved ~0.8% of the trainer phase (one timed step per setting), and that
rate does not extrapolate: the settings it put under 80 GiB with one more kept layer (lora 15 recomputing,
qerl 13) ran out of memory (dev/LOG.md section 46).

``recompute_only(model, n)`` leaves checkpointing on for the first ``n`` decoder layers and off for
the rest (the last layers' backward runs first, so their kept activations are freed first). It acts
on transformers' ``GradientCheckpointingLayer`` modules, whose flag ``gradient_checkpointing`` the
model-wide ``gradient_checkpointing_enable`` sets on every layer; TRL turns checkpointing off and on
around the rollout and its no-grad scoring forwards, which sets every flag again, so the trainer calls
this after each micro-batch's inputs are prepared and before its loss forward. Numerically nothing
changes: a recomputed forward gives the same values.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qerl_lib.errors import UserError

if TYPE_CHECKING:
    import torch

__all__ = ["check_layer_count", "checkpointed_layers", "recompute_only"]


def check_layer_count(n, gradient_checkpointing: bool = True) -> None:
    """A one-line error unless ``n`` is None or a count of layers >= 0, with gradient checkpointing on."""
    if n is None:
        return
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise UserError(f"checkpoint_layers={n!r}: must be a non-negative number of decoder layers (or None: all)")
    if not gradient_checkpointing:
        raise UserError("checkpoint_layers chooses which layers recompute under gradient checkpointing, which is off: "
                        "turn gradient checkpointing on or drop checkpoint_layers")


def checkpointed_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers that support gradient checkpointing, in forward order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def recompute_only(model: torch.nn.Module, n: int | None) -> int:
    """Keep gradient checkpointing on for the first ``n`` decoder layers only (``None``: leave every layer as it
    is). Layers whose checkpointing is off stay off. Returns how many layers now recompute."""
    layers = checkpointed_layers(model)
    if n is None:
        return sum(bool(layer.gradient_checkpointing) for layer in layers)
    check_layer_count(n)
    if not layers:
        raise UserError("checkpoint_layers is set, but the model has no decoder layers with gradient checkpointing "
                        "(transformers' GradientCheckpointingLayer): unset it")
    for layer in layers[n:]:
        layer.gradient_checkpointing = False
    return sum(bool(layer.gradient_checkpointing) for layer in layers)
