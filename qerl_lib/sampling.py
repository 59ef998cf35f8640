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
outside the CUDA graph, in plain PyTorch, so it needs no graph-safe RNG bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
