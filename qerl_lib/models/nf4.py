"""QLoRA's frozen base: bitsandbytes NF4 layers (double quantization, the paper's "default QLoRA
configuration"), loaded from a dense checkpoint or made from an in-memory dense model, with
bitsandbytes' CPU repacking switched off (`keep_nf4_layout` says why).

Used by the trainer (mode ``qlora``) and by ``qerl bench rollout --weights nf4``; `save_nf4_checkpoint` writes
such a model as a bitsandbytes pre-quantized checkpoint (the format of the hub's "bnb-4bit" models), which
transformers and vLLM load without quantizing again (``qerl bench rollout --engines kit,vllm --weights nf4``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

# QLoRA's default base (the paper's "default QLoRA configuration"), as transformers' BitsAndBytesConfig takes it
NF4_SETTINGS = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True}


def to_nf4(model, device: torch.device, dtype: torch.dtype):
    """QLoRA's base from an in-memory dense model: every Linear but lm_head as a bitsandbytes NF4 Linear4bit
    (double quantization, compute in ``dtype``), quantized as it moves to ``device``."""
    import bitsandbytes as bnb

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.Linear) and f"{name}.{child_name}".strip(".") != "lm_head":
                layer = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                          compute_dtype=dtype, quant_type="nf4", compress_statistics=True,
                                          device="meta")
                layer.weight = bnb.nn.Params4bit(child.weight.data.to(dtype), requires_grad=False, quant_type="nf4",
                                                 compress_statistics=True, module=layer)
                if child.bias is not None:
                    layer.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
                setattr(module, child_name, layer)
    model = model.to(device)
    keep_nf4_layout(model)
    return model


def load_nf4(path: str, device: torch.device, dtype: torch.dtype):
    """QLoRA's base: bitsandbytes NF4 with its default settings (the paper: 'default QLoRA configuration')."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(**NF4_SETTINGS, bnb_4bit_compute_dtype=dtype)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=quant, dtype=dtype,
                                                 device_map={"": str(device)}, use_safetensors=True)
    keep_nf4_layout(model)
    return model.eval()


def keep_nf4_layout(model) -> None:
    """Switch off bitsandbytes' CPU repacking of NF4 weights, so the frozen base stays as loaded.

    On a CPU with AVX512-BF16, bitsandbytes' ``Linear4bit.forward`` repacks its weight the first time
    it runs in eval mode on an input without grad (every engine rollout): the double-quantized
    absmax is dequantized and rounded to bf16, and from then on every forward, training ones
    included, goes through ``gemv_4bit``, which has no autograd formula (the gradient to the
    layer's input is silently dropped). ``state_dict()`` (each checkpoint save) converts back and
    re-quantizes absmax, so each rollout/save cycle changes the base (tiny Llama, 2 steps: 91 % of
    the dequantized weights moved, by up to 0.65 %). With the flag off every forward takes
    ``matmul_4bit``'s dequantize path, as on a CPU without AVX512-BF16 and on CUDA.
    """
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def save_nf4_checkpoint(model, out_dir: str | Path, force: bool = False) -> Path:
    """Write a model whose Linears are bitsandbytes NF4 (`to_nf4`, `load_nf4`) as a pre-quantized checkpoint,
    atomically (``io.atomic_directory``; an existing ``out_dir`` is replaced only with ``force``).

    ``model.safetensors``: the model's ``state_dict`` as bitsandbytes serializes it (each NF4 weight as its packed
    codes plus ``absmax``, ``quant_map``, ``nested_absmax``, ``nested_quant_map`` and the
    ``quant_state.bitsandbytes__nf4`` record), other tensors dense, a tied ``lm_head`` once. ``config.json``: the
    model config with a ``quantization_config`` (``quant_method`` bitsandbytes, `NF4_SETTINGS`, the compute dtype),
    which tells a loader the weights are already quantized: the codes it serves are the model's own."""
    import bitsandbytes as bnb
    from safetensors.torch import save_file

    from qerl_lib.io import atomic_directory

    nf4 = [n for n, m in model.named_modules() if isinstance(m, bnb.nn.Linear4bit)]
    if not nf4:
        raise ValueError("save_nf4_checkpoint: the model has no bitsandbytes Linear4bit layers; quantize it first "
                         "with models.nf4.to_nf4 (or load it with load_nf4)")
    compute = {model.get_submodule(n).compute_dtype for n in nf4}
    if len(compute) != 1 or None in compute:
        raise ValueError(f"save_nf4_checkpoint: the NF4 layers need one compute dtype, found {compute}")
    config = copy.deepcopy(model.config)
    config.quantization_config = {"quant_method": "bitsandbytes", **NF4_SETTINGS, "load_in_8bit": False,
                                  "bnb_4bit_compute_dtype": str(compute.pop()).removeprefix("torch."),
                                  "bnb_4bit_quant_storage": "uint8", "llm_int8_skip_modules": ["lm_head"]}
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        tensors.pop("lm_head.weight", None)  # the embedding, stored once (safetensors refuses shared tensors)
    with atomic_directory(out_dir, force=force) as tmp:
        config.save_pretrained(tmp)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    return Path(out_dir)
