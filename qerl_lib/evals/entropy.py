"""Next-token entropy of a policy on given completions (teacher-forced).

QeRL's central empirical claim is that quantized weights raise the policy's entropy, which
helps RL exploration. "Entropy" here is the Shannon entropy (in nats) of the model's
next-token distribution, H_t = -sum_v p_t(v) log p_t(v), at every position t of a
completion, averaged over completion tokens; this is also what TRL and the official code
log as `entropy` (masked token mean over the policy's own completions).

Two ways to choose the completions, and both are used by the entropy study:

* the model's **own** samples: entropy where that model actually goes (what RL sees);
* **fixed reference** completions (e.g. the dataset's worked solutions, or one model's
  greedy output) scored by every format: a paired comparison on identical tokens, so the
  difference between formats is not confounded by different text.

Computed in float32 from the logits (temperature 1, no top-k/top-p), batched with right
padding and an attention mask, so padding never changes the result.

Empty input has no entropy. `per_sequence_mean` and `paired_bootstrap` then give None (JSON
null), the bootstrap with a ``note`` saying why; `mean_token_entropy` gives NaN, which a caller
writing JSON turns into null and a note (`NO_TOKENS`): the kit's JSON writers refuse NaN.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

NO_TOKENS = "no completion tokens to score"  # the note beside an entropy that is null
NO_PAIRS = "no problem has a value on both sides (no completion tokens)"


@torch.no_grad()
def token_entropies(model, prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]],
                    batch_size: int = 16, temperature: float = 1.0) -> list[torch.Tensor]:
    """Per-token entropies (nats, float32 CPU tensors) of each completion given its prompt.

    Entry i has `len(completions[i])` values: the entropy of the distribution that predicted
    completion token t, i.e. the logits at position `len(prompt) + t - 1`.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions: pass one completion per prompt")
    if temperature <= 0:
        raise ValueError("temperature must be > 0 for an entropy (the greedy distribution has none)")
    device = next(model.parameters()).device if any(True for _ in model.parameters()) else torch.device("cpu")
    out: list[torch.Tensor] = [torch.empty(0)] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]) + len(completions[i]))
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        seqs = [list(prompts[i]) + list(completions[i]) for i in idx]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        for r, s in enumerate(seqs):
            ids[r, : len(s)] = torch.tensor(s)
            mask[r, : len(s)] = 1
        # logits only where a completion token is predicted: from the shortest prompt's last position on
        # (the prompts are most of each sequence; lm_head and the softmax over them were a fifth of the time)
        keep = width - min(len(prompts[i]) for i in idx) + 1
        logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=keep).logits.float()
        if logits.shape[1] != keep:
            raise RuntimeError(f"{type(model).__name__} ignored logits_to_keep={keep} "
                               f"(returned {logits.shape[1]} positions)")
        offset = width - keep  # sequence position j is logits column j - offset
        for r, i in enumerate(idx):
            p, c = len(prompts[i]), len(completions[i])
            if c == 0:
                out[i] = torch.empty(0)
                continue
            step = logits[r, p - 1 - offset: p + c - 1 - offset] / temperature
            logp = torch.log_softmax(step, dim=-1)
            out[i] = -(logp.exp() * logp).sum(-1).cpu()
    return out


def mean_token_entropy(entropies: Sequence[torch.Tensor]) -> float:
    """Token-weighted mean over all completions (each token counts once, like TRL's masked mean); NaN if
    there are no tokens at all (write it as null with the note `NO_TOKENS`)."""
    total = sum(float(e.sum()) for e in entropies)
    count = sum(e.numel() for e in entropies)
    return total / count if count else float("nan")


def per_sequence_mean(entropies: Sequence[torch.Tensor]) -> list[float | None]:
    """Mean entropy of each completion (None for empty ones): the unit for paired bootstrap tests."""
    return [float(e.mean()) if e.numel() else None for e in entropies]


def _missing(x: float | None) -> bool:
    return x is None or math.isnan(x)


def paired_bootstrap(a: Sequence[float | None], b: Sequence[float | None], n_boot: int = 2000, seed: int = 0,
                     level: float = 0.95) -> dict:
    """Mean of the paired differences b - a with a percentile bootstrap interval over problems.

    Pairs with a missing side (None or NaN) are skipped; ``n`` counts the pairs used. With none left,
    ``mean_diff``, ``low`` and ``high`` are None and ``note`` says why (`NO_PAIRS`).
    """
    pairs = [(x, y) for x, y in zip(a, b) if not (_missing(x) or _missing(y))]
    if not pairs:
        return {"mean_diff": None, "low": None, "high": None, "n": 0, "note": NO_PAIRS}
    diffs = torch.tensor([y - x for x, y in pairs], dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    samples = diffs[torch.randint(len(diffs), (n_boot, len(diffs)), generator=gen)].mean(1)
    lo, hi = torch.quantile(samples, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64))
    return {"mean_diff": float(diffs.mean()), "low": float(lo), "high": float(hi), "n": len(pairs)}
