"""Continuous batching (engine/continuous.py) against the static batch.

With per-row seeds a sequence's draws depend on its prompt, seed and position only, so running N
prompts through fewer rows, each refilled from the queue as its sequence finishes, must give the
completions a static batch of all N gives: the same tokens, and logprobs equal up to float32
reduction order (the rows attend over different cache columns, with different masked spans). The
schedules here are small enough to force every path: refills of several rows at once, prompts
longer than the rows they replace, rows that finish at their first token, compaction of the cache,
idle rows at the end, and the graph path's buffers (run eagerly off CUDA).
"""

from __future__ import annotations

import pytest
import torch

from qerl_lib.engine.rollout import RolloutEngine
from tests.test_engine import tiny_model

PROMPTS = [[5, 7, 9, 11], [3, 4], [100, 20, 30, 40, 50, 60, 70], [8], [9, 10, 12], [40, 41, 42, 43, 44, 45],
           [17, 18], [90, 91, 92, 93, 94]]
SEEDS = [101, 202, 303, 404, 505, 606, 707, 808]
CAPS = [12, 3, 20, 1, 7, 16, 9, 5]  # uneven, one row done at its first token


def _close(a, b, atol=1e-4):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.token_ids == y.token_ids
        assert x.finish_reason == y.finish_reason
        assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=atol)


@pytest.fixture(scope="module")
def model():
    return tiny_model("qwen2")


@pytest.mark.parametrize("max_batch", [1, 3, 5])
def test_continuous_gives_the_static_batch_completions(model, max_batch):
    engine = RolloutEngine(model, check_every=2)
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=SEEDS)
    static = engine.generate(PROMPTS, CAPS, **kw)
    continuous = engine.generate(PROMPTS, CAPS, max_batch=max_batch, timing=True, **kw)
    _close(continuous, static)
    extra = engine.last_timing.extra
    assert extra["scheduling"] == "continuous" and extra["refills"] == len(PROMPTS) - max_batch
    assert [len(c.token_ids) for c in continuous] == CAPS


def test_stop_tokens_end_sequences_and_free_their_rows(model):
    """A stop token taken from the static run ends its sequence mid-way (kept in the output), in both paths."""
    engine = RolloutEngine(model, check_every=3)
    kw = dict(temperature=1.0, row_seeds=SEEDS)
    probe = engine.generate(PROMPTS, 20, stop_token_ids=[], **kw)
    stop = probe[2].token_ids[4]  # a token some sequence samples: sequences that draw it stop there
    static = engine.generate(PROMPTS, 20, stop_token_ids=[stop], **kw)
    assert any(c.finish_reason == "stop" for c in static)
    _close(engine.generate(PROMPTS, 20, stop_token_ids=[stop], max_batch=3, **kw), static)


def test_compaction_keeps_every_sequence_intact(model):
    """A cache of one small length bucket forces the write column back to the start several times."""
    engine = RolloutEngine(model, check_every=2, length_step=8)
    prompts, seeds = PROMPTS * 4, [s * 3 + 1 for s in range(32)]
    caps = [(11 * i) % 30 + 1 for i in range(32)]
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=seeds)
    static = engine.generate(prompts, caps, **kw)
    continuous = engine.generate(prompts, caps, max_batch=4, timing=True, **kw)
    assert engine.last_timing.extra["compactions"] >= 3, engine.last_timing.extra
    _close(continuous, static)


def test_graph_path_buffers_and_greedy(model):
    """decode_backend="graphs" off CUDA runs the graph path's static buffers and buckets eagerly."""
    eager = RolloutEngine(model, check_every=2)
    graphs = RolloutEngine(model, decode_backend="graphs", check_every=2, length_step=16)
    kw = dict(temperature=0.0, stop_token_ids=[])
    reference = eager.generate(PROMPTS, CAPS, **kw)
    _close(graphs.generate(PROMPTS, CAPS, max_batch=3, **kw), reference)
    _close(eager.generate(PROMPTS, CAPS, max_batch=2, **kw), reference)


def test_one_seed_per_call_samples_every_prompt(model):
    """With one generator for the call the samples depend on the schedule, but every prompt is answered
    to its budget and the same call repeats exactly."""
    engine = RolloutEngine(model, check_every=4)
    kw = dict(temperature=1.0, stop_token_ids=[], seed=3, max_batch=3)
    first, again = engine.generate(PROMPTS, CAPS, **kw), engine.generate(PROMPTS, CAPS, **kw)
    assert [len(c.token_ids) for c in first] == CAPS
    _close(first, again, atol=0.0)


def test_more_rows_than_prompts_is_the_static_path(model):
    engine = RolloutEngine(model)
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=SEEDS, timing=True)
    static = engine.generate(PROMPTS, CAPS, **kw)
    assert "scheduling" not in engine.last_timing.extra
    _close(engine.generate(PROMPTS, CAPS, max_batch=len(PROMPTS), **kw), static, atol=0.0)
    assert "scheduling" not in engine.last_timing.extra


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_max_batch_is_one_line(model, bad):
    with pytest.raises(ValueError, match="max_batch must be a positive integer"):
        RolloutEngine(model).generate(PROMPTS, 4, max_batch=bad)


@pytest.mark.cuda
def test_cuda_continuous_matches_static_through_graphs():
    """The CUDA path end to end (graphs, the attention kernel's per-row pad, per-row stream positions,
    compaction) against the static batch of the same engine: same tokens wherever the two runs' logits
    agree to bf16 noise (median logprob difference bounded)."""
    model = tiny_model("qwen2").cuda().to(torch.bfloat16)
    engine = RolloutEngine(model, check_every=4, length_step=32)
    prompts, seeds = PROMPTS * 8, [s * 7 + 1 for s in range(64)]  # ~170 decode steps: past the 96-column cache
    caps = [(17 * i) % 40 + 1 for i in range(64)]
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=seeds)
    static = engine.generate(prompts, caps, **kw)
    continuous = engine.generate(prompts, caps, max_batch=8, timing=True, **kw)
    assert engine.last_timing.extra["compactions"] >= 1
    assert [len(c.token_ids) for c in continuous] == caps
    same = sum(a.token_ids == b.token_ids for a, b in zip(continuous, static))
    assert same >= 52, f"only {same}/64 completions identical"
    diffs = torch.cat([(torch.tensor(a.logprobs) - torch.tensor(b.logprobs)).abs()
                       for a, b in zip(continuous, static) if a.token_ids == b.token_ids])
    assert diffs.median() < 0.05 and diffs.max() < 0.5


def test_prefill_blocks_meet_each_new_launch_once():
    """One (rows, length) block per launch the token counts lo..hi meet, its own count within that launch's range
    (a range too narrow for rows x ceil(count / rows) at the fewest rows takes more rows), none for known ones."""
    from qerl_lib.engine.continuous import prefill_blocks

    def launch_at(tokens):  # a range of exactly one count (301) that only 7 rows of 43 tokens reach
        return (("g", "A" if tokens < 300 else "B" if tokens == 300 else "C" if tokens == 301 else "D"),)

    known: set = set()
    blocks = prefill_blocks(launch_at, 250, 2048, 8, 256, known)
    assert blocks == [(1, 250), (2, 150), (7, 43), (2, 151)]
    assert [launch_at(r * n)[0][1] for r, n in blocks] == ["A", "B", "C", "D"]
    assert known == {("g", x) for x in "ABCD"}
    assert prefill_blocks(launch_at, 250, 2048, 8, 256, known) == []
    assert prefill_blocks(launch_at, 250, 600, 2, 256, set()) == [(1, 250), (2, 150), (2, 151)]  # C needs 7 rows


def test_a_continuous_call_first_meets_its_prefill_launches(model, monkeypatch):
    """Where kernels compile on first use, a continuous call first runs one throwaway prefill per launch its refills
    may meet (engine/continuous.warm_prefill_launches; faked launches here, the CPU compiles nothing): into rows
    the call's first prefill overwrites, so the completions stay the static batch's; a later call runs none."""
    from qerl_lib.engine import continuous
    from qerl_lib.engine.forward import ForwardPass

    monkeypatch.setattr(continuous, "_compiles", lambda device: True)
    monkeypatch.setattr(ForwardPass, "prefill_launches", lambda self, tokens: (("g", tokens >= 6), ("h", tokens >= 12)))
    shapes = []
    prefill = ForwardPass.prefill
    monkeypatch.setattr(ForwardPass, "prefill",
                        lambda self, tokens, *a, **k: (shapes.append(tuple(tokens.shape)), prefill(self, tokens, *a, **k))[1])
    engine = RolloutEngine(model, check_every=2)
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=SEEDS)
    static = engine.generate(PROMPTS, CAPS, **kw)
    shapes.clear()
    _close(engine.generate(PROMPTS, CAPS, max_batch=3, timing=True, **kw), static)
    assert shapes[:4] == [(1, 1), (1, 6), (2, 6), (3, 7)]  # counts 1, 6, 12 (of 1..21), then the call's own
    assert engine.last_timing.extra["warm_prefills"] == 3
    shapes.clear()
    _close(engine.generate(PROMPTS, CAPS, max_batch=3, timing=True, **kw), static)
    assert shapes[0] == (3, 7) and engine.last_timing.extra["warm_prefills"] == 0


@pytest.mark.cuda
def test_cuda_after_the_warm_no_prefill_count_compiles_a_gemm(monkeypatch):
    """On the GPU, after a continuous call's warm (NVFP4 groups, prompts of 1-7 tokens, 3 rows: counts 1-21), a
    prefill of any count a refill can make compiles no FP4 GEMM kernel (a variant compiled mid-rollout cost 3.1 s
    at 7B, dev/LOG.md section 122)."""
    from triton.runtime import jit

    from tests.test_engine import tiny_cuda_model

    engine = RolloutEngine(tiny_cuda_model("nvfp4"), check_every=2)
    assert engine.generate(PROMPTS, CAPS, max_batch=3, temperature=1.0, stop_token_ids=[], row_seeds=SEEDS)
    assert engine._forward.prefill_launches(5), "no NVFP4 group on the kernel path: nothing was warmed"
    compiled, compile_ = [], jit.JITFunction._do_compile
    monkeypatch.setattr(jit.JITFunction, "_do_compile",
                        lambda self, *a, **k: (compiled.append(self.fn.__qualname__), compile_(self, *a, **k))[1])
    for tokens in range(1, 22):
        rows = -(-tokens // 7)
        length = -(-tokens // rows)
        ids = torch.zeros(rows, length, dtype=torch.long, device="cuda")
        with torch.no_grad():
            engine._forward.prefill(ids, torch.arange(length, device="cuda").repeat(rows, 1), None, engine.cache)
    torch.cuda.synchronize()
    assert not [name for name in compiled if "fp4" in name], compiled
