"""The fused LoRA forward (`models.lora_forward`): which layers get it, that it computes peft's function (outputs and
gradients against a float64 plain-torch reference on fresh random inputs), and where peft's own forward still runs.

Tolerances: float32 on the CPU, 1e-5 relative (the two paths differ only in summation order); bf16, under autocast
as the trainer runs, 2e-2 relative (a few bf16 ulps; peft's path rounds three times, this one once)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from peft.tuners.lora.layer import Linear as PeftLoraLinear
from torch import nn

from qerl_lib.models import lora, lora_forward
from qerl_lib.models.loader import replace_linear_with_nvfp4
from tests.conftest import run_triton_interpreter

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)
UP = "base_model.model.model.layers.0.mlp.up_proj"


def _tiny(dtype=torch.float32, base="bf16", seed=0):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**CONFIG), dtype=dtype)
    if base == "nvfp4":
        model = replace_linear_with_nvfp4(model, impl="reference")
    if base == "nf4":
        pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `quant` extra) not installed")
        from qerl_lib.models.nf4 import to_nf4
        model = to_nf4(model, torch.device("cpu"), dtype)
    return model


def _randomize_adapters(peft_model, seed):
    """B starts at zero (peft's init); give every adapter weight random values so the LoRA term matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g).to(p.device) * 0.2)


def _reference(layer, x):
    """float64 ``base(x) + s * (x @ A^T) @ B^T`` from the layer's own weights and base output."""
    base = layer.base_layer(x).double()
    a, b = layer.lora_A["default"].weight.double(), layer.lora_B["default"].weight.double()
    return base + float(layer.scaling["default"]) * (x.double() @ a.t()) @ b.t()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("base, expected", [("bf16", lora_forward.FusedLoraLinear), ("nvfp4", lora.NVFP4LoraLinear),
                                            ("nf4", lora_forward.FusedLoraLinear)])
def test_every_base_gets_the_fused_layer(base, expected):
    peft_model = lora.attach_lora(_tiny(torch.bfloat16, base), rank=4)
    layers = [m for m in peft_model.modules() if hasattr(m, "lora_A")]
    assert len(layers) == 7 * CONFIG["num_hidden_layers"]
    assert all(type(m) is expected and isinstance(m, lora_forward.FusedLoraForward) for m in layers)


def test_other_linear_subclasses_keep_peft_dispatch():
    class Custom(nn.Linear):
        pass

    model = _tiny()
    model.model.layers[0].mlp.up_proj = Custom(64, 128, bias=False)
    peft_model = lora.attach_lora(model, rank=4)
    assert type(peft_model.get_submodule(UP)) is PeftLoraLinear
    assert type(peft_model.get_submodule(UP.replace("up_proj", "down_proj"))) is lora_forward.FusedLoraLinear


@pytest.mark.parametrize("base", ["bf16", "nvfp4"])
@pytest.mark.parametrize("seed", [1, 2])
def test_fp32_output_and_gradients_match_reference(base, seed):
    peft_model = lora.attach_lora(_tiny(torch.float32, base), rank=8, alpha=16)  # scale 2
    _randomize_adapters(peft_model, seed)
    layer = peft_model.get_submodule(UP)
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(seed), requires_grad=True)
    y = layer(x)
    assert y.dtype == torch.float32 and y.shape == (3, 5, 128)
    assert _rel(y, _reference(layer, x)) < 1e-5
    grad_out = torch.randn(y.shape, generator=torch.Generator().manual_seed(seed + 10))
    grads = torch.autograd.grad(y, [x, layer.lora_A["default"].weight, layer.lora_B["default"].weight], grad_out)
    x64 = x.detach().double().requires_grad_()
    a64 = layer.lora_A["default"].weight.detach().double().requires_grad_()
    b64 = layer.lora_B["default"].weight.detach().double().requires_grad_()
    ref = layer.base_layer(x64.float()).double() + 2.0 * (x64 @ a64.t()) @ b64.t()
    ref_grads = torch.autograd.grad(ref, [x64, a64, b64], grad_out.double())
    for name, g, r in zip(("x (LoRA part and base)", "A", "B"), grads, ref_grads):
        assert g.dtype == torch.float32
        assert _rel(g, r) < 1e-4, name  # x's base part goes through the base layer's own backward in float32


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[CUDA, pytest.mark.cuda])])
@pytest.mark.parametrize("base", ["bf16", "nvfp4", "nf4"])
def test_bf16_autocast_matches_reference_and_peft(base, device, monkeypatch):
    """As the trainer runs it: a bf16 model, fp32 adapters (peft's upcast), the forward under bf16 autocast."""
    model = _tiny(torch.bfloat16, base) if base != "nf4" or device == "cpu" else None
    if model is None:  # bitsandbytes quantizes as the model moves to the GPU
        pytest.importorskip("bitsandbytes", reason="bitsandbytes (the `quant` extra) not installed")
        from qerl_lib.models.nf4 import to_nf4
        torch.manual_seed(0)
        model = to_nf4(_tiny(torch.bfloat16), torch.device(device), torch.bfloat16)
    peft_model = lora.attach_lora(model.to(device), rank=8)
    _randomize_adapters(peft_model, 3)
    layer = peft_model.get_submodule(UP)
    assert layer.lora_A["default"].weight.dtype == torch.float32
    x = torch.randn(4, 6, 64, generator=torch.Generator().manual_seed(3)).bfloat16().to(device)
    with torch.autocast(device, dtype=torch.bfloat16):
        fused = layer(x)
        monkeypatch.setenv("QERL_LORA_FUSED", "0")
        peft = layer(x)
    assert fused.dtype == peft.dtype == torch.bfloat16
    ref = _reference(layer, x)
    assert _rel(fused, ref) < 2e-2 and _rel(peft, ref) < 2e-2
    assert _rel(fused, ref) <= _rel(peft, ref) * 1.5  # one rounding instead of three: not worse than peft's


def test_whole_model_loss_and_adapter_gradients_match_peft(monkeypatch):
    """Gradient checkpointing on, a two-layer model's loss and every adapter gradient, fused against peft's path."""
    peft_model = lora.attach_lora(_tiny(torch.float32, "nvfp4"), rank=4, dropout=0.0)
    _randomize_adapters(peft_model, 4)
    peft_model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    peft_model.train()
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(4))

    def loss_and_grads():
        peft_model.zero_grad(set_to_none=True)
        loss = peft_model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in peft_model.named_parameters() if p.requires_grad}

    fused_loss, fused_grads = loss_and_grads()
    monkeypatch.setenv("QERL_LORA_FUSED", "0")
    peft_loss, peft_grads = loss_and_grads()
    assert abs(fused_loss.item() - peft_loss.item()) < 1e-5
    assert fused_grads.keys() == peft_grads.keys() and len(fused_grads) == 2 * 7 * CONFIG["num_hidden_layers"]
    for name in fused_grads:
        assert _rel(fused_grads[name], peft_grads[name]) < 1e-4, name


def test_dropout_runs_on_the_lora_input_as_peft():
    peft_model = lora.attach_lora(_tiny(), rank=4, dropout=0.5)
    _randomize_adapters(peft_model, 5)
    layer = peft_model.get_submodule(UP)
    layer.train()
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(7)
    fused = layer(x)
    torch.manual_seed(7)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QERL_LORA_FUSED", "0")
        peft = layer(x)
    assert _rel(fused, peft) < 1e-5  # the same mask: one dropout call on x, the same RNG draws
    assert _rel(fused, _reference(layer, x)) > 1e-2  # and the mask is really applied


def _count_fused(monkeypatch) -> list[int]:
    calls = [0]
    original = lora_forward.fused_lora_add

    def counting(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(lora_forward, "fused_lora_add", counting)
    return calls


def test_peft_forward_runs_where_the_fused_path_does_not_apply(monkeypatch):
    peft_model = lora.attach_lora(_tiny(), rank=4)
    _randomize_adapters(peft_model, 6)
    layer = peft_model.get_submodule(UP)
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(6))
    calls = _count_fused(monkeypatch)
    layer(x)
    assert calls[0] == 1
    with peft_model.disable_adapter():  # adapters off: the base alone
        assert torch.equal(layer(x), layer.base_layer(x))
    monkeypatch.setenv("QERL_LORA_FUSED", "0")
    layer(x)
    assert calls[0] == 1
    monkeypatch.delenv("QERL_LORA_FUSED")
    peft_model.add_adapter("second", lora.lora_config(rank=4))
    layer.set_adapter(["default", "second"])  # two active adapters: peft's loop over them
    before = calls[0]
    y = layer(x)
    assert calls[0] == before and y.shape == (2, 3, 128)


EXPAND_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.models import lora_forward
    out = {}
    for dtype_name, m, n, r, scale in json.loads(sys.argv[1]):
        dt = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(m * n + r)
        base, h, b, grad = (torch.randn(*shape, generator=g).to(dt) for shape in ((m, n), (m, r), (n, r), (m, n)))
        leaves = [t.clone().requires_grad_() for t in (base, h, b)]
        refs = [t.clone().requires_grad_() for t in (base, h, b)]
        y = lora_forward.expand_add(*leaves, scale)
        y.backward(grad)
        y0 = torch.addmm(refs[0], refs[1], refs[2].t(), alpha=scale)
        y0.backward(grad)
        exact = (base.double() + scale * h.double() @ b.double().t())  # the float64 value both round
        rel = lambda u, v: float((u.double() - v.double()).norm() / v.double().norm())
        # a frozen bias: round(base + bias) in base's place, bit for bit as the separate add makes it
        bias = torch.randn(n, generator=g).to(dt)
        with_bias = [t.clone().requires_grad_() for t in (base, h, b)]
        added = [t.clone().requires_grad_() for t in (base, h, b)]
        yb = lora_forward.expand_add(*with_bias, scale, bias=bias)
        yb.backward(grad)
        ya = lora_forward.expand_add(added[0] + bias, added[1], added[2], scale)
        ya.backward(grad)
        out[f"{dtype_name}-{m}-{n}-{r}"] = {
            "out_vs_exact": rel(y.detach(), exact), "addmm_vs_exact": rel(y0.detach(), exact),
            "grads": [rel(a.grad, c.grad) for a, c in zip(leaves, refs)], "dtype": str(y.dtype),
            "base_grad_is_output_grad": bool(torch.equal(leaves[0].grad, grad)),
            "bias_bits_equal": [bool(torch.equal(yb, ya))] + [bool(torch.equal(u.grad, v.grad))
                                                              for u, v in zip(with_bias, added)]}
    print("RESULTS " + json.dumps(out))
""")

EXPAND_CASES = [("float32", 70, 300, 8, 2.0), ("float32", 5, 129, 48, 0.5), ("float16", 67, 200, 32, 1.0),
                ("float16", 9, 130, 4, 2.0)]


def test_expand_add_kernel_matches_addmm_in_the_interpreter():
    """`expand_add`'s Triton kernel: outputs as close to the float64 value as torch.addmm's, gradients equal
    to addmm's (float32 1e-6 / float16 1e-3 normwise), odd shapes and ranks (masked tiles, padded ranks)."""
    results = run_triton_interpreter(EXPAND_SCRIPT, EXPAND_CASES)
    for dtype, m, n, r, _ in EXPAND_CASES:
        case = results[f"{dtype}-{m}-{n}-{r}"]
        tolerance = 1e-6 if dtype == "float32" else 1e-3
        assert case["dtype"] == f"torch.{dtype}" and case["base_grad_is_output_grad"]
        assert case["out_vs_exact"] <= max(1.5 * case["addmm_vs_exact"], tolerance / 10), case
        assert max(case["grads"]) < tolerance, case
        assert all(case["bias_bits_equal"]), case


def _nvfp4_with_bias(impl: str):
    from qerl_lib.models.nvfp4_linear import NVFP4Linear
    torch.manual_seed(0)
    return NVFP4Linear.from_linear(nn.Linear(128, 64, bias=True).bfloat16(), impl=impl, name="q_proj")


def test_the_expand_takes_the_bias_only_from_nvfp4_kernel_layers(monkeypatch):
    """`_foldable_bias`: an NVFP4 layer on the kernel path hands its frozen bias to the expand kernel; the
    reference path (one rounding of product + bias), a bf16 base, a layer without bias, extra call arguments, a
    trainable bias and a run without the expand kernel keep the bias in the base layer."""
    x = torch.randn(3, 128).bfloat16()
    monkeypatch.setattr(lora_forward, "_expand_kernel_runs", lambda t: True)
    kernel_layer = _nvfp4_with_bias("kernel")
    assert lora_forward._foldable_bias(kernel_layer, x, (), {}) is kernel_layer.bias
    assert lora_forward._foldable_bias(_nvfp4_with_bias("reference"), x, (), {}) is None
    assert lora_forward._foldable_bias(_nvfp4_with_bias("auto"), x, (), {}) is None  # auto on a CPU: reference
    assert lora_forward._foldable_bias(nn.Linear(128, 64).bfloat16(), x, (), {}) is None
    assert lora_forward._foldable_bias(kernel_layer, x, (1,), {}) is None
    assert lora_forward._foldable_bias(kernel_layer, x, (), {"scale": 1}) is None
    kernel_layer.bias = nn.Parameter(kernel_layer.bias.clone())
    assert lora_forward._foldable_bias(kernel_layer, x, (), {}) is None
    monkeypatch.undo()
    monkeypatch.setenv("QERL_LORA_EXPAND_KERNEL", "1")
    assert lora_forward._foldable_bias(_nvfp4_with_bias("kernel"), x, (), {}) is None  # a CPU, no interpreter
    with pytest.raises(ValueError, match="the bias must be a frozen"):
        lora_forward.expand_add(torch.randn(4, 6), torch.randn(4, 2), torch.randn(6, 2), 1.0,
                                bias=torch.randn(6, requires_grad=True))


def test_expand_add_names_the_shapes_it_needs():
    with pytest.raises(ValueError, match=r"expand_add: base \[M, N\], h \[M, r\] and b \[N, r\]"):
        lora_forward.expand_add(torch.randn(4, 6), torch.randn(4, 2), torch.randn(5, 2), 1.0)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("m,n,r", [(18432 // 8, 18944, 32), (1000, 3584, 64), (37, 512, 16)])
def test_cuda_expand_add_matches_addmm_in_bf16(m, n, r):
    g = torch.Generator(device="cuda").manual_seed(m + r)
    base, h, b = (torch.randn(*s, generator=g, device="cuda").bfloat16() for s in ((m, n), (m, r), (n, r)))
    y = lora_forward.expand_add(base, h, b, 2.0)
    exact = base.double() + 2.0 * h.double() @ b.double().t()
    y0 = torch.addmm(base, h, b.t(), alpha=2.0)  # cuBLAS rounds the product to bf16, then adds (section 80)
    err = lambda t: float((t.double() - exact).norm() / exact.norm())
    assert err(y) <= err(y0) * 1.01
    # the float64 value rounded once: only float32's summation error can flip a rounding, rarely
    assert float((y != exact.bfloat16()).float().mean()) < 0.01


@pytest.mark.cuda
@CUDA
def test_cuda_expand_add_compiles_once_for_any_row_count():
    """The token count changes every trainer step: a count that is, or stops being, a multiple of 16 must reuse
    the compiled kernel (`do_not_specialize`; a recompile cost ~0.2 s, dev/LOG.md 82) and still be exact."""
    kernel_cache = lora_forward._expand_add_kernel.device_caches[torch.cuda.current_device()][0]
    g = torch.Generator(device="cuda").manual_seed(5)
    compiled = []
    for m in (96, 97, 130, 4096):
        base, h, b = (torch.randn(*s, generator=g, device="cuda").bfloat16() for s in ((m, 384), (m, 16), (384, 16)))
        y = lora_forward.expand_add(base, h, b, 0.5)
        compiled.append(len(kernel_cache))
        exact = base.double() + 0.5 * h.double() @ b.double().t()
        assert float((y.double() - exact).norm() / exact.norm()) < 4e-3, m
    assert compiled[1:] == compiled[:1] * 3, compiled


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("rows", [4, 64, 2304])
def test_cuda_nvfp4_bias_in_the_expand_is_bit_for_bit(rows, monkeypatch):
    """A Qwen2 q_proj on NVFP4 kernels (bias on), LoRA r16, under autocast: with the bias added by the expand kernel
    the output and the gradients of x, A and B equal those of the layer adding it itself, bit for bit, on the
    mma.sync (4 rows), Gluon/Triton (64) and dequantize + cuBLAS (2304) paths."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=256, hidden_size=1024, intermediate_size=2048, num_hidden_layers=1,
                         num_attention_heads=8, num_key_value_heads=2)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model = replace_linear_with_nvfp4(model, impl="kernel").cuda()
    peft_model = lora.attach_lora(model, rank=16)
    _randomize_adapters(peft_model, 4)
    layer = peft_model.get_submodule("base_model.model.model.layers.0.self_attn.q_proj")
    with torch.no_grad():
        layer.base_layer.bias.copy_(torch.randn(1024, device="cuda").bfloat16())
    g = torch.Generator(device="cuda").manual_seed(rows)
    x0 = torch.randn(rows, 1024, generator=g, device="cuda").bfloat16()
    dy = torch.randn(rows, 1024, generator=g, device="cuda").bfloat16()
    runs, folded, real = [], [], lora_forward._foldable_bias
    for fold in (True, False):
        monkeypatch.setattr(lora_forward, "_foldable_bias",
                            (lambda *a: folded.append(real(*a)) or folded[-1]) if fold else (lambda *a: None))
        x = x0.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
        y.backward(dy)
        runs.append([y.detach(), x.grad] + [p.grad.clone() for n, p in layer.named_parameters() if "lora_" in n])
        layer.zero_grad(set_to_none=True)
    assert folded and folded[0] is layer.base_layer.bias  # the first run folded it, the second did not
    assert all(torch.equal(a, b) for a, b in zip(*runs))
