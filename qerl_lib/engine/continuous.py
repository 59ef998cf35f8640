"""Continuous batching: a finished sequence gives its slot to the next prompt in the queue.

Why
---
A GRPO rollout's completions end where each one stops: GSM8K-style answers run from a few dozen
tokens to the length limit (``bench/workloads.py``). A static batch decodes until its longest member
is done, so most of its slots idle through the tail: at the GSM8K-like lengths scaled to 2048 tokens,
a batch of 64 keeps ~25% of its decode slots busy. Decode is bound by reading the weights once per
step, whatever the number of rows, so an idle slot costs as much as a busy one. Here the engine runs
``slots`` rows at once over *all* of a call's prompts: when a row finishes, the next queued prompt is
prefilled into that row and decodes from the next step on.

How it fits the engine's layout
-------------------------------
The engine's cache is one dense tensor with one write column ``c`` shared by every row (the left-
padded layout of ``engine/rollout.py``): row ``r`` holds its prompt in columns ``[pad[r], pad[r] + L)``
and attends to ``pad[r] .. c``, at RoPE position ``column - pad[r]``. That is all a refill needs:

* **Refill.** At every check (each ``check_every`` steps, and at the step by which enough rows reach
  their token budgets, which the host knows; one host sync), finished rows hand their tokens over, and
  once ``slots // 8`` rows (at least one; fewer if the queue is shorter) are free they take queued
  prompts. Refilling in groups matters: a prefill call costs a few decode steps however few prompts it
  carries (eager launches, a host sync, the weights read once more), and grouping shares that cost.
  The new prompts (left-padded to the longest among them) are prefilled into their rows at columns
  ``[c - L, c)`` (``ForwardPass.prefill(rows=, start=)``), so ``pad[r] = c - L`` and the next decode
  step, which writes column ``c``, continues them. They attend only to their own prompt: the row's
  older columns are masked by ``pad``. Their first token is sampled from the prefill's logits.
* **Compaction.** ``c`` only grows, and the cache has ``P + max_new_tokens - 1 + headroom`` columns
  (``P`` the longest prompt of the call). When the next ``check_every`` steps would run past the end,
  every row's columns move left by the start of the oldest live sequence (in chunks no wider than
  the shift, so no copy overlaps itself) and ``pad`` and ``c`` move with them. A live sequence spans
  at most ``P + max_new_tokens - 1`` columns, so each compaction frees at least ``headroom -
  check_every`` columns; it is one pass over the cache every few hundred steps.
* **Sampling.** Each row's draws are indexed by its *own* token position (``RowStreams`` with per-row
  positions; a refilled row is reseeded with its new sequence's seed). With ``row_seeds`` a
  sequence's tokens therefore depend on its prompt, seed and the weights only, as in a static call:
  ``tests/test_engine_continuous.py`` checks that both give the same completions. With one ``seed``
  for the call, draws come from one generator, as in the static path, so the samples depend on the
  schedule.
* **Prefill kernels.** A refill's token count (its rows x its longest prompt) differs from refill to
  refill, and the NVFP4 GEMMs' launch rule gives some counts another kernel config, which Triton
  compiles the first time it runs: in the middle of a rollout, seconds at 7B. Before its first prefill,
  a call on the GPU runs one throwaway prefill per launch a count from its shortest prompt to ``slots``
  x its longest can meet and the engine has not met yet (``warm_prefill_launches``).
* **Graphs.** The decode step is the static engine's, replayed from the same CUDA graphs (batch
  bucket of ``slots`` rows, length buckets of the write column): refills and compactions only
  change the cache's contents and the ``pad`` buffer.

Where this differs from vLLM: no paged attention, so memory is reserved for ``slots`` full-length
rows plus the headroom (vLLM allocates pages as sequences grow and can run more rows in the same
memory); the schedule never preempts; a refill's prefill runs on its own, not packed into a decode
step (vLLM's chunked prefill); a row that ends at a stop token is noticed at the next check, up to
``check_every - 1`` steps late.
"""

from __future__ import annotations

import torch

from qerl_lib.engine.sampling import RowStreams, sample


def headroom_columns(length_step: int = 256, check_every: int = 16) -> int:
    """Columns the cache gets beyond the longest sequence (more than ``check_every``, see the module
    docstring): one length bucket, for the engine's ``length_step`` and ``check_every``."""
    return max(length_step, 2 * check_every)


def headroom(engine) -> int:
    """``headroom_columns`` of ``engine``'s settings."""
    return headroom_columns(engine.length_step, engine.check_every)


def left_padded(prompts: list[list[int]], start: int = 0):
    """The prompt block of a prefill: ``tokens [B, P]`` left-padded, per-row ``pad`` counts (plus
    ``start``: the cache columns the block begins at), RoPE ``positions``, and the bool ``mask [B, 1, P, P]``
    (None when no row is padded). CPU tensors."""
    plen = max(len(p) for p in prompts)
    pad = torch.tensor([plen - len(p) for p in prompts], dtype=torch.long)
    tokens = torch.zeros(len(prompts), plen, dtype=torch.long)
    for r, p in enumerate(prompts):
        tokens[r, plen - len(p):] = torch.tensor(p, dtype=torch.long)
    cols = torch.arange(plen)
    positions = (cols[None, :] - pad[:, None]).clamp(min=0)
    mask = None
    if bool((pad > 0).any()):
        causal = cols[None, :] <= cols[:, None]  # [query, key]
        real_key = cols[None, None, :] >= pad[:, None, None]  # [B, 1, key]
        mask = (causal[None] & real_key) | torch.eye(plen, dtype=torch.bool)[None]  # pad queries see themselves
        mask = mask[:, None]
    return tokens, positions, pad + start, mask


def prefill_blocks(launch_at, lo: int, hi: int, max_rows: int, max_len: int, known: set) -> list[tuple[int, int]]:
    """``(rows, length)`` prompt blocks whose prefills, run once, meet every kernel launch a prefill of ``lo`` to
    ``hi`` tokens can (``launch_at(tokens)``: a tuple of hashable launches) that ``known`` lacks; a block is
    ``rows`` prompts of ``length`` tokens, at most ``max_rows`` x ``max_len``. Adds what it covers to ``known``."""
    blocks, before = [], None
    for tokens in range(lo, hi + 1):
        launches = launch_at(tokens)
        if launches == before:
            continue
        before = launches
        if set(launches) <= known:
            continue
        for rows in range(-(-tokens // max_len), max_rows + 1):
            length = -(-tokens // rows)  # rows x length: tokens or a little more, if still this launch's
            if launch_at(rows * length) == launches:
                blocks.append((rows, length))
                known.update(launches)
                break
    return blocks


def warm_prefill_launches(engine, forward, cache, lengths: list[int], slots: int) -> int:
    """Compile, before a continuous call decodes, the prefill kernels its refills may need; returns the prefills run.

    A refill prefills a group of 1 to ``slots`` prompts, so its token count (rows x the longest prompt) changes from
    refill to refill, and the NVFP4 GEMMs' launch rule gives some counts another kernel config: a Triton variant
    compiled the first time it is met, mid-rollout (3.1 s for the 7B gate/up producer kernel on an H200, dev/LOG.md
    section 122). One throwaway prefill per launch not yet seen, into the first rows of ``cache`` at columns
    ``[0, length)`` (which the call's first prefill overwrites: length <= its longest prompt), meets them all now.
    Once per launch and engine: later calls run none (nor scan a span of counts scanned before)."""
    lora, longest = forward.lora is not None, max(lengths)
    span = (lora, min(lengths), slots * longest, slots, longest)
    if any(s[0] == lora and s[1] <= span[1] and span[2] <= s[2] and s[3] >= slots and s[4] >= longest
           for s in engine._warm_spans):
        return 0
    engine._warm_spans.add(span)
    launch_at = lambda tokens: tuple((lora, launch) for launch in forward.prefill_launches(tokens))  # noqa: E731
    blocks = prefill_blocks(launch_at, span[1], span[2], slots, longest, engine._warm_launches)
    device = forward.view.device
    for rows, length in blocks:
        tokens = torch.zeros(rows, length, dtype=torch.long, device=device)
        positions = torch.arange(length, device=device).repeat(rows, 1)
        forward.prefill(tokens, positions, None, cache)
    return len(blocks)


def _compiles(device: torch.device) -> bool:
    """Whether kernels are compiled on first use there (CUDA: Triton); the CPU paths compile nothing."""
    return device.type == "cuda"


class _Slots:
    """The device-side state of the rows and the host's view of which sequence each row holds."""

    def __init__(self, slots: int, max_new: int, device: torch.device):
        self.seq = [-1] * slots  # the sequence a row holds (-1: idle)
        self.last = [0] * slots  # the iteration of the row's last token if it runs to its budget (host copy)
        self.pad = torch.zeros(slots, dtype=torch.long, device=device)
        self.first = torch.zeros(slots, dtype=torch.long, device=device)  # iteration of the row's token 0
        self.cap = torch.ones(slots, dtype=torch.long, device=device)
        self.done = torch.ones(slots, dtype=torch.bool, device=device)
        self.token = torch.zeros(slots, dtype=torch.long, device=device)
        # one column more than the longest sequence needs: done and idle rows write their junk there
        self.out_tokens = torch.zeros(slots, max_new + 1, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(slots, max_new + 1, dtype=torch.float32, device=device)


def run_continuous(engine, forward, prompts, caps, params, seed, stops, timing: bool, row_seeds,
                   slots: int) -> list:
    """Generate every prompt with at most ``slots`` rows decoding at once (module docstring). The
    arguments are ``RolloutEngine._run``'s; returns one ``Completion`` per prompt, in order."""
    from qerl_lib.engine.rollout import Timing, _completions, _now

    view = forward.view
    device = view.device
    n, max_new = len(prompts), max(caps)
    slots = min(slots, n)
    plen = max(len(p) for p in prompts)  # every refill fits before the write column, which stays >= plen
    cache = engine._ensure_cache(forward, slots, plen + max_new - 1 + headroom(engine))
    limit = cache.length
    warm_s = _now(device, timing)  # the warm is a one-time cost of the engine, outside the call's prefill and decode
    warm = warm_prefill_launches(engine, forward, cache, [len(p) for p in prompts], slots) if _compiles(device) else 0
    warm_s = _now(device, timing) - warm_s
    stop_tensor = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
    generator = torch.Generator(device=device).manual_seed(int(seed)) if seed is not None else None
    streams = None
    if row_seeds is not None and not params.greedy:
        streams = RowStreams(row_seeds[:slots], device)
    state = _Slots(slots, max_new, device)
    results: list = [None] * n
    stats = {"refills": 0, "refill_prefills": 0, "compactions": 0, "refill_s": 0.0,  # the schedule (Timing.extra)
             "warm_prefills": warm, "warm_s": warm_s,
             "admissions": []}  # [sequence, row, decode step it was prefilled before] per prompt, in admission order
    refill_rows = max(1, slots // 8)  # free rows that make a refill (fewer when the queue has fewer)
    t0 = _now(device, timing)

    def admit(rows: list[int], seqs: list[int], column: int, iteration: int, reseed: bool) -> None:
        """Prefill ``seqs`` into ``rows``, ending at cache column ``column``; sample their token 0."""
        block = [prompts[i] for i in seqs]
        start = column - max(len(p) for p in block)
        tokens, positions, pad, mask = left_padded(block, start)
        rows_t = torch.tensor(rows, dtype=torch.long, device=device)
        logits = forward.prefill(tokens.to(device), positions.to(device), None if mask is None else mask.to(device),
                                 cache, rows=rows_t, start=start)
        race = None
        if streams is not None:
            if reseed:
                streams.reseed(rows, [row_seeds[i] for i in seqs])
            race = streams.exponentials(logits.shape[-1], 0, rows=rows)
        token, logprob = sample(logits, params, generator, race)
        caps_t = torch.tensor([caps[i] for i in seqs], dtype=torch.long, device=device)
        done = caps_t <= 1
        if stop_tensor is not None:
            done |= torch.isin(token, stop_tensor)
        state.pad[rows_t], state.first[rows_t], state.cap[rows_t] = pad.to(device), iteration, caps_t
        state.token[rows_t], state.done[rows_t] = token, done
        state.out_tokens[rows_t, 0], state.out_logprobs[rows_t, 0] = token, logprob
        for r, i in zip(rows, seqs):
            state.seq[r], state.last[r] = i, iteration + caps[i] - 1
            stats["admissions"].append([i, r, iteration])

    admit(list(range(slots)), list(range(slots)), plen, 0, reseed=False)
    queue = list(range(slots, n))
    t1 = _now(device, timing)

    def decoder():  # (re)reads state.pad into the graphs' static buffer
        return engine._decoder(forward, slots, state.pad, plen, padded=True)

    step = decoder()
    column, iteration, due = plen, 0, 0
    while True:
        # check every check_every steps (rows that met a stop token), and at the step by which enough rows
        # reach their token budgets (known on the host) for the next refill
        if iteration % engine.check_every == 0 or iteration >= due:
            finished = [r for r, flag in enumerate(state.done.tolist()) if flag and state.seq[r] >= 0]
            if finished:  # hand the finished rows' tokens over
                rows_t = torch.tensor(finished, dtype=torch.long, device=device)
                got = _completions(state.out_tokens[rows_t].cpu(), state.out_logprobs[rows_t].cpu(), set(stops),
                                   [caps[state.seq[r]] for r in finished])
                for r, completion in zip(finished, got):
                    results[state.seq[r]], state.seq[r] = completion, -1
            idle = [r for r, i in enumerate(state.seq) if i < 0]
            if not queue and len(idle) == slots:
                break
            if column + engine.check_every > limit:
                column = _compact(cache, state, column, plen, stats)
                step = decoder()
            wanted = min(refill_rows, len(queue))  # refill in groups: one prefill call costs ~a decode step or more
            if queue and len(idle) >= wanted:
                take = idle[:len(queue)]
                t_refill = _now(device, timing)
                admit(take, queue[:len(take)], column, iteration, reseed=True)
                stats["refill_s"] += _now(device, timing) - t_refill
                del queue[:len(take)]
                stats["refills"] += len(take)
                stats["refill_prefills"] += 1
                step = decoder()
                idle = idle[len(take):]
            # the next budget-driven check: when the rows still needed for a refill (or, with an empty queue,
            # all rows) have reached their budgets; rows that stop early are found by the periodic checks
            lasts = sorted(state.last[r] for r, i in enumerate(state.seq) if i >= 0)
            need = min(refill_rows, len(queue)) - len(idle) if queue else len(lasts)
            due = lasts[need - 1] if 0 < need <= len(lasts) else iteration + engine.check_every
        logits = step(state.token, column)
        column += 1
        iteration += 1
        position = iteration - state.first  # each row's own token index
        race = streams.exponentials(logits.shape[-1], position) if streams is not None else None
        token, logprob = sample(logits, params, generator, race)
        index = position.clamp(max=max_new)[:, None]  # done and idle rows write past their end: junk
        state.out_tokens.scatter_(1, index, token[:, None])
        state.out_logprobs.scatter_(1, index, logprob[:, None])
        state.token = token
        if stop_tensor is not None:
            state.done |= torch.isin(token, stop_tensor)
        state.done |= position + 1 >= state.cap
    t2 = _now(device, timing)
    if timing:
        engine.last_timing = Timing(prefill_s=t1 - t0, decode_s=t2 - t1, steps=iteration, batch=slots,
                                    extra={"backend": engine.decode_backend, "cache_bytes": cache.nbytes,
                                           "scheduling": "continuous", "prompts": n, **stats})
    return results


def _compact(cache, state: _Slots, column: int, plen: int, stats: dict) -> int:
    """Move every row's columns left by the start of the oldest live sequence (but keep the write
    column >= ``plen``, so any queued prompt still fits before it); returns the new write column."""
    live = [r for r, i in enumerate(state.seq) if i >= 0]
    stats["compactions"] += 1
    if not live:  # nothing to keep: start over at the first column every prompt fits before
        state.pad.zero_()
        return plen
    pads = state.pad.tolist()
    shift = min(min(pads[r] for r in live), column - plen)
    if shift <= 0:
        raise RuntimeError(f"continuous batching: no cache column to free at column {column} "
                           f"(cache length {cache.length}); raise the engine's length_step")
    width = column - shift
    for begin in range(0, width, shift):  # chunks no wider than the shift: a chunk's source is never its target
        end = min(begin + shift, width)
        for t in (cache.k, cache.v):
            t[:, :, :, begin:end].copy_(t[:, :, :, begin + shift:end + shift])
    state.pad.sub_(shift).clamp_(min=0)  # idle rows (pad < shift) decode junk from column 0
    return width
