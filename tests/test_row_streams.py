"""Per-row random streams (engine/sampling.py, "Per-row streams") and the engine's ``row_seeds``.

The contract: row r's draws at decode position t depend on its seed and t only. So a completion does
not change when the rest of the batch does (other prompts, their order, how many), which is what lets
one GPU and two GPUs sample the same rollouts. The CUDA stream is a hash: it is checked here against
Exponential(1) (moments, quantiles), for independence across rows, positions and vocabulary entries,
for sampling softmax(logits) at the right frequencies, and its Triton kernel against the plain-torch
reference under the Triton interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.engine.sampling import RowStreams, SamplingParams, hashed_exponentials, sample
from tests.test_engine import tiny_model

SEEDS = [0, 1, 2**32 - 1, 2**32, 2**63 + 12345, 2**64 - 1, 987654321987654321]


def _keys(seeds):
    return torch.tensor([[s & 0xFFFFFFFF, s >> 32] for s in seeds], dtype=torch.int64)


# ----------------------------------------------------------------------------- the hash as a distribution
def test_hashed_draws_are_exponential_1():
    draws = hashed_exponentials(_keys(range(64)), position=3, vocab=8192).double().flatten()  # 524288 draws
    n = draws.numel()
    assert torch.isfinite(draws).all() and (draws > 0).all()
    assert abs(draws.mean() - 1) < 5 / math.sqrt(n), "mean of Exp(1) is 1 (sd 1/sqrt(n))"
    assert abs(draws.var() - 1) < 5 * math.sqrt(8 / n), "variance of Exp(1) is 1 (sd ~ sqrt(8/n))"
    for q in (0.001, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999):  # P(E <= -log(1-q)) = q
        share = float((draws <= -math.log1p(-q)).double().mean())
        assert abs(share - q) < 5 * math.sqrt(q * (1 - q) / n), (q, share)


@pytest.mark.parametrize("seeds", [range(512), [s << 32 for s in range(512)]], ids=["low-half", "high-half"])
def test_every_vocabulary_entry_is_exponential_on_its_own(seeds):
    """Per entry over 512 rows: mean 1 within 6 sd. (An earlier key schedule hashed entry 0 of every
    seed below 2^32 to the same tiny draw, so that token always won: invisible in pooled moments.)"""
    draws = hashed_exponentials(_keys(seeds), 0, 512).double()
    means = draws.mean(dim=0)
    assert ((means - 1).abs() < 6 / math.sqrt(512)).all(), means.sub(1).abs().max()
    assert (draws.std(dim=0) > 0.5).all()


@pytest.mark.parametrize("axis", ["vocabulary", "rows", "positions"])
def test_hashed_draws_are_uncorrelated_along_every_axis(axis):
    keys = _keys(range(1000, 1256))
    if axis == "positions":  # the same rows and entries at consecutive positions
        a = hashed_exponentials(keys, 7, 2048).flatten()
        b = hashed_exponentials(keys, 8, 2048).flatten()
    else:
        x = hashed_exponentials(keys, 7, 2048)
        a, b = (x[:, :-1], x[:, 1:]) if axis == "vocabulary" else (x[:-1], x[1:])
        a, b = a.flatten(), b.flatten()
    u, v = (1 - torch.exp(-a.double())), (1 - torch.exp(-b.double()))  # back to uniforms
    r = float(torch.corrcoef(torch.stack([u, v]))[0, 1])
    assert abs(r) < 5 / math.sqrt(u.numel()), (axis, r)
    assert not torch.equal(a, b)


def test_hashed_draws_depend_on_seed_and_position_only():
    keys = _keys(SEEDS)
    full = hashed_exponentials(keys, 11, 300)
    assert torch.equal(full, hashed_exponentials(keys, 11, 300)), "deterministic"
    sub = [5, 0, 3]
    assert torch.equal(hashed_exponentials(keys[sub], 11, 300), full[sub]), "a row does not see the others"
    assert torch.equal(hashed_exponentials(keys, 11, 100), full[:, :100]), "nor the vocabulary size"
    assert not torch.equal(hashed_exponentials(keys, 12, 300), full)
    hi_only = _keys([2**32 + 5, 2 * 2**32 + 5])  # same low half, different high halves
    x = hashed_exponentials(hi_only, 0, 300)
    assert not torch.equal(x[0], x[1]), "both halves of the 64-bit seed matter"


def test_sampling_from_hashed_draws_matches_softmax():
    """20000 independent rows sample one distribution: token frequencies within 5 sd of softmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0, 1.5, 0.25])
    probs = torch.softmax(logits / 0.7, dim=-1)
    rows = 20000
    race = hashed_exponentials(_keys(range(rows)), 0, 8)
    tokens, logprobs = sample(logits.expand(rows, 8), SamplingParams(temperature=0.7), race=race)
    counts = torch.bincount(tokens, minlength=8).double() / rows
    sd = torch.sqrt(probs.double() * (1 - probs.double()) / rows)
    assert ((counts - probs.double()).abs() < 5 * sd).all(), (counts, probs)
    assert torch.allclose(logprobs, torch.log(probs)[tokens])


def test_triton_kernel_equals_the_reference():
    script = r"""
import json, sys, torch
from qerl_lib.engine import sampling
seeds = json.loads(sys.argv[1])["seeds"]
keys = torch.tensor([[s & 0xFFFFFFFF, s >> 32] for s in seeds], dtype=torch.int64)
out = {}
for position, vocab in [(0, 1000), (5, 2500), (123456, 777)]:
    ref = sampling.hashed_exponentials(keys, position, vocab)
    got = torch.empty(len(seeds), vocab, dtype=torch.float32)
    sampling._row_exponentials_kernel[(len(seeds), -(-vocab // 256))](
        keys, got, vocab, (position * sampling._GOLDEN) & sampling._M32, keys, PER_ROW=False, BLOCK=256)
    rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
    out[f"{position}/{vocab}"] = [rel, (got == ref).double().mean().item()]
positions = torch.arange(len(seeds), dtype=torch.int64) * 977 + 3  # one position per row
ref = sampling.hashed_exponentials(keys, positions, 1000)
got = torch.empty(len(seeds), 1000, dtype=torch.float32)
sampling._row_exponentials_kernel[(len(seeds), 4)](keys, got, 1000, 0, positions, PER_ROW=True, BLOCK=256)
rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()
out["per-row"] = [rel, (got == ref).double().mean().item()]
print("RESULTS " + json.dumps(out))
"""
    from tests.conftest import run_triton_interpreter

    out = run_triton_interpreter(script, {"seeds": SEEDS})
    for case, (rel, equal) in out.items():
        # the integer hash is exact (a wrong bit anywhere would be an O(1) error); the final float32 log
        # may differ by an ulp between numpy's and torch's
        assert rel < 1e-6 and equal > 0.5, (case, rel, equal)


# ----------------------------------------------------------------------------- RowStreams on CPU
def test_cpu_streams_are_per_row_and_in_order():
    a = RowStreams([11, 22, 33], "cpu")
    b = RowStreams([33, 11], "cpu")
    for position in range(3):
        x, y = a.exponentials(50, position), b.exponentials(50, position)
        assert torch.equal(x[2], y[0]) and torch.equal(x[0], y[1])
        assert not torch.equal(x[0], x[1])
    with pytest.raises(RuntimeError, match="row 0 is at position 3, asked for 5"):
        a.exponentials(50, 5)


def test_cpu_streams_reseed_and_draw_for_some_rows():
    """What continuous batching does with a slot: draw for a subset of rows at their own positions, and
    reseed a row, which then restarts its new seed's stream at position 0."""
    a = RowStreams([11, 22, 33], "cpu")
    fresh = RowStreams([44], "cpu")
    a.exponentials(40, 0)
    got = a.exponentials(40, torch.tensor([1, 1]), rows=[2, 0])
    assert torch.equal(got[0], _nth_draw(33, 1, 40)) and torch.equal(got[1], _nth_draw(11, 1, 40))
    a.reseed([2], [44])
    assert torch.equal(a.exponentials(40, 0, rows=[2])[0], fresh.exponentials(40, 0)[0])
    both = a.exponentials(40, torch.tensor([2, 1, 1]))  # row 0 at 2, row 1 still at 1, row 2 (reseeded) at 1
    assert torch.equal(both[0], _nth_draw(11, 2, 40)) and torch.equal(both[2], fresh.exponentials(40, 1)[0])
    with pytest.raises(RuntimeError, match="row 1 is at position 2, asked for 5"):
        a.exponentials(40, 5, rows=[1])
    with pytest.raises(ValueError, match="rows must be in"):
        a.reseed([3], [1])


def _nth_draw(seed: int, n: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        torch.empty(vocab).exponential_(1.0, generator=g)
    return torch.empty(vocab).exponential_(1.0, generator=g)


def test_hashed_draws_at_per_row_positions_are_each_rows_own():
    keys = _keys(SEEDS)
    positions = torch.tensor([0, 5, 123456, 5, 2**31 - 1, 9, 0])
    got = hashed_exponentials(keys, positions, 300)
    for r, p in enumerate(positions.tolist()):
        assert torch.equal(got[r], hashed_exponentials(keys[r:r + 1], p, 300)[0]), r


@pytest.mark.parametrize("seeds, message", [([-1], r"\[0, 2\^64\)"), ([2**64], r"\[0, 2\^64\)")])
def test_bad_seeds_are_one_line(seeds, message):
    with pytest.raises(ValueError, match=message):
        RowStreams(seeds, "cpu")


def test_a_given_race_is_what_sample_uses():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.0, top_k=20)
    race = torch.empty(4, 64).exponential_(generator=torch.Generator().manual_seed(2))
    assert torch.equal(sample(logits, params, race=race)[0], sample(logits, params, torch.Generator().manual_seed(2))[0])
    with pytest.raises(ValueError, match="race must be float32"):
        sample(logits, params, race=race[:2])


# ----------------------------------------------------------------------------- the engine's row_seeds
@pytest.fixture(scope="module")
def engine():
    return RolloutEngine(tiny_model("qwen2"))


def test_a_completion_does_not_depend_on_the_rest_of_the_batch(engine):
    prompts = [[5, 7, 9, 11], [3, 4, 6, 8], [100, 20, 30, 40], [8, 9, 10, 12]]  # equal lengths: no padding
    seeds = [101, 202, 303, 404]
    kw = dict(max_new_tokens=16, temperature=1.0, stop_token_ids=[])
    full = engine.generate(prompts, row_seeds=seeds, **kw)
    order = [3, 0, 2]
    part = engine.generate([prompts[i] for i in order], row_seeds=[seeds[i] for i in order], **kw)
    for got, i in zip(part, order):
        assert got.token_ids == full[i].token_ids
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(full[i].logprobs), atol=1e-5)
    alone = engine.generate([prompts[1]], row_seeds=[seeds[1]], **kw)[0]
    assert alone.token_ids == full[1].token_ids
    same_prompt = engine.generate([prompts[0]] * 2, row_seeds=[1, 2], **kw)
    assert same_prompt[0].token_ids != same_prompt[1].token_ids, "a group's rows differ by their seeds"


def test_row_seeds_errors(engine):
    with pytest.raises(ValueError, match="not both"):
        engine.generate([[1, 2]], 4, seed=0, row_seeds=[0])
    with pytest.raises(ValueError, match="2 seeds for 1 prompts"):
        engine.generate([[1, 2]], 4, row_seeds=[0, 1])


def test_greedy_ignores_row_seeds(engine):
    kw = dict(max_new_tokens=8, temperature=0.0, stop_token_ids=[])
    assert engine.generate([[5, 6, 7]], row_seeds=[3], **kw)[0].token_ids == \
        engine.generate([[5, 6, 7]], **kw)[0].token_ids


@pytest.mark.cuda
def test_cuda_streams_follow_the_reference_and_the_batch_does_not_matter():
    seeds = SEEDS
    streams = RowStreams(seeds, "cuda")
    ref = hashed_exponentials(_keys(seeds), 9, 152064)
    got = streams.exponentials(152064, 9).cpu()
    rel = ((got - ref).abs() / ref.clamp_min(1e-30)).max().item()
    assert rel < 1e-6 and (got == ref).double().mean() > 0.5, rel
    sub = RowStreams([seeds[4], seeds[1]], "cuda").exponentials(152064, 9).cpu()
    assert torch.equal(sub[0], got[4]) and torch.equal(sub[1], got[1])
    positions = torch.tensor([9, 0, 31], device="cuda")  # per-row positions, a subset of rows
    picked = streams.exponentials(152064, positions, rows=[2, 4, 6]).cpu()
    ref = hashed_exponentials(_keys([seeds[2], seeds[4], seeds[6]]), positions.cpu(), 152064)
    assert ((picked - ref).abs() / ref.clamp_min(1e-30)).max().item() < 1e-6
    assert torch.equal(picked[0], got[2])


@pytest.mark.cuda
def test_cuda_engine_rows_follow_their_seeds_through_a_permuted_batch():
    """The CUDA path end to end (graphs, fused sampler, the Triton stream kernel): the same batch in another
    order gives every prompt the same completion (same batch size, so the same GEMM kernels per row)."""
    engine = RolloutEngine(tiny_model("qwen2").cuda())
    prompts = [[5, 7, 9, 11], [3, 4, 6, 8], [100, 20, 30, 40], [8, 9, 10, 12]]
    seeds = [7, 8, 9, 2**63 + 1]
    kw = dict(max_new_tokens=24, temperature=1.0, stop_token_ids=[])
    full = engine.generate(prompts, row_seeds=seeds, **kw)
    order = [3, 1, 0, 2]
    permuted = engine.generate([prompts[i] for i in order], row_seeds=[seeds[i] for i in order], **kw)
    for got, i in zip(permuted, order):
        assert got.token_ids == full[i].token_ids
    assert len({tuple(c.token_ids) for c in engine.generate([prompts[0]] * 4, row_seeds=[1, 2, 3, 4], **kw)}) > 1


# ----------------------------------------------------------------------------- per-row token budgets
def test_per_row_budgets_cut_each_row_where_its_uncapped_run_would_be(engine):
    """With row streams a row's tokens do not depend on the others, so a row with budget n holds the first n
    tokens of the same row generated with the largest budget; the call ends with its longest row."""
    prompts = [[5, 7, 9, 11], [3, 4, 6, 8], [100, 20, 30, 40]]
    seeds = [11, 12, 13]
    full = engine.generate(prompts, 20, temperature=1.0, stop_token_ids=[], row_seeds=seeds)
    capped = engine.generate(prompts, [3, 20, 1], temperature=1.0, stop_token_ids=[], row_seeds=seeds)
    for budget, got, ref in zip([3, 20, 1], capped, full):
        assert len(got.token_ids) == budget and got.finish_reason == "length"
        assert got.token_ids == ref.token_ids[:budget]
        assert torch.allclose(torch.tensor(got.logprobs), torch.tensor(ref.logprobs[:budget]), atol=1e-5)


def test_per_row_budgets_stop_early_and_keep_stop_tokens(engine):
    """All rows short: the loop ends at the longest budget; a stop token inside a budget ends that row."""
    prompts = [[5, 7, 9, 11], [3, 4, 6, 8]]
    ref = engine.generate(prompts, 6, temperature=1.0, stop_token_ids=[], row_seeds=[1, 2])
    stop = ref[0].token_ids[2]  # row 0 emits this token third: make it a stop token
    out = engine.generate(prompts, [6, 2], temperature=1.0, stop_token_ids=[stop], row_seeds=[1, 2])
    first = ref[0].token_ids.index(stop) + 1
    assert out[0].token_ids == ref[0].token_ids[:first] and out[0].finish_reason == "stop"
    expected = ref[1].token_ids[:2]
    cut = next((j + 1 for j, t in enumerate(expected) if t == stop), None)
    assert out[1].token_ids == (expected if cut is None else expected[:cut])


@pytest.mark.parametrize("budgets, message", [([4], "1 budgets for 2 prompts"), ([4, 0], "positive integers"),
                                               ([4, 2.5], "positive integers"), (0, "positive integers")])
def test_bad_budgets_are_one_line(engine, budgets, message):
    with pytest.raises(ValueError, match=message):
        engine.generate([[1, 2], [3, 4]], budgets)
