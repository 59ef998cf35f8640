"""Token sampling for the rollout engine: temperature, top-k, top-p, and the logprob GRPO needs.

What the logprob means
----------------------
GRPO's importance ratio is ``pi_theta(y_t) / pi_old(y_t)``, and the kit takes ``pi_old`` from the
rollout. So the engine must say *which* distribution each returned logprob comes from:

* ``temperature > 0`` (sampling): the **processed** distribution the token was drawn from, i.e.
  ``log_softmax(filter(logits / temperature))[token]`` where ``filter`` is top-k then top-p
  (tokens it removes get -inf). With ``top_k=0, top_p=1`` this is exactly the
  temperature-scaled policy that TRL's GRPO trainer recomputes (it divides logits by the same
  temperature), so engine and trainer logprobs are directly comparable.
* ``temperature == 0`` (greedy): the argmax token, with its logprob under the **raw** distribution
  ``log_softmax(logits)`` (there is no sampling distribution to speak of; the raw one is the
  only meaningful choice, and it is what a temperature-1 trainer would compute).

The processing order (temperature, then top-k, then top-p) and the tie rules are those of
transformers' ``TemperatureLogitsWarper`` / ``TopKLogitsWarper`` / ``TopPLogitsWarper``: top-k keeps
every token tied with the k-th largest logit, and top-p removes the low-probability tail whose
cumulative mass is ``<= 1 - top_p``, always keeping the most likely token.

How a token is drawn
--------------------
``argmax(probs / E)`` with ``E ~ Exponential(1)`` i.i.d. per vocabulary entry is an exact sample
from ``probs`` (the "exponential race", equivalent to the Gumbel-max trick). Unlike
``torch.multinomial`` it never synchronises with the host, so the decode loop keeps the GPU
busy. Draws come from the caller's ``torch.Generator`` (one per ``generate`` call, seeded from
``seed``), so the same seed on the same device and batch gives the same samples. Sampling runs
outside the CUDA graph, so it needs no graph-safe RNG bookkeeping.

On CUDA, plain sampling (no top-k/top-p) runs fused: after torch draws ``E``, one Triton kernel
takes per block of the vocabulary the max, the sum of exponentials and the best
``logit / T - log E`` (the log of ``probs / E`` up to a per-row constant, so the same argmax), and
a second one combines the blocks into the token and its logprob. Eager PyTorch spent ~60 us per
decode step here at Qwen2.5's 152k vocabulary (a softmax with one CTA per row among 8 kernels),
~2% of a 7B NVFP4 step. The arithmetic is the same up to summation order, so a token can differ
from the eager path's only where two candidates tie to float32 rounding; ``tests/test_sampling_fused``
checks both against each other on shared draws.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:  # Triton is optional: the CPU paths do not need it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

FUSED_BLOCK = 4096  # vocabulary entries per program of the fused sampler


@dataclass(frozen=True)
class SamplingParams:
    """How to turn logits into a token. ``temperature=0`` means greedy (argmax)."""

    temperature: float = 1.0  # 0 = greedy; otherwise logits are divided by it
    top_p: float = 1.0  # nucleus mass to keep, in (0, 1]; 1 disables the filter
    top_k: int = 0  # keep the k most likely tokens; 0 disables the filter

    def __post_init__(self):
        if not (self.temperature >= 0.0) or self.temperature != self.temperature:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}: use 1.0 to disable nucleus filtering")
        if int(self.top_k) != self.top_k or self.top_k < 0:
            raise ValueError(f"top_k must be a non-negative integer, got {self.top_k}: use 0 to disable it")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def filters(self) -> bool:
        """Whether top-k or top-p removes anything (both need a sort or a top-k over the vocabulary)."""
        return self.top_k > 0 or self.top_p < 1.0


def process_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The sampling distribution's logits: ``filter(logits / temperature)`` in float32, -inf where removed.

    For greedy params this returns the raw logits (as float32): the distribution the greedy
    logprob refers to. Exposed so a trainer can recompute logprobs under exactly the same rule.
    """
    scores = logits.float()
    if params.greedy:
        return scores
    if params.temperature != 1.0:
        scores = scores / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove_sorted = cumulative <= (1.0 - params.top_p)
        remove_sorted[..., -1:] = False  # the most likely token always survives
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def sample(logits: torch.Tensor, params: SamplingParams,
           generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; return ``(tokens [B] int64, logprobs [B] float32)``.

    The logprob is that of the returned token under the distribution described in the module
    docstring (processed for sampling, raw for greedy). No host synchronisation happens here.
    """
    if logits.is_cuda and triton is not None and not params.greedy and not params.filters:
        race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(1.0, generator=generator)
        return fused_sample(logits, race, params.temperature)
    scores = process_logits(logits, params)
    logprobs_all = torch.log_softmax(scores, dim=-1)
    if params.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        probs = logprobs_all.exp()
        race = torch.empty_like(probs).exponential_(1.0, generator=generator)
        race.clamp_min_(torch.finfo(race.dtype).tiny)  # a 0 draw would turn a removed token's 0/0 into NaN
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


def fused_sample(logits: torch.Tensor, race: torch.Tensor, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``argmax(softmax(logits / T) / race)`` and its logprob in two Triton kernels (see the module
    docstring): ``logits [B, V]`` (any float dtype), ``race [B, V]`` float32 Exponential(1) draws.
    Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests)."""
    if logits.dim() != 2 or race.shape != logits.shape or race.dtype != torch.float32:
        raise ValueError(f"fused_sample: logits {list(logits.shape)} and float32 race of the same shape expected, "
                         f"got race {list(race.shape)} {race.dtype}")
    logits, race = logits.contiguous(), race.contiguous()
    rows, vocab = logits.shape
    if vocab >= 2**24:
        raise ValueError(f"fused_sample: vocabulary of {vocab} entries; token ids travel as float32 (< 2^24)")
    blocks = triton.cdiv(vocab, FUSED_BLOCK)
    part = torch.empty(4, rows, blocks, dtype=torch.float32, device=logits.device)  # max, sum, best key, best index
    _sample_blocks_kernel[(rows, blocks)](logits, race, part, vocab, blocks, float(temperature),
                                          BLOCK=FUSED_BLOCK, num_warps=8)
    tokens = torch.empty(rows, dtype=torch.int64, device=logits.device)
    logprobs = torch.empty(rows, dtype=torch.float32, device=logits.device)
    _sample_combine_kernel[(rows,)](logits, part, tokens, logprobs, vocab, blocks, float(temperature),
                                    BLOCKS_P=triton.next_power_of_2(blocks), num_warps=4)
    return tokens, logprobs


if triton is not None:

    @triton.jit
    def _sample_blocks_kernel(logits_ptr, race_ptr, part_ptr, vocab, blocks, temperature, BLOCK: tl.constexpr):
        """Program (row, block): max and sum of exp(x - max) of x = logits / T over the block, and
        the block's best key x - log(race) with its index (the first one on ties)."""
        row, blk = tl.program_id(0), tl.program_id(1)
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        ok = cols < vocab
        x = tl.load(logits_ptr + row * vocab + cols, mask=ok, other=float("-inf")).to(tl.float32) / temperature
        e = tl.maximum(tl.load(race_ptr + row * vocab + cols, mask=ok, other=1.0), 1.1754943508222875e-38)
        m = tl.max(x, axis=0)
        total = tl.sum(tl.where(ok, tl.exp(x - m), 0.0), axis=0)
        total = tl.where(m == float("-inf"), 0.0, total)  # a block of -inf logits adds nothing (not NaN)
        key = tl.where(ok, x - tl.log(e), float("-inf"))
        best = tl.max(key, axis=0)
        index = tl.min(tl.where(key == best, cols, vocab), axis=0)
        base = part_ptr + row * blocks + blk
        stride = tl.num_programs(0) * blocks
        tl.store(base, m)
        tl.store(base + stride, total)
        tl.store(base + 2 * stride, best)
        tl.store(base + 3 * stride, index.to(tl.float32))

    @triton.jit
    def _sample_combine_kernel(logits_ptr, part_ptr, tokens_ptr, logprobs_ptr, vocab, blocks, temperature,
                               BLOCKS_P: tl.constexpr):
        """Program (row): log-sum-exp over the blocks, the best key's token, and its logprob
        (x - max) - log(sum), the order of torch's log_softmax."""
        row = tl.program_id(0)
        b = tl.arange(0, BLOCKS_P)
        ok = b < blocks
        stride = tl.num_programs(0) * blocks
        base = part_ptr + row * blocks + b
        m = tl.load(base, mask=ok, other=float("-inf"))
        total = tl.load(base + stride, mask=ok, other=0.0)
        best = tl.load(base + 2 * stride, mask=ok, other=float("-inf"))
        index = tl.load(base + 3 * stride, mask=ok, other=0.0).to(tl.int32)
        top = tl.max(m, axis=0)
        total = tl.sum(tl.where(ok, total * tl.exp(m - top), 0.0), axis=0)
        winner = tl.max(best, axis=0)
        token = tl.min(tl.where(ok & (best == winner), index, vocab), axis=0)
        x = tl.load(logits_ptr + row * vocab + token).to(tl.float32) / temperature
        tl.store(tokens_ptr + row, token.to(tl.int64))
        tl.store(logprobs_ptr + row, (x - top) - tl.log(total))
