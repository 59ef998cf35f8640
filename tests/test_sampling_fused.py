"""The fused CUDA sampler (qerl_lib.engine.sampling.fused_sample) against the eager exponential race.

Both draw the token as ``argmax(softmax(logits / T) / E)`` for the same Exponential(1) draws ``E``;
the fused kernels compare ``logits / T - log E`` per block and combine blocks, which orders the
candidates the same way up to float32 rounding. On random logits (no near-ties) the tokens must be
identical and the logprobs agree to 1e-5 (summation order only). CPU, Triton interpreter
(subprocess); the same comparison on a GPU at Qwen2.5's vocabulary is marked ``cuda``.
"""

from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import requires_triton, run_triton_interpreter

SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qerl_lib.engine.sampling import fused_sample
    out = {}
    for rows, vocab, temperature, dtype in json.loads(sys.argv[1]):
        g = torch.Generator().manual_seed(vocab)
        logits = (torch.randn(rows, vocab, generator=g) * 3).to(getattr(torch, dtype))
        if vocab > 9000:
            logits[0, 4096:8192] = float("-inf")  # a whole block removed
        race = torch.empty(rows, vocab).exponential_(1.0, generator=g)
        race[0, 5] = 0.0  # a zero draw is clamped, not a division by zero
        tokens, logprobs = fused_sample(logits, race, temperature)
        lp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
        ref = (lp_all.exp() / race.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)
        out[f"{rows}-{vocab}-{temperature}-{dtype}"] = {
            "same_tokens": bool(torch.equal(tokens, ref)),
            "logprob_err": float((logprobs - lp_all.gather(-1, ref[:, None]).squeeze(-1)).abs().max()),
            "finite": bool(torch.isfinite(logprobs).all()), "dtype": str(tokens.dtype)}
    print("RESULTS " + json.dumps(out))
""")
CASES = [(3, 1000, 1.0, "float32"), (4, 10000, 0.7, "float32"), (2, 4096, 1.3, "bfloat16")]


@pytest.fixture(scope="module")
def interpreted():
    return run_triton_interpreter(SCRIPT, CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}x{c[1]}-T{c[2]}-{c[3]}")
def test_fused_sampler_matches_the_eager_race(interpreted, case):
    r = interpreted["-".join(map(str, case))]
    assert r["same_tokens"] and r["finite"] and r["dtype"] == "torch.int64", r
    assert r["logprob_err"] < 1e-5, r


@requires_triton
def test_fused_sampler_refuses_bad_shapes():
    from qerl_lib.engine import sampling

    assert sampling.triton is not None, "triton is installed but qerl_lib.engine.sampling did not import it"
    with pytest.raises(ValueError, match="fused_sample"):
        sampling.fused_sample(torch.zeros(2, 10), torch.zeros(2, 11))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_fused_sampler_matches_the_eager_race_at_qwen_vocab():
    from qerl_lib.engine.sampling import fused_sample

    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(8, 152064, generator=g, device="cuda") * 4
    race = torch.empty_like(logits).exponential_(1.0, generator=g)
    tokens, logprobs = fused_sample(logits, race, 1.0)
    lp_all = torch.log_softmax(logits, dim=-1)
    ref = (lp_all.exp() / race.clamp_min(torch.finfo(torch.float32).tiny)).argmax(-1)
    assert torch.equal(tokens, ref)
    torch.testing.assert_close(logprobs, lp_all.gather(-1, ref[:, None]).squeeze(-1), rtol=0, atol=1e-5)
