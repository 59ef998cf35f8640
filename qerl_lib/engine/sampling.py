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

Per-row streams
---------------
With one generator per call, row ``r``'s draws depend on everything drawn before them: the
batch's size and order, how a rollout is chunked, how many GPUs share it. ``RowStreams`` gives
every row its own stream instead, from a 64-bit seed of its own (``generate(..., row_seeds=...)``),
so a completion is a function of its prompt, its seed and the weights only. The trainer seeds row
``i`` of a step's global batch from (run seed, step, rollout, i): one GPU and two GPUs sample the same
completions. Two implementations, one contract (row ``r``'s draws at decode position ``t``
depend on ``seeds[r]`` and ``t`` only):

* CPU: one ``torch.Generator`` per row, advanced by one vocabulary-sized draw per position.
* CUDA: a counter-based hash: ``E = -log1p(-U)`` with ``U = (h + 1/2) / 2^32`` and ``h`` a 32-bit
  hash of (seed, position, vocabulary index), filled by one Triton kernel (no state to carry, no
  launch per row). ``hashed_exponentials`` is its plain-torch reference (and the path without
  Triton). Its resolution is that of torch's float32 draws; it is tested for uniformity and
  independence across rows, positions and vocabulary entries, and for sampling the right
  distribution (``tests/test_row_streams.py``).

The two draw different numbers for the same seed (as torch's generators do on CPU and CUDA).
Cost on an H100 at Qwen2.5's vocabulary, draws plus the fused sampler: 73 against 55 us per decode
step at batch 8, 122 against 93 at batch 128 (one generator): under 1% of a 7B decode step.

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


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None,
           race: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of ``logits [B, V]``; return ``(tokens [B] int64, logprobs [B] float32)``.

    The logprob is that of the returned token under the distribution described in the module
    docstring (processed for sampling, raw for greedy). No host synchronisation happens here.
    ``race``: the Exponential(1) draws ``[B, V]`` float32 to use (e.g. ``RowStreams.exponentials``);
    None draws them from ``generator``.
    """
    if race is not None and (race.shape != logits.shape or race.dtype != torch.float32):
        raise ValueError(f"race must be float32 of the logits' shape {list(logits.shape)}, "
                         f"got {race.dtype} {list(race.shape)}")
    if logits.is_cuda and triton is not None and not params.greedy and not params.filters:
        if race is None:
            race = torch.empty(logits.shape, dtype=torch.float32, device=logits.device).exponential_(
                1.0, generator=generator)
        return fused_sample(logits, race, params.temperature)
    scores = process_logits(logits, params)
    logprobs_all = torch.log_softmax(scores, dim=-1)
    if params.greedy:
        tokens = scores.argmax(dim=-1)
    else:
        probs = logprobs_all.exp()
        race = torch.empty_like(probs).exponential_(1.0, generator=generator) if race is None else race.clone()
        race.clamp_min_(torch.finfo(race.dtype).tiny)  # a 0 draw would turn a removed token's 0/0 into NaN
        tokens = (probs / race).argmax(dim=-1)
    return tokens, logprobs_all.gather(-1, tokens[:, None]).squeeze(-1)


# ----------------------------------------------------------------------------- per-row streams
_M32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9  # 2^32 / golden ratio: spreads consecutive positions before hashing
_MIX_1, _MIX_2 = 0x7FEB352D, 0x846CA68B  # a 32-bit avalanche mixer ("lowbias32", C. Wellons)
_SALT = 0x6A09E667  # keeps the two per-row keys apart (without it, a zero high half made entry 0 hash to 0)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``x * c mod 2^32`` for int64 ``x`` in [0, 2^32), without int64 overflow (c split in 16-bit halves)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = _mul32(x, _MIX_1)
    x = x ^ (x >> 15)
    x = _mul32(x, _MIX_2)
    return x ^ (x >> 16)


def _position_words(position, device) -> torch.Tensor:
    """``position * golden mod 2^32`` as int64: a scalar for an int, ``[B]`` for per-row positions."""
    if isinstance(position, torch.Tensor):
        return _mul32(position.to(device=device, dtype=torch.int64), _GOLDEN)
    return torch.tensor((int(position) * _GOLDEN) & _M32, dtype=torch.int64, device=device)


def _row_keys(keys: torch.Tensor, position) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row 32-bit keys (a, b) of decode position ``position`` (an int, or one per row ``[B]``)
    from ``keys [B, 2]`` (seed halves)."""
    spread = _mix32(_position_words(position, keys.device))
    a = _mix32(keys[:, 0] ^ spread)
    return a, _mix32(keys[:, 1] ^ _mix32(a ^ _SALT))


def _log1p_neg_kahan(u: torch.Tensor) -> torch.Tensor:
    """``log1p(-u)`` in float32 by Kahan's formula, the same operations as the Triton kernel."""
    w = 1.0 - u
    return torch.where(w == 1.0, -u, torch.log(w) * (-u) / (w - 1.0))


def hashed_exponentials(keys: torch.Tensor, position, vocab: int) -> torch.Tensor:
    """The plain-torch reference of the CUDA per-row stream: Exponential(1) draws ``[B, vocab]``
    float32 for decode position ``position`` (an int for every row, or an int64 tensor ``[B]`` of one
    position per row, each < 2^31), from ``keys [B, 2]`` int64 (a 64-bit seed's low and high 32-bit
    halves, ``RowStreams.keys``)."""
    a, b = _row_keys(keys, position)
    cols = torch.arange(vocab, dtype=torch.int64, device=keys.device)
    h = _mix32(_mix32(cols[None, :] ^ a[:, None]) ^ b[:, None])
    u = (h.to(torch.float32) + 0.5) * 2.0 ** -32
    return -_log1p_neg_kahan(u)


class RowStreams:
    """One random stream per row (module docstring, "Per-row streams").

    ``seeds``: one integer in [0, 2^64) per row. ``exponentials(vocab, position)`` gives the
    Exponential(1) draws ``[B, vocab]`` of every row at decode position ``position`` (0 = the first
    new token). ``position`` is one int for every row, or an int64 tensor ``[B]`` of one position per
    row; ``rows`` (a list of row indices) draws for those rows only, in that order. ``reseed`` gives
    rows new seeds, each starting again at position 0: the continuous-batching engine hands a slot
    to the next prompt that way. On CPU every row's positions must be asked for in order 0, 1, 2, ...
    (each row's generator advances by one draw per position); on CUDA in any order.
    """

    def __init__(self, seeds, device):
        self.device = torch.device(device)
        self.rows = 0
        self.keys = torch.zeros(0, 2, dtype=torch.int64, device=self.device)
        self._generators = None if self.device.type == "cuda" else []
        self._next: list[int] = []
        self.reseed(None, seeds)

    def reseed(self, rows, seeds) -> None:
        """Give ``rows`` (None: all, resizing to ``len(seeds)``) the streams of ``seeds``, at position 0."""
        seeds = [int(s) for s in seeds]
        bad = [s for s in seeds if not 0 <= s < 2**64]
        if bad:
            raise ValueError(f"row seeds must be integers in [0, 2^64), got {bad[0]}")
        keys = torch.tensor([[s & _M32, s >> 32] for s in seeds], dtype=torch.int64).reshape(-1, 2)
        if rows is None:
            self.rows, self.keys, self._next = len(seeds), keys.to(self.device), [0] * len(seeds)
            if self._generators is not None:
                self._generators = [torch.Generator().manual_seed(s) for s in seeds]
            return
        rows = [int(r) for r in rows]
        if len(rows) != len(seeds) or any(not 0 <= r < self.rows for r in rows):
            raise ValueError(f"reseed: {len(rows)} rows for {len(seeds)} seeds, rows must be in [0, {self.rows})")
        self.keys[torch.tensor(rows, device=self.device)] = keys.to(self.device)
        for r, s in zip(rows, seeds):
            self._next[r] = 0
            if self._generators is not None:
                self._generators[r] = torch.Generator().manual_seed(s)

    def exponentials(self, vocab: int, position, rows=None) -> torch.Tensor:
        picked = list(range(self.rows)) if rows is None else [int(r) for r in rows]
        per_row = isinstance(position, torch.Tensor)
        if per_row and position.shape != (len(picked),):
            raise ValueError(f"per-row positions: shape {tuple(position.shape)}, expected ({len(picked)},)")
        if self._generators is None:
            keys = self.keys if rows is None else self.keys[torch.tensor(picked, device=self.device)]
            if triton is None:
                return hashed_exponentials(keys, position, vocab)
            out = torch.empty(len(picked), vocab, dtype=torch.float32, device=self.device)
            if not picked:
                return out
            block = 1024
            positions = position.to(device=self.device, dtype=torch.int64) if per_row else keys  # keys: unread
            word = 0 if per_row else (int(position) * _GOLDEN) & _M32
            _row_exponentials_kernel[(len(picked), triton.cdiv(vocab, block))](
                keys, out, vocab, word, positions, PER_ROW=per_row, BLOCK=block, num_warps=4)
            return out
        wanted = position.tolist() if per_row else [int(position)] * len(picked)
        for r, p in zip(picked, wanted):
            if p != self._next[r]:
                raise RuntimeError(f"CPU row streams advance in order: row {r} is at position {self._next[r]}, "
                                   f"asked for {p}")
        out = torch.empty(len(picked), vocab, dtype=torch.float32)
        for row, r in zip(out, picked):
            row.exponential_(1.0, generator=self._generators[r])
            self._next[r] += 1
        return out


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
    def _mix32_tl(x):
        """``_mix32`` in int64 lanes holding 32-bit values (the torch reference's operations)."""
        x = x ^ (x >> 16)
        x = ((x * 0x352D) + (((x * 0x7FEB) & 0xFFFF) << 16)) & 0xFFFFFFFF
        x = x ^ (x >> 15)
        x = ((x * 0xA68B) + (((x * 0x846C) & 0xFFFF) << 16)) & 0xFFFFFFFF
        return x ^ (x >> 16)

    @triton.jit
    def _row_exponentials_kernel(keys_ptr, out_ptr, vocab, position_word, positions_ptr, PER_ROW: tl.constexpr,
                                 BLOCK: tl.constexpr):
        """Program (row, block): ``hashed_exponentials`` for one block of one row; the position is
        ``position_word`` (already ``* golden mod 2^32``) or, with PER_ROW, ``positions_ptr[row]``."""
        row, blk = tl.program_id(0), tl.program_id(1)
        if PER_ROW:
            p = tl.load(positions_ptr + row + tl.zeros([1], tl.int32))
            word = ((p * 0x79B9) + (((p * 0x9E37) & 0xFFFF) << 16)) & 0xFFFFFFFF  # _mul32(p, _GOLDEN)
        else:
            word = tl.full([1], 0, tl.int64) + position_word
        spread = _mix32_tl(word)
        a = _mix32_tl(tl.load(keys_ptr + 2 * row + tl.zeros([1], tl.int32)) ^ spread)
        b = _mix32_tl(tl.load(keys_ptr + 2 * row + 1 + tl.zeros([1], tl.int32)) ^ _mix32_tl(a ^ 0x6A09E667))
        cols = blk * BLOCK + tl.arange(0, BLOCK)
        h = _mix32_tl(_mix32_tl(cols.to(tl.int64) ^ a) ^ b)
        u = (h.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # 2^-32
        w = 1.0 - u
        log1p_neg = tl.where(w == 1.0, -u, tl.log(w) * (-u) / (w - 1.0))
        tl.store(out_ptr + row * vocab + cols, -log1p_neg, mask=cols < vocab)

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
