"""NVFP4Linear's CPU weight cache (models/nvfp4_linear.py, "The CPU weight cache").

On CPU the reference path keeps the dequantized weight between forwards. These tests hold it to its
contract: bit-identical to the uncached path (outputs and input gradients, on fresh random inputs),
rebuilt whenever the format buffers change (set_nvfp4_weight, buffer replacement, in-place writes,
load_state_dict, .to()), absent from state_dict, pickles and deep copies, never used on the kernel
path or on CUDA, and off on request.
"""

from __future__ import annotations

import copy
import io
import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qerl_lib.models import nvfp4_linear as nvfp4_linear_module
from qerl_lib.models.nvfp4_linear import NVFP4Linear, nvfp4_modules, set_cpu_cache
from qerl_lib.quant import nvfp4

DTYPES = [torch.float32, torch.bfloat16]


def _layer(n=48, k=64, bias=True, dtype=torch.float32, seed=0, impl="auto") -> NVFP4Linear:
    torch.manual_seed(seed)
    return NVFP4Linear.from_linear(nn.Linear(k, n, bias=bias).to(dtype), impl=impl, name="probe")


def _uncached(layer: NVFP4Linear, x: torch.Tensor) -> torch.Tensor:
    """What the layer computed before the cache: a fresh dequantization, then F.linear."""
    w = nvfp4.dequantize(layer.nvfp4_weight, dtype=x.dtype)
    return F.linear(x, w, None if layer.bias is None else layer.bias.to(x.dtype))


def _x(*shape, dtype=torch.float32, seed=None, grad=False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    return torch.randn(*shape, generator=g).to(dtype).requires_grad_(grad)


def _count_dequantize(monkeypatch) -> list[int]:
    calls = [0]
    real = nvfp4.dequantize

    def counting(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(nvfp4_linear_module.nvfp4, "dequantize", counting)
    return calls


# ----------------------------------------------------------------------------- bit-identical
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_cached_forward_is_bit_identical_to_uncached(dtype, bias):
    layer = _layer(bias=bias, dtype=dtype)
    twin = copy.deepcopy(layer)
    twin.cpu_cache = False
    for i, shape in enumerate([(3, 64), (2, 5, 64), (1, 1, 64), (17, 64)]):  # fresh inputs each call
        x = _x(*shape, dtype=dtype, seed=100 + i)
        y = layer(x)
        assert layer._dense is not None and layer._dense.dtype == dtype
        assert torch.equal(y, _uncached(layer, x)), shape
        assert torch.equal(y, twin(x)), shape
    assert twin._dense is None, "cpu_cache = False keeps nothing"


def test_cache_is_built_once_and_reused(monkeypatch):
    layer = _layer()
    calls = _count_dequantize(monkeypatch)
    with torch.no_grad():
        for i in range(5):
            layer(_x(4, 64, seed=i))
    assert calls[0] == 1, "five forwards, one dequantization"
    dense = layer._dense
    layer(_x(4, 64, seed=9))
    assert layer._dense is dense


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_input_gradients_are_identical_and_buffers_stay_frozen(dtype):
    layer = _layer(dtype=dtype)
    layer(_x(2, 64, dtype=dtype))  # warm the cache: the backward below must not depend on it being fresh
    x = _x(3, 7, 64, dtype=dtype, seed=1, grad=True)
    y = layer(x)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = _uncached(layer, x_ref)
    assert torch.equal(y, y_ref)
    grad = _x(*y.shape, dtype=dtype, seed=2)
    y.backward(grad)
    y_ref.backward(grad)
    assert x.grad is not None and torch.equal(x.grad, x_ref.grad)
    assert all(not b.requires_grad and b.grad is None for b in layer.buffers())
    assert not layer._dense.requires_grad


def test_lora_on_a_cached_base_trains_the_same():
    """LoRA-style adapters in front of a frozen NVFP4 base used twice: the adapters' gradients reach them
    through the base's backward, and are bit-identical with and without the cache, step after step."""
    def run(cache: bool):
        base = _layer(n=64, k=64, seed=3)
        base.cpu_cache = cache
        torch.manual_seed(4)
        a, b = nn.Linear(64, 4, bias=False), nn.Linear(4, 64, bias=False)
        nn.init.normal_(b.weight)
        grads = []
        for step in range(3):  # the cache persists across steps and forward/backward pairs
            x = _x(5, 64, seed=10 + step)
            y = base(base(x + b(a(x))))
            y.pow(2).mean().backward()
            grads.append((a.weight.grad.clone(), b.weight.grad.clone()))
            a.zero_grad(), b.zero_grad()
        return grads, base._dense is not None

    cached, kept = run(True)
    uncached, kept_off = run(False)
    assert kept and not kept_off
    for (ga, gb), (ua, ub) in zip(cached, uncached):
        assert torch.equal(ga, ua) and torch.equal(gb, ub)
        assert ga.abs().sum() > 0 and gb.abs().sum() > 0, "the gradient reaches the adapters through the base"


# ----------------------------------------------------------------------------- invalidation
def _assert_rebuilt(layer: NVFP4Linear, x: torch.Tensor, before: torch.Tensor) -> None:
    """The output changed with the weights, and is what a fresh dequantization gives."""
    after = layer(x)
    assert not torch.equal(before, after)
    assert torch.equal(after, _uncached(layer, x))


def test_set_nvfp4_weight_changes_the_output():
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=5)
    before = layer(x)
    layer.set_nvfp4_weight(other.nvfp4_weight)
    _assert_rebuilt(layer, x, before)


def test_replaced_buffer_is_noticed():
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=6)
    layer(x)
    layer.weight_packed = other.weight_packed.clone()  # plain attribute assignment: no hook runs
    assert torch.equal(layer(x), _uncached(layer, x))
    layer.weight_scale = other.weight_scale.clone()
    layer.weight_global_scale = other.weight_global_scale.clone()
    assert torch.equal(layer(x), _uncached(layer, x))


def test_buffer_at_a_recycled_address_is_not_mistaken_for_the_old_one():
    """A new buffer at the address of the old one, once the old tensor is gone, with new content and the same version
    count: a cache keyed on (data_ptr, _version) would serve the old weight. The cache compares identities (weak
    references). The recycling is forced, not left to the allocator: the new tensor is ``set_`` onto the old one's
    storage (held alive on its own), so the case is tested on every machine."""
    for trial in range(3):
        layer, other = _layer(n=64, k=128, seed=0), _layer(n=64, k=128, seed=1)  # packed: 64 x 64 bytes
        x = _x(3, 128, seed=trial)
        with torch.no_grad():
            for _ in range(4):  # a version count above what set_ and one copy_ give the new tensor
                layer.weight_packed.add_(0)
        old_out = layer(x)  # the cache now holds the old weight
        ptr, version = layer.weight_packed.data_ptr(), layer.weight_packed._version
        storage = layer.weight_packed.untyped_storage()  # keeps the memory, not the tensor
        old_alive = weakref.ref(layer.weight_packed)
        fresh = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (64, 64))  # the same address
        with torch.no_grad():
            fresh.copy_(other.weight_packed)  # new content
            while fresh._version < version:
                fresh.add_(0)
        assert fresh.data_ptr() == ptr and fresh._version == version, (fresh._version, version)
        layer.weight_packed = fresh  # the old tensor object is freed here
        assert old_alive() is None, "something still holds the old buffer: the recycled case would not be tested"
        expected = _uncached(layer, x)
        assert not torch.equal(expected, old_out), "the two weights must give different outputs for the test to mean anything"
        assert torch.equal(layer(x), expected), f"served the old weight at a recycled address (trial {trial})"


@pytest.mark.parametrize("name", ["weight_packed", "weight_scale", "weight_global_scale"])
def test_in_place_write_is_noticed(name):
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=8)
    before = layer(x)
    with torch.no_grad():
        getattr(layer, name).copy_(getattr(other, name))
    _assert_rebuilt(layer, x, before)


def test_in_place_write_through_a_view_is_noticed():
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=9)
    before = layer(x)
    with torch.no_grad():
        layer.weight_packed[:5].copy_(other.weight_packed[:5])  # views share the version counter
    _assert_rebuilt(layer, x, before)


def test_write_through_data_needs_clear_cache():
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=10)
    layer(x)
    layer.weight_packed.data.copy_(other.weight_packed)  # `.data` bypasses the version counter (documented)
    layer.clear_cache()
    assert layer._dense is None
    assert torch.equal(layer(x), _uncached(layer, x))


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_state_dict_changes_the_output(assign):
    layer, other = _layer(seed=0), _layer(seed=1)
    x = _x(3, 64, seed=11)
    layer(x)
    layer.load_state_dict(other.state_dict(), assign=assign)
    assert layer._dense is None
    assert torch.equal(layer(x), other(x))


def test_dtype_and_device_moves_rebuild_the_cache():
    layer = _layer(dtype=torch.bfloat16)
    xb = _x(3, 64, dtype=torch.bfloat16, seed=12)
    layer(xb)
    layer.float()
    assert layer._dense is None
    x = _x(3, 64, seed=13)
    y = layer(x)
    assert layer._dense.dtype == torch.float32 and torch.equal(y, _uncached(layer, x))
    layer.to("cpu")  # a move, even to where it is, drops derived state
    assert layer._dense is None
    # an activation dtype other than the cached one rebuilds rather than mixing dtypes
    layer(x)
    assert torch.equal(layer(xb), _uncached(layer, xb)) and layer._dense.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- not in the saved state
def test_state_dict_is_unchanged_by_the_cache():
    layer = _layer()
    keys = list(layer.state_dict())
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(_x(3, 64, seed=14))
    assert layer._dense is not None
    state = layer.state_dict()
    assert list(state) == keys == ["weight_packed", "weight_scale", "weight_global_scale", "bias"]
    raw = lambda t: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # noqa: E731 (fp8 as bytes)
    for k, v in before.items():
        assert v.dtype == state[k].dtype and torch.equal(raw(v), raw(state[k])), k
    assert "_dense" not in dict(layer.named_buffers()) and not any(b is layer._dense for b in layer.buffers())


def test_pickle_and_deepcopy_drop_the_cache():
    layer = _layer()
    x = _x(3, 64, seed=15)
    y = layer(x)
    buffer = io.BytesIO()  # torch.save pickles the module (plain pickle.dumps cannot carry float8 tensors in torch 2.13)
    torch.save(layer, buffer)
    buffer.seek(0)
    for clone in (torch.load(buffer, weights_only=False), copy.deepcopy(layer)):
        assert clone._dense is None and clone._dense_sources is None
        assert torch.equal(clone(x), y)


# ----------------------------------------------------------------------------- where it is used
def test_kernel_path_never_caches():
    layer = _layer(dtype=torch.bfloat16, impl="kernel")  # on CPU: the Marlin-style oracle
    x = _x(3, 64, dtype=torch.bfloat16, seed=16)
    assert torch.equal(layer(x), nvfp4.reference_matmul(x, layer.nvfp4_weight, layer.bias))
    assert layer._dense is None


@pytest.mark.cuda
@pytest.mark.parametrize("impl", ["auto", "reference"])
def test_cuda_never_caches(impl):
    layer = _layer(dtype=torch.bfloat16, impl=impl)
    layer(_x(3, 64, dtype=torch.bfloat16))
    assert layer._dense is not None
    layer.cuda()
    assert layer._dense is None
    layer(_x(3, 64, dtype=torch.bfloat16).cuda())
    assert layer._dense is None


def test_opt_out_per_model_and_per_process():
    from qerl_lib.models.loader import replace_linear_with_nvfp4
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    model = replace_linear_with_nvfp4(AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval())
    ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(1))
    layers = nvfp4_modules(model)
    with torch.no_grad():
        cached = model(input_ids=ids).logits
        assert all(m._dense is not None for m in layers.values())
        assert set_cpu_cache(model, False) == len(layers) == 14
        assert all(m._dense is None for m in layers.values()), "turning it off frees the dense copies"
        assert torch.equal(model(input_ids=ids).logits, cached)
        assert all(m._dense is None for m in layers.values())
        set_cpu_cache(model, True)
        assert torch.equal(model(input_ids=ids).logits, cached)
        # the memory the docstring states: N x K x element size per layer, here fp32
        dense_bytes = sum(m._dense.numel() * m._dense.element_size() for m in layers.values())
        assert dense_bytes == 4 * sum(m.in_features * m.out_features for m in layers.values())
        # the class attribute is the process-wide default (an instance setting overrides it)
        for m in layers.values():
            del m.cpu_cache
        try:
            NVFP4Linear.cpu_cache = False
            model(input_ids=ids)
            assert all(m._dense is None for m in layers.values())
        finally:
            NVFP4Linear.cpu_cache = True
        model(input_ids=ids)
        assert all(m._dense is not None for m in layers.values())
