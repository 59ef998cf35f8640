"""LoRA on NVFP4 and bf16 bases: what must move (adapters), what must not (packed bytes, scales).

Tiny random Llama models (2 layers, hidden 64) keep every test at CPU speed. The toy loss is
next-token cross-entropy on one fixed random batch, which a few Adam steps on the adapters lower.
"""

from __future__ import annotations

import json

import pytest
import torch

from qerl_lib.models import lora
from qerl_lib.models.nvfp4_linear import nvfp4_modules
from qerl_lib.models.loader import load_model, replace_linear_with_nvfp4, save_nvfp4_checkpoint

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
IDS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))


def _tiny(nvfp4: bool, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=torch.bfloat16)
    return replace_linear_with_nvfp4(model, impl="reference") if nvfp4 else model


def _snapshot_base(model) -> dict[str, torch.Tensor]:
    """Every frozen base tensor as raw bytes (fp8 viewed as uint8 so comparisons are exact)."""
    out = {}
    for name, t in list(model.named_buffers()) + list(model.named_parameters()):
        if "lora_" in name or "modules_to_save" in name or t.dtype == torch.float32 and "rotary" in name:
            continue
        t = t.detach()
        out[name] = (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone()
    return out


def _train(peft_model, steps: int = 6, lr: float = 1e-2) -> list[float]:
    params = [p for p in peft_model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)  # a high lr so 6 steps visibly lower the loss
    losses = []
    ids = IDS.to(params[0].device)
    peft_model.train()
    for _ in range(steps):
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An NVFP4 checkpoint on disk, loaded, wrapped with LoRA and trained 6 steps (shared, never modified)."""
    base_dir = save_nvfp4_checkpoint(_tiny(True), tmp_path_factory.mktemp("lora") / "base")
    peft_model = lora.attach_lora(load_model(base_dir, impl="reference"), rank=4)
    base_before = _snapshot_base(peft_model)
    adapters_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    losses = _train(peft_model)
    peft_model.eval()
    return dict(base_dir=base_dir, model=peft_model, losses=losses, base_before=base_before,
                adapters_before=adapters_before)


def _check_only_adapters_moved(peft_model, losses, base_before, adapters_before):
    assert losses[-1] < losses[0] - 0.05, losses
    for name, p in peft_model.named_parameters():
        if name in adapters_before:
            assert not torch.equal(p.detach(), adapters_before[name]), f"{name} did not change"
        else:
            assert p.grad is None, f"{name} received a gradient"
    base_after = _snapshot_base(peft_model)
    assert base_after.keys() == base_before.keys()
    for name, before in base_before.items():
        assert torch.equal(base_after[name], before), f"base tensor {name} changed"


def test_lora_smoke_nvfp4_base_moves_adapters_only(trained):
    peft_model = trained["model"]
    trainable = list(trained["adapters_before"])
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(trainable) == 2 * 7 * CONFIG["num_hidden_layers"]
    assert len(nvfp4_modules(peft_model)) == 7 * CONFIG["num_hidden_layers"]
    assert type(peft_model.get_submodule("base_model.model.model.layers.0.mlp.up_proj")).__name__ == "NVFP4LoraLinear"
    # every packed byte, block scale and global scale (and every other base tensor) is unchanged
    _check_only_adapters_moved(peft_model, trained["losses"], trained["base_before"], trained["adapters_before"])
    for layer in nvfp4_modules(peft_model).values():
        assert all(not b.requires_grad and b.grad is None for b in layer.buffers())


def test_lora_smoke_bf16_base_moves_adapters_only():
    peft_model = lora.attach_lora(_tiny(False), rank=4)
    base_before = _snapshot_base(peft_model)
    adapters_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    losses = _train(peft_model, steps=4)
    _check_only_adapters_moved(peft_model, losses, base_before, adapters_before)


def test_fresh_adapters_do_not_change_the_output():
    base = _tiny(True)
    with torch.no_grad():
        expected = base(input_ids=IDS).logits
        peft_model = lora.attach_lora(base, rank=8)
        assert torch.equal(peft_model(input_ids=IDS).logits, expected)  # B starts at 0


def test_train_norms_makes_decoder_norms_trainable():
    peft_model = lora.attach_lora(_tiny(True), rank=4, train_norms=True)
    norms = [n for n in lora.trainable_parameter_names(peft_model) if "layernorm" in n]
    assert len(norms) == 2 * CONFIG["num_hidden_layers"]
    assert all("modules_to_save" in n for n in norms)
    assert not peft_model.get_submodule("base_model.model.model.norm").weight.requires_grad  # final norm frozen
    before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if n in norms}
    _train(peft_model, steps=2)
    assert any(not torch.equal(p.detach(), before[n]) for n, p in peft_model.named_parameters() if n in norms)


def test_alpha_defaults_to_rank():
    peft_model = lora.attach_lora(_tiny(False), rank=8)
    layer = peft_model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    assert layer.scaling["default"] == 1.0
    with pytest.raises(ValueError, match="rank must be a positive integer"):
        lora.lora_config(rank=0)


def test_save_and_load_adapters_roundtrip(trained, tmp_path):
    peft_model = trained["model"]
    folder = lora.save_adapters(peft_model, tmp_path / "adapter")
    assert (folder / "adapter_config.json").is_file() and (folder / "adapter_model.safetensors").is_file()
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4

    reloaded = lora.load_adapters(load_model(trained["base_dir"], impl="reference"), folder, is_trainable=False)
    with torch.no_grad():
        assert torch.equal(reloaded(input_ids=IDS).logits, peft_model(input_ids=IDS).logits)


def test_merge_refuses_in_place_and_merge_to_bf16_is_dense(trained):
    peft_model = trained["model"]
    layer = peft_model.get_submodule("base_model.model.model.layers.1.mlp.down_proj")
    with pytest.raises(NotImplementedError, match="merge_to_bf16"):
        layer.merge()
    base_before = _snapshot_base(peft_model)

    merged = lora.merge_to_bf16(peft_model)
    assert not nvfp4_modules(merged) and not any("lora" in n for n, _ in merged.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in merged.parameters())
    # W = bf16(dequantize_fp32(base) + scale * B @ A): the same formula, computed independently here.
    expected = (layer.base_layer.dequantize(torch.float32) + layer.get_delta_weight("default").float()).bfloat16()
    assert torch.equal(merged.get_submodule("model.layers.1.mlp.down_proj").weight, expected)
    assert merged.lm_head.weight is merged.model.embed_tokens.weight  # tie preserved
    for name, before in base_before.items():  # the trained model is untouched
        after = dict(peft_model.named_buffers(), **dict(peft_model.named_parameters()))[name].detach()
        assert torch.equal(after.view(torch.uint8) if after.dtype == torch.float8_e4m3fn else after, before)
    with torch.no_grad():
        a, b = peft_model(input_ids=IDS).logits.float(), merged(input_ids=IDS).logits.float()
    # Merged weights round (W + delta) to bf16 once; the unmerged model adds a bf16 LoRA output to a bf16
    # base output. The two differ by bf16 rounding only: within 2% of the logit scale.
    assert (a - b).abs().max() <= 0.02 * a.abs().max()


@pytest.mark.parametrize("requantize", [False, True], ids=["bf16", "requantized"])
def test_export_model(requantize, trained, tmp_path):
    adapter = lora.save_adapters(trained["model"], tmp_path / "adapter")
    out = lora.export_model(trained["base_dir"], adapter, tmp_path / "out", requantize=requantize)
    exported = load_model(out, impl="reference")
    merged = lora.merge_to_bf16(trained["model"])
    config = json.loads((out / "config.json").read_text())
    if requantize:
        assert config["quantization_config"]["format"] == "nvfp4-pack-quantized"
        assert len(nvfp4_modules(exported)) == 7 * CONFIG["num_hidden_layers"]
        requantized = replace_linear_with_nvfp4(merged)  # the native quantizer applied to the merged weights
        for name, layer in nvfp4_modules(exported).items():
            for buf in ("weight_packed", "weight_scale", "weight_global_scale"):
                got, want = getattr(layer, buf), getattr(requantized.get_submodule(name), buf)
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), f"{name}.{buf}"
    else:
        assert "quantization_config" not in config
        for name, p in merged.state_dict().items():
            assert torch.equal(exported.state_dict()[name], p), name


@pytest.mark.cuda
def test_lora_step_on_cuda_with_fp4_kernel():
    peft_model = lora.attach_lora(_tiny(True).cuda(), rank=4)  # layers built with impl="reference"
    from qerl_lib.models.nvfp4_linear import set_impl

    assert set_impl(peft_model, "kernel") == 7 * CONFIG["num_hidden_layers"]
    base_before = {n: t.detach().clone() for n, t in _snapshot_base(peft_model).items()}
    adapters_before = {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}
    losses = _train(peft_model, steps=6)
    _check_only_adapters_moved(peft_model, losses, base_before, adapters_before)
