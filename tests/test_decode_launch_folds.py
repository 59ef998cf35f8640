"""Two launches the decode step folds into its neighbours (``engine/forward.py``'s docstring): x handed to the
Gluon FP4 GEMMs already in their K relabeling (``fp4_linear(..., x_relabeled=)``; the norms, SiLU x up and
attention write that copy), and a K-split FP4 GEMM's partials summed by the LoRA expand kernel
(``fp4_linear(..., defer_reduce=)``, ``kernels/lora.expand_(..., base=)``).

* CPU: ``fp4_linear`` refuses a copy of the wrong shape with a message; ``takes_relabeled_x`` says no where
  no Gluon launch runs (the mma.sync rows, no GPU).
* CUDA (Hopper, Gluon): on Qwen2.5-7B shapes at the decode rows where Gluon launches run, the GEMM given the
  copy is bit-equal to the GEMM that permutes x itself; the GEMM whose partials the expand sums gives the bits
  of the GEMM + reduction + expand; the engine's greedy rollouts at batch 32 and 64, with LoRA r16 adapters,
  are bit-identical with either fold on or off (``QERL_FP4_RELABEL_X``, ``QERL_LORA_SUMS_SPLITS``), and with
  them on the engine launches fewer permutes and reductions.
"""

from __future__ import annotations

import pytest
import torch

from qerl_lib.kernels import fp4_wgmma

HAS_GLUON_GPU = torch.cuda.is_available() and fp4_wgmma.available()
needs_gluon = pytest.mark.skipif(not HAS_GLUON_GPU, reason="needs a Hopper GPU (sm_90) and Triton's Gluon")


def _weight(n: int, k: int, device: str, seed: int = 0):
    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize

    g = torch.Generator(device=device).manual_seed(seed)
    q = quantize((torch.randn(n, k, generator=g, device=device) * 0.02).to(torch.bfloat16))
    return prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)


def test_a_relabeled_copy_of_the_wrong_shape_is_refused():
    from qerl_lib.kernels.fp4_gemm import fp4_linear

    w = _weight(64, 256, "cpu")
    x = torch.randn(4, 256).to(torch.bfloat16)
    for bad in (torch.zeros(4, 128, dtype=torch.bfloat16), torch.zeros(4, 256), torch.zeros(256, 4, dtype=torch.bfloat16).t()):
        with pytest.raises(ValueError, match="x_relabeled must be a contiguous"):
            fp4_linear(x, w, x_relabeled=bad)


def test_no_relabeled_copy_where_no_gluon_launch_runs():
    from qerl_lib.kernels.fp4_gemm import takes_relabeled_x

    w = _weight(4608, 3584, "cpu")
    assert not takes_relabeled_x(0, w, torch.device("cpu"))
    assert not takes_relabeled_x(64, w, torch.device("cpu"))  # no GPU: Triton / reference paths only


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("rows", [24, 32, 48, 64, 96, 128])
@pytest.mark.parametrize("n,k", [(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)],
                         ids=["qkv", "o", "gate_up", "down"])
def test_cuda_gemm_given_the_copy_equals_the_gemm_that_permutes(rows, n, k):
    from qerl_lib.kernels.fp4_gemm import fp4_linear, takes_relabeled_x

    w = _weight(n, k, "cuda", seed=rows)
    x = torch.randn(rows, k, device="cuda").to(torch.bfloat16)
    plain = fp4_linear(x, w)
    if not takes_relabeled_x(rows, w, x.device):
        assert torch.equal(fp4_linear(x, w, x_relabeled=torch.zeros_like(x)), plain)  # ignored off Gluon
        return
    assert torch.equal(fp4_linear(x, w, x_relabeled=fp4_wgmma.permute_x(x)), plain)
    assert not torch.equal(fp4_linear(x, w, x_relabeled=x.contiguous()), plain)  # the copy is what it reads


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("rows", [16, 24, 32, 48, 64])
@pytest.mark.parametrize("members,k", [((3584, 512, 512), 3584), ((3584,), 3584), ((3584,), 18944)],
                         ids=["qkv", "o", "down"])
def test_cuda_expand_summing_the_partials_equals_reduction_then_expand(rows, members, k):
    from qerl_lib.kernels import lora as lk
    from qerl_lib.kernels.fp4_gemm import fp4_linear
    from tests.test_lora_kernels import make_group

    plan, x, _ = make_group(rows, k, [(n, 16, 2.0) for n in members], torch.bfloat16, "cuda", seed=rows)
    w = _weight(sum(members), k, "cuda", seed=rows + k)
    deferred = []
    out = fp4_linear(x, w, defer_reduce=deferred)
    ref = lk.apply_(fp4_linear(x, w), x, plan)
    one_launch = len(deferred) == 1
    if one_launch:  # the expand sums any number of slices with the reduction's bits (7-10 at q/k/v, o)
        ws, gs, bias, _ = deferred[0]
        assert torch.equal(lk.apply_(torch.empty_like(out), x, plan, base=lk.SplitBase(ws, gs, bias)), ref)
    base = lk.split_base(deferred, out)  # the engine's rule: the expand takes at most EXPAND_SUMS_SLICES_UP_TO
    assert (base is not None) == (one_launch and deferred[0][0].shape[0] <= lk.EXPAND_SUMS_SLICES_UP_TO)
    got = lk.apply_(out, x, plan, base=base)
    assert torch.equal(got, ref)
    if rows in (32, 64) and k == 18944:
        assert base is not None, "the down projection splits K at 32 and 64 rows"


def _qwen7b_layers_nvfp4(layers: int = 2):
    """Random-weight Qwen2.5-7B shapes (hidden 3584, 28 heads, 4 KV heads, intermediate 18944), ``layers`` deep,
    NVFP4 on the GPU: the shapes where the decode rule runs the Gluon kernels."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from qerl_lib.models.loader import replace_linear_with_nvfp4

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=512, hidden_size=3584, intermediate_size=18944, num_hidden_layers=layers,
                      num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=256, eos_token_id=2,
                      bos_token_id=1, pad_token_id=0, initializer_range=0.02, tie_word_embeddings=False)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg).bfloat16().eval()
    return replace_linear_with_nvfp4(model)


@pytest.mark.cuda
@needs_gluon
@pytest.mark.parametrize("batch", [32, 64])
def test_cuda_engine_rollouts_equal_with_and_without_the_folds(monkeypatch, batch):
    from qerl_lib.engine.rollout import RolloutEngine
    from tests.test_lora_kernels import cuda_adapters

    model = _qwen7b_layers_nvfp4()
    adapters = cuda_adapters(model, 16)
    g = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, 512, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (batch,), generator=g)]
    from qerl_lib.kernels import fp4_gemm

    calls = {"permute": 0, "reduce": 0}
    real_permute, real_reduce = fp4_wgmma.permute_x, fp4_gemm.reduce_splits

    def permute(x2):
        calls["permute"] += 1
        return real_permute(x2)

    def reduce(*job):
        calls["reduce"] += 1
        return real_reduce(*job)

    monkeypatch.setattr(fp4_wgmma, "permute_x", permute)
    monkeypatch.setattr("qerl_lib.kernels.fp4_wgmma_producer.permute_x", permute)
    monkeypatch.setattr(fp4_gemm, "reduce_splits", reduce)
    runs, counts = {}, {}
    for relabel, sums in (("1", "1"), ("0", "1"), ("1", "0")):
        monkeypatch.setenv("QERL_FP4_RELABEL_X", relabel)
        monkeypatch.setenv("QERL_LORA_SUMS_SPLITS", sums)
        calls.update(permute=0, reduce=0)
        engine = RolloutEngine(model)
        runs[relabel + sums] = engine.generate(prompts, 16, temperature=0, stop_token_ids=[], lora=adapters)
        assert engine._forward.takes_relabeled(0, "gate_up", batch) == (relabel == "1")
        counts[relabel + sums] = dict(calls)
        engine.release()
    for other in ("01", "10"):
        for a, b in zip(runs["11"], runs[other]):
            assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert counts["11"]["permute"] < counts["01"]["permute"], counts
    assert counts["11"]["reduce"] < counts["10"]["reduce"], counts
