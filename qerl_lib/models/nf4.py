"""QLoRA's frozen base: bitsandbytes NF4 layers (double quantization, the paper's "default QLoRA
configuration"), loaded from a dense checkpoint or made from an in-memory dense model, with
bitsandbytes' CPU repacking switched off (`keep_nf4_layout` says why).

Used by the trainer (mode ``qlora``) and by ``qerl bench rollout --weights nf4``.
"""

from __future__ import annotations

import torch


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

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                               bnb_4bit_compute_dtype=dtype)
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
