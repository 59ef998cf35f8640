"""The fused training RMSNorm and SiLU x up (`train.fused_layers`): forward and backward against transformers'
modules under autograd on fresh random inputs (in the Triton interpreter on CPUs, in bf16 on a GPU), the class swap
on a model (same loss and adapter gradients with and without it), and the fallbacks.

Tolerances. float32: 1e-5 relative (row sums in another order). float16 / bfloat16: the norm may differ from torch by
one rounding step on some elements (its row sums): normwise within a quarter unit, on < 5% of the elements; SiLU x up is
elementwise: outputs and gradients within two units (exp's rounding, carried through the product), on < 1%."""

from __future__ import annotations

import copy
import inspect
import pickle
import textwrap

import pytest
import torch

from qerl_lib.train import fused_layers
from tests.conftest import run_triton_interpreter

CONFIG = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=True)

def compare(fused, torch_, dtype):
    """Normwise relative error, the largest error in units of the last place, and the share of elements that differ."""
    import torch  # the interpreter script carries this function's source (COMPARE)
    a, b = fused.double(), torch_.double()
    info = torch.finfo(dtype)  # one unit in the last place at the larger magnitude of the two (subnormals: tiny's)
    exponent = torch.frexp(torch.maximum(a.abs(), b.abs()).clamp_min(info.tiny)).exponent
    ulp = torch.ldexp(torch.ones_like(b), exponent - 1) * info.eps
    return {"rel": float((a - b).norm() / b.norm().clamp_min(1e-30)), "units": float(((a - b).abs() / ulp).max()),
            "differ": float((a != b).float().mean()), "eps": torch.finfo(dtype).eps}


COMPARE = inspect.getsource(compare)

INTERP_SCRIPT = COMPARE + textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
    from qerl_lib.train import fused_layers
    out = {}
    for dtype_name, rows, width in json.loads(sys.argv[1]):
        dt = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(rows * width)
        x = (2 * torch.randn(rows, width, generator=g)).to(dt)
        dy = torch.randn(rows, width, generator=g).to(dt)
        norm = Qwen2RMSNorm(width, eps=1e-6).to(dt)
        with torch.no_grad():
            norm.weight.copy_(1 + 0.3 * torch.randn(width, generator=g))
        xt, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
        y_torch = norm(xt)
        y_torch.backward(dy)
        norm.weight.requires_grad_(False)
        y_fused = fused_layers.rms_norm(xf, norm.weight, 1e-6)
        y_fused.backward(dy)
        case = {"norm_out": compare(y_fused.detach(), y_torch.detach(), dt), "norm_dx": compare(xf.grad, xt.grad, dt)}
        norm.weight.requires_grad_(True)  # a trainable weight (train_norms): dw too
        norm.weight.grad = None
        y_torch = norm(x)
        y_torch.backward(dy)
        dw_torch = norm.weight.grad.clone()
        norm.weight.grad = None
        fused_layers.rms_norm(x, norm.weight, 1e-6).backward(dy)
        case["norm_dw"] = compare(norm.weight.grad, dw_torch, dt)
        gate, up = (torch.randn(rows, width, generator=g).mul(3).to(dt) for _ in range(2))
        gt, ut, gf, uf = (t.clone().requires_grad_() for t in (gate, up, gate, up))
        o_torch = torch.nn.functional.silu(gt) * ut
        o_torch.backward(dy)
        o_fused = fused_layers.silu_mul(gf, uf)
        o_fused.backward(dy)
        case.update(silu_out=compare(o_fused.detach(), o_torch.detach(), dt), silu_dg=compare(gf.grad, gt.grad, dt),
                    silu_du=compare(uf.grad, ut.grad, dt))
        out[f"{dtype_name}-{rows}-{width}"] = case
    print("RESULTS " + json.dumps(out))
""")

CASES = [("float32", 5, 3584), ("float32", 7, 200), ("float16", 6, 3584), ("float16", 9, 1000)]


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(INTERP_SCRIPT, CASES)


def _check(result: dict, dtype: str, elementwise: bool):
    """float32: normwise 1e-5. Half types: an elementwise op within two units on < 1% of the elements (exp may round
    silu(gate) one unit apart, and the product with up carries that unit on); the norm (its
    row sums run in another order; its dx can cancel, so no per-element bound) normwise within a quarter unit and
    differing on < 5% of the elements."""
    if dtype == "float32":
        assert result["rel"] < 1e-5, result
    elif elementwise:
        assert result["units"] <= 2 and result["differ"] < 0.01, result
    else:
        assert result["rel"] < result["eps"] / 4 and result["differ"] < 0.05, result


@pytest.mark.parametrize("dtype,rows,width", CASES)
def test_kernels_match_transformers_autograd_in_the_interpreter(interpreted, dtype, rows, width):
    case = interpreted[f"{dtype}-{rows}-{width}"]
    for key in ("norm_out", "norm_dx"):
        _check(case[key], dtype, elementwise=False)
    tolerance = 1e-5 if dtype == "float32" else case["norm_dw"]["eps"]  # torch rounds each product before the sum
    assert case["norm_dw"]["rel"] < tolerance, case["norm_dw"]
    for key in ("silu_out", "silu_dg", "silu_du"):
        _check(case[key], dtype, elementwise=True)


MODEL_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from qerl_lib.models import lora
    from qerl_lib.train import fused_layers
    config = json.loads(sys.argv[1])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen2Config(**config), dtype=torch.float32)
    counts = fused_layers.use_fused_layers(model)
    policy = lora.attach_lora(model, rank=4)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in policy.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    policy.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.train()
    ids = torch.randint(0, config["vocab_size"], (2, 10), generator=g)
    result = {"counts": counts}
    for switch in ("1", "0"):
        os.environ["QERL_FUSED_LAYERS"] = switch
        policy.zero_grad(set_to_none=True)
        loss = policy(input_ids=ids, labels=ids).loss
        loss.backward()
        result[switch] = {"loss": loss.item(),
                          "grads": {n: p.grad.double() for n, p in policy.named_parameters() if p.requires_grad}}
    worst = max(float((result["1"]["grads"][n] - g0).norm() / g0.norm()) for n, g0 in result["0"]["grads"].items())
    print("RESULTS " + json.dumps({"counts": counts, "loss": [result["1"]["loss"], result["0"]["loss"]],
                                   "worst_grad_rel": worst, "n_grads": len(result["0"]["grads"])}))
""")


def test_swapped_model_trains_like_transformers_in_the_interpreter():
    """A two-layer Qwen2 with LoRA and gradient checkpointing, float32: the loss and every adapter gradient with the
    fused layers against transformers' own forward (QERL_FUSED_LAYERS=0) on the same model."""
    r = run_triton_interpreter(MODEL_SCRIPT, CONFIG, timeout=600)
    layers = CONFIG["num_hidden_layers"]
    assert r["counts"] == {"norms": 2 * layers + 1, "mlps": layers, "attentions": layers}
    assert abs(r["loss"][0] - r["loss"][1]) < 1e-5 * abs(r["loss"][1])
    assert r["n_grads"] == 2 * 7 * CONFIG["num_hidden_layers"] and r["worst_grad_rel"] < 1e-4


def _tiny():
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(Qwen2Config(**CONFIG), dtype=torch.float32)


def test_swap_keeps_names_and_cpu_outputs_and_is_idempotent():
    model, plain = _tiny(), _tiny()
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(2))
    counts = fused_layers.use_fused_layers(model)
    layers = CONFIG["num_hidden_layers"]
    assert counts == {"norms": 2 * layers + 1, "mlps": layers, "attentions": layers}
    assert type(model.model.norm).__name__ == "FusedQwen2RMSNorm"
    assert isinstance(model.model.layers[0].mlp, type(plain.model.layers[0].mlp))
    assert model.state_dict().keys() == plain.state_dict().keys()
    with torch.no_grad():  # no CUDA, no interpreter: transformers' own forward, bit for bit
        assert torch.equal(model(input_ids=ids).logits, plain(input_ids=ids).logits)
    assert fused_layers.use_fused_layers(model) == {"norms": 0, "mlps": 0, "attentions": 0}
    clone = copy.deepcopy(model)
    assert type(clone.model.layers[1].input_layernorm) is type(model.model.layers[1].input_layernorm)
    restored = pickle.loads(pickle.dumps(model.model.layers[0]))  # the made classes are found by name
    assert type(restored.mlp) is type(model.model.layers[0].mlp)


ROTARY_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2
    from qerl_lib.train import fused_layers
    original = modeling_qwen2.apply_rotary_pos_emb
    out = {}
    for dtype_name, batch, heads, kv_heads, positions, width, shared in json.loads(sys.argv[1]):
        dt = getattr(torch, dtype_name)
        g = torch.Generator().manual_seed(batch * positions + width)
        config = Qwen2Config(hidden_size=heads * width, num_attention_heads=heads, num_key_value_heads=kv_heads)
        rope = modeling_qwen2.Qwen2RotaryEmbedding(config)
        ids = torch.arange(positions).repeat(1 if shared else batch, 1) + torch.randint(0, 50, (1, 1), generator=g)
        x = torch.randn(batch, positions, heads * width, generator=g).to(dt)
        cos, sin = rope(x, ids)
        # q and k as the attention makes them: [B, L, H, D] in memory, seen as [B, H, L, D]
        q0 = (3 * torch.randn(batch, positions, heads, width, generator=g)).to(dt).transpose(1, 2)
        k0 = (3 * torch.randn(batch, positions, kv_heads, width, generator=g)).to(dt).transpose(1, 2)
        dq, dk = (torch.randn(t.shape, generator=g).to(dt) for t in (q0, k0))
        results = []
        for fn in (original, fused_layers.rotary):
            q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
            qe, ke = fn(q, k, cos, sin)
            torch.autograd.backward((qe, ke), (dq, dk))
            results.append((qe.detach(), ke.detach(), q.grad, k.grad, qe.stride() == q0.stride()))
        (a, b) = results
        out[f"{dtype_name}-{batch}-{heads}-{kv_heads}-{positions}-{width}-{shared}"] = {
            "equal": [bool(torch.equal(x, y)) for x, y in zip(a[:4], b[:4])], "layout_kept": b[4],
            "fits": fused_layers.rotary_fits(q0, k0, cos, sin)}
    # the dispatcher: kernels only inside a swapped model's attention forward
    calls = []
    apply = fused_layers._Rotary.apply
    fused_layers._Rotary.apply = lambda *a: calls.append(1) or apply(*a)
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    swapped = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    swapped.load_state_dict(plain.state_dict())
    ids = torch.randint(0, 64, (2, 9))
    before = plain(input_ids=ids).logits  # transformers' function, not yet replaced
    fused_layers.use_fused_layers(swapped)
    after = plain(input_ids=ids).logits
    plain_calls = len(calls)
    fused = swapped(input_ids=ids).logits
    swapped_calls = len(calls) - plain_calls
    os.environ["QERL_FUSED_ROTARY"] = "0"  # the rotary kernel alone off: transformers' function, the norms fused
    unrotated = swapped(input_ids=ids).logits
    del os.environ["QERL_FUSED_ROTARY"]
    out["dispatch"] = {"plain_calls": plain_calls, "swapped_calls": swapped_calls,
                       "switched_off_calls": len(calls) - plain_calls - swapped_calls,
                       "switched_off_rel": float((unrotated - before).norm() / before.norm()),
                       "plain_unchanged": bool(torch.equal(before, after)),
                       "swapped_rel": float((fused - before).norm() / before.norm()),
                       "original_kept": modeling_qwen2.apply_rotary_pos_emb.qerl_original is original}
    print("RESULTS " + json.dumps(out))
""")
# float16 and float32 only: the interpreter's float32 -> bfloat16 cast does not round to nearest (seen here: ~half
# of random values a unit off), so bfloat16 is compared on a GPU (test_cuda_rotary_bf16_bit_for_bit)
ROTARY_CASES = [("float16", 2, 4, 2, 7, 16, False), ("float16", 1, 3, 1, 5, 32, True),
                ("float32", 2, 6, 2, 4, 8, True), ("float16", 1, 28, 4, 3, 128, True)]


def test_rotary_matches_transformers_bit_for_bit_in_the_interpreter():
    """`rotary` against transformers' `apply_rotary_pos_emb` under autograd: outputs and the gradients of q and k
    equal bit for bit (elementwise, the same roundings; the interpreter has no fused multiply-add), on the attention's
    transposed layout, which the outputs keep; heads that are not a power of two (3, 6, 28 padded); cos and sin per
    sequence or shared. The dispatcher takes the kernels in a swapped model's attention only, an unswapped model keeps
    its exact logits, and the swapped model's are within float32 rounding of them; ``QERL_FUSED_ROTARY=0`` sends the
    swapped model's calls back to transformers' function."""
    r = run_triton_interpreter(ROTARY_SCRIPT, ROTARY_CASES)
    for case in ROTARY_CASES:
        result = r["-".join(str(v) for v in case)]
        assert result["fits"] and result["layout_kept"] and all(result["equal"]), (case, result)
    d = r["dispatch"]
    assert d["plain_calls"] == 0 and d["swapped_calls"] == 2 and d["original_kept"], d
    assert d["switched_off_calls"] == 0 and d["switched_off_rel"] < 1e-5, d  # QERL_FUSED_ROTARY=0
    assert d["plain_unchanged"] and d["swapped_rel"] < 1e-5, d  # the fused norms' row sums: float32 order only


def test_bad_inputs_name_the_rule():
    x = torch.randn(2, 8)
    with pytest.raises(ValueError, match=r"rms_norm: the weight must be \[8\] in torch.float32"):
        fused_layers.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="silu_mul: gate .* and up .* differ"):
        fused_layers.silu_mul(x, torch.randn(2, 9))
    q, k, cos = torch.randn(1, 2, 3, 12), torch.randn(1, 1, 3, 12), torch.randn(1, 3, 12)
    with pytest.raises(ValueError, match="rotary: .* power-of-two half"):  # a half of 6
        fused_layers.rotary(q, k, cos, cos)
    assert not fused_layers.rotary_fits(q[..., :8], k[..., :8], cos[..., :8].requires_grad_(), cos[..., :8])


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("rows,width", [(37, 3584), (300, 5120), (5, 18944)])
def test_cuda_bf16_against_transformers_autograd(rows, width):
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    dt = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(rows)
    x, dy, gate, up = ((2 * torch.randn(rows, width, generator=g, device="cuda")).to(dt) for _ in range(4))
    norm = Qwen2RMSNorm(width).to("cuda", dt)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.3 * torch.randn(width, generator=g, device="cuda"))
    norm.weight.requires_grad_(False)
    xt, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    norm(xt).backward(dy)
    y = fused_layers.rms_norm(xf, norm.weight, norm.variance_epsilon)
    y.backward(dy)
    _check(compare(y.detach(), norm(x).detach(), dt), "bfloat16", elementwise=False)
    _check(compare(xf.grad, xt.grad, dt), "bfloat16", elementwise=False)
    gt, ut, gf, uf = (t.clone().requires_grad_() for t in (gate, up, gate, up))
    o_torch = torch.nn.functional.silu(gt) * ut
    o_torch.backward(dy)
    o = fused_layers.silu_mul(gf, uf)
    o.backward(dy)
    for fused, ref in ((o.detach(), o_torch.detach()), (gf.grad, gt.grad), (uf.grad, ut.grad)):
        _check(compare(fused, ref, dt), "bfloat16", elementwise=True)


@pytest.mark.cuda
@CUDA
@pytest.mark.parametrize("batch,heads,kv_heads,positions,shared", [(2, 28, 4, 301, True), (3, 40, 8, 64, False)])
def test_cuda_rotary_bf16_bit_for_bit(batch, heads, kv_heads, positions, shared):
    """bf16 at Qwen2.5-7B's and 14B's heads (head_dim 128), on the attention's layout: outputs and gradients equal
    transformers' `apply_rotary_pos_emb` under autograd bit for bit."""
    from transformers import Qwen2Config
    from transformers.models.qwen2 import modeling_qwen2

    original = getattr(modeling_qwen2.apply_rotary_pos_emb, "qerl_original", modeling_qwen2.apply_rotary_pos_emb)
    dt, width = torch.bfloat16, 128
    g = torch.Generator(device="cuda").manual_seed(positions)
    rope = modeling_qwen2.Qwen2RotaryEmbedding(Qwen2Config(hidden_size=heads * width, num_attention_heads=heads,
                                                           num_key_value_heads=kv_heads)).cuda()
    ids = torch.arange(positions, device="cuda").repeat(1 if shared else batch, 1) + 17
    cos, sin = rope(torch.empty(batch, positions, 1, dtype=dt, device="cuda"), ids)
    q0 = (3 * torch.randn(batch, positions, heads, width, generator=g, device="cuda")).to(dt).transpose(1, 2)
    k0 = (3 * torch.randn(batch, positions, kv_heads, width, generator=g, device="cuda")).to(dt).transpose(1, 2)
    dq, dk = (torch.randn(t.shape, generator=g, device="cuda").to(dt) for t in (q0, k0))
    results = []
    for fn in (original, fused_layers.rotary):
        q, k = q0.clone().requires_grad_(), k0.clone().requires_grad_()
        qe, ke = fn(q, k, cos, sin)
        torch.autograd.backward((qe, ke), (dq, dk))
        results.append((qe.detach(), ke.detach(), q.grad, k.grad))
    assert results[1][0].stride() == q0.stride()
    assert all(torch.equal(a, b) for a, b in zip(*results))
