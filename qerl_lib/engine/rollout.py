"""The rollout engine: batched sampling with a KV cache from the policy the trainer optimizes.

GRPO spends most of its time generating. ``transformers``' ``generate`` is built for generality
and is far from the hardware at small batch (3.5k tokens/s for the 135M embedded model at
batch 64 on an H200, bound by its Python loop). This engine is small enough to read in one
sitting (like gpt-fast or nanochat's ``engine.py``) and samples from exactly the model the
trainer holds: an NVFP4 or bf16 base called through its own modules, LoRA adapters applied
*unmerged* (they change every step; the packed FP4 weights never do), and RMSNorm weights that
AQN may replace per call.

How one call works
------------------
1. **Validate** everything before touching the GPU: architecture (Llama / Qwen2), sampling
   parameters, that ``longest prompt + max_new_tokens`` fits ``max_seq_len`` (default: the
   model's ``max_position_embeddings``), token ids, LoRA and norm-override names.
2. **Left-pad** the prompts to the longest one, ``P`` tokens (right-padded input is re-packed).
   Row ``r`` with ``pad[r]`` pad tokens has RoPE positions ``0, 1, ...`` starting at its first
   real token, so padding never shifts positions, and a mask keeps real tokens from attending
   to pads. Left padding makes decode step ``t`` write cache column ``P + t`` for every row.
3. **Prefill**: one batched forward over ``[B, P]`` fills cache columns ``[0, P)`` and gives the
   logits of the first new token.
4. **Decode**: one token per row per step. On CUDA the step is replayed from a CUDA graph
   captured per (batch bucket, cache-length bucket) (``engine/cache.py``); on CPU it runs eagerly.
   Sampling (``engine/sampling.py``) runs after the step, from a ``torch.Generator`` seeded with
   ``seed``, or from one stream per row seeded with ``row_seeds[r]`` (``sampling.RowStreams``: a
   row's completion then does not depend on the rest of the batch).
5. **Stop** rows independently: a row is finished at its first stop token (kept in the output,
   ``finish_reason="stop"``) or at ``max_new_tokens`` (``"length"``; one budget for all rows, or one
   per row, e.g. a workload of uneven lengths). Finished rows keep
   stepping with the batch (their extra tokens are discarded) instead of compacting the batch:
   decode is bound by reading the weights, so a finished row costs almost nothing, and a fixed
   batch keeps the graph valid. The loop checks every ``check_every`` steps (one host sync)
   whether every row has finished, and stops early.

What you get back: one ``Completion(token_ids, logprobs, finish_reason)`` per prompt, the prompt
excluded. ``logprobs[t]`` is the log-probability of ``token_ids[t]`` under the distribution it was
sampled from (after temperature, top-k, top-p; see ``sampling``) or, for greedy decoding
(``temperature=0``), under the raw model distribution. ``to_padded`` turns completions into the
padded ``ids / mask / logprobs`` tensors a trainer wants.

How this differs from vLLM (what the paper used)
------------------------------------------------
No paged attention: the cache is one dense tensor. A call's batch is fixed unless ``max_batch``
is given, in which case more prompts than rows are run by continuous batching
(``engine/continuous.py``): a finished row is refilled from the queue at the next check.
No prefix sharing: a GRPO group's identical prompts are each prefilled (the prompt is short
next to the 2048-token completion). LoRA runs as two plain matmuls per adapter group rather
than punica's fused kernels. These choices cost peak throughput at large batch, not
correctness.

Caveats: graphs replay fixed addresses, so update adapters and weights *in place* (optimizers
do); swapping modules or toggling peft adapters is detected and re-captures. The KV cache and
graphs are kept between calls for speed; ``RolloutEngine.release()`` gives the cache's memory back before
training and, with CUDA's virtual memory (``engine/remap.py``), keeps the graphs for the next call.

Measured (``qerl bench rollout``; the results files are indexed in results/README.md)
-------------------------------------------------------------------------------------
SmolLM2-135M bf16, batch 64, 256 + 512 tokens: 48.1k tokens/s against 3.5k for transformers'
``generate`` (13.8x, H200, ``results/rollout_h200.json``). Qwen2.5-7B shapes, batch 8,
256 + 2048 tokens (``results/rollout_h200.json``, H200): bf16 1737 tokens/s, NVFP4 3088
(2.56 ms per step). How each part of the engine got there is in dev/LOG.md.
"""

from __future__ import annotations

import functools
import time
import warnings
import weakref
from dataclasses import dataclass, field

import torch

from qerl_lib.engine.attention import AttentionLaunch
from qerl_lib.engine.cache import BATCH_BUCKETS, DecodeGraphs, KVCache, batch_bucket, length_bucket
from qerl_lib.engine.continuous import left_padded, run_continuous
from qerl_lib.engine.forward import SUPPORTED_MODEL_TYPES, ForwardPass, ModelView
from qerl_lib.engine.remap import DriverError, supported
from qerl_lib.engine.adapters import LoraAdapter, lora_from_peft
from qerl_lib.engine.sampling import RowStreams, SamplingParams, sample

__all__ = ["Completion", "RolloutEngine", "generate", "release", "to_padded", "LoraAdapter", "lora_from_peft",
           "SUPPORTED_MODEL_TYPES"]

DECODE_BACKENDS = ("auto", "eager", "graphs", "graphs+fused", "compile")


def resolve_decode_backend(backend: str, device_type: str) -> str:
    """What ``backend`` runs: "auto" is graphs+fused on CUDA (H200: 1.35-2x graphs' speed), else eager."""
    return ("graphs+fused" if device_type == "cuda" else "eager") if backend == "auto" else backend


@dataclass
class Completion:
    """One generated continuation (prompt excluded)."""

    token_ids: list[int]
    logprobs: list[float]  # of each token under its sampling distribution (raw one when greedy)
    finish_reason: str  # "stop" (ended with a stop token, included in token_ids) or "length"


@dataclass
class Timing:
    """Wall-clock split of the last call (filled when ``generate(..., timing=True)``)."""

    prefill_s: float = 0.0  # prompt forward + first token: time to first token
    decode_s: float = 0.0  # every later token
    steps: int = 0  # decode steps run (tokens per row after the first)
    batch: int = 0
    extra: dict = field(default_factory=dict)
    load_s: float = 0.0  # before the prefill: the call's adapters and norm weights copied (merged) into the engine


def _on_model_gpu(method):
    """Run an engine method with the model's GPU as the current device: Triton, the NVRTC kernels and graph
    capture launch on the current device's stream, so an engine on cuda:1 called while cuda:0 is current (one
    process driving two GPUs) would launch its kernels on the wrong GPU (dev/LOG.md section 114)."""
    @functools.wraps(method)
    def on_gpu(self, *args, **kwargs):
        if self._view.device.type != "cuda":
            return method(self, *args, **kwargs)
        with torch.cuda.device(self._view.device):
            return method(self, *args, **kwargs)
    return on_gpu


class RolloutEngine:
    """Reusable engine for one model: keeps the KV cache and the captured decode graphs.

    ``decode_backend``: "auto" ("graphs+fused" on CUDA, "eager" on CPU), "eager", "graphs"
    (CUDA graphs of the eager step), "graphs+fused" (CUDA graphs of a step whose elementwise glue
    is fused by ``torch.compile``), or "compile" (``torch.compile(mode="reduce-overhead")`` of the
    whole step, attending over the full cache). On an H200 (decode, 256+512 tokens) "graphs+fused"
    ran a SmolLM2-shaped model at batch 64 twice as fast as "graphs", and Qwen2.5-7B shapes at
    batch 8 1.35x as fast (dev/LOG.md). "compile" compiles for minutes and is not a
    default: the KV cache is marked a static address so that its CUDA graphs can run.
    ``decode_attention``: "sdpa" (HF numerics, CPU default), "matmul" (torch ops, K/V read once) or
    "kernel" (split-KV Triton kernel, ``engine/attention.py``; CUDA default).
    ``fuse_projections``: run q/k/v and gate/up as one matmul each over shared storage
    (``models/fused.py``; default: on CUDA). The model's modules become views of the shared buffers.
    On an H100 this made Qwen2.5-7B shapes (batch 8, 256 + 2048 tokens) 8-10% faster in bf16 and
    NVFP4 (dev/LOG.md).
    ``glue_kernels``: in "graphs+fused", the norms and SiLU * up run as ``engine/glue.py``'s Triton
    kernels, which let the next NVFP4 matmul launch early (default on; off: ``torch.compile``'s).
    ``attention_launch``: the decode-attention kernel's launch shape
    (``engine.attention.AttentionLaunch``; None: its default).
    ``lora_kernels``: adapters passed as ``lora=`` run through ``kernels/lora.py`` (two Triton
    launches per projection group, the first overlapping the base GEMM) at up to 256 rows per call;
    default: on CUDA except with "compile" (whose traced step keeps torch ops). Off: one matmul per
    group plus one ``addmm`` per member. ``lora_in_gemm``: with those kernels, an NVFP4 group whose GEMM
    runs on the mma.sync kernel (decode, M <= 8) has that kernel add its adapters in the same launch
    (default off: it measured slower than the two-launch path on an H100, dev/LOG.md section 25).
    ``lora_fold``: with those kernels and the glue kernels, the gate/up group's expand is added by the
    SiLU x up kernel instead of a launch of its own (``engine/glue.silu_mul``); default (None): above 8
    rows, where it measured faster on an H100 (slower at batch 8; dev/LOG.md section 29).
    ``lora_merge``: adapters on dense (bf16) projection groups are merged into engine-owned weight copies,
    ``round(W + s B A)``, rewritten at every call (``engine/merged.py``): no adapter launches at all, for one
    copy of those weights in memory (7B: 12.2 GiB) and one pass over them per call. NVFP4 and NF4 groups keep
    their adapters unmerged. Off by default.
    ``remap_cache``: the KV cache lives in CUDA virtual memory (``engine/remap.py``), so ``release()`` gives
    its memory back and keeps the decode graphs, and the next call maps memory at the same addresses instead
    of capturing every length bucket again (0.5-0.7 s a 7B rollout, dev/LOG.md section 104). Default (None):
    on with CUDA graphs where the driver supports it. ``lora_merge``'s copies live in the same kind of memory
    and are given back with the cache.
    """

    def __init__(self, model, max_seq_len: int | None = None, decode_backend: str = "auto",
                 decode_attention: str | None = None, length_step: int = 256,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, check_every: int = 16, keep_alive: bool = True,
                 fuse_projections: bool | None = None, glue_kernels: bool = True,
                 attention_launch: AttentionLaunch | None = None, lora_kernels: bool | None = None,
                 lora_in_gemm: bool = False, lora_fold: bool | None = None, lora_merge: bool = False,
                 remap_cache: bool | None = None):
        if decode_backend not in DECODE_BACKENDS:
            raise ValueError(f"decode_backend must be one of {DECODE_BACKENDS}, got {decode_backend!r}")
        view = ModelView(model)  # validates the architecture now, not at the first call
        on_cuda = view.device.type == "cuda"
        self.decode_backend = decode_backend = resolve_decode_backend(decode_backend, view.device.type)
        if decode_backend in ("graphs+fused", "compile") and not on_cuda:
            raise ValueError(f"decode_backend {decode_backend!r} needs a CUDA model; use 'eager' on {view.device}")
        # ("graphs" off CUDA runs the graph path's buffers and buckets without capturing: a test aid.)
        # ("compile" traces the whole step with torch.compile, which the Triton attention kernel's launch
        # logic would break into pieces: it keeps the torch-ops attention)
        self.decode_attention = decode_attention or (("matmul" if decode_backend == "compile" else "kernel")
                                                     if on_cuda else "sdpa")
        # q/k/v and gate/up as one matmul each (models/fused.py); off on CPU, where greedy tokens match HF bit for bit
        self.fuse_projections = on_cuda if fuse_projections is None else bool(fuse_projections)
        # norms and SiLU * up of the fused decode step as engine/glue.py's Triton kernels
        self.glue_kernels = bool(glue_kernels)
        self.attention_launch = attention_launch
        self.lora_kernels = (on_cuda and decode_backend != "compile") if lora_kernels is None else bool(lora_kernels)
        self.lora_in_gemm = bool(lora_in_gemm)
        self.lora_fold = None if lora_fold is None else bool(lora_fold)
        self.lora_merge = bool(lora_merge)
        if remap_cache is None:
            remap_cache = decode_backend in ("graphs", "graphs+fused") and supported(view.device)
        elif remap_cache and decode_backend not in ("graphs", "graphs+fused"):
            raise ValueError(f"remap_cache keeps CUDA graphs valid across release(): it needs decode_backend "
                             f"'graphs' or 'graphs+fused', not {decode_backend!r}")
        self.remap_cache = bool(remap_cache) and on_cuda
        self.max_seq_len = int(max_seq_len or view.max_positions or 4096)
        self.length_step = int(length_step)
        self.batch_buckets = tuple(batch_buckets)
        self.check_every = int(check_every)
        self._model_ref = weakref.ref(model)
        self._keep = model if keep_alive else None
        self._view, self._forward, self._signature = view, None, None
        self.cache: KVCache | None = None
        self.graphs: DecodeGraphs | None = None
        self._compiled = None
        # prefill kernel launches already met, and the token spans already scanned (continuous.warm_prefill_launches)
        self._warm_launches: set = set()
        self._warm_spans: set = set()
        self.last_timing = Timing()

    # ---- public ---------------------------------------------------------------------------------
    @_on_model_gpu
    def generate(self, prompt_ids, max_new_tokens, temperature: float = 1.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int | None = None, stop_token_ids=None, lora=None, norm_overrides=None,
                 prompt_mask: torch.Tensor | None = None, timing: bool = False, row_seeds=None,
                 max_batch: int | None = None) -> list[Completion]:
        """See ``qerl_lib.engine.rollout.generate``."""
        params = SamplingParams(temperature, top_p, top_k)
        if max_batch is not None and (isinstance(max_batch, bool) or int(max_batch) != max_batch or max_batch < 1):
            raise ValueError(f"max_batch must be a positive integer (rows decoding at once) or None, got {max_batch!r}")
        if row_seeds is not None and seed is not None:
            raise ValueError("pass seed (one stream for the call) or row_seeds (one per prompt), not both")
        prompts = _as_prompt_lists(prompt_ids, prompt_mask)
        if not prompts:
            return []
        caps = _token_budgets(max_new_tokens, len(prompts))
        max_new_tokens = max(caps)
        if row_seeds is not None:
            row_seeds = [int(s) for s in row_seeds]
            if len(row_seeds) != len(prompts):
                raise ValueError(f"row_seeds has {len(row_seeds)} seeds for {len(prompts)} prompts: give one per prompt")
        model = self._model_ref()
        if model is None:
            raise RuntimeError("the model behind this engine was garbage-collected")
        forward = self._prepare(model, lora)
        view = forward.view
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.max_seq_len:
            raise ValueError(f"prompt of {longest} tokens + max_new_tokens={max_new_tokens} exceeds the cache limit "
                             f"max_seq_len={self.max_seq_len}: shorten the prompt, lower max_new_tokens, "
                             "or raise max_seq_len (up to the model's max_position_embeddings)")
        top = max(max(p) for p in prompts)
        low = min(min(p) for p in prompts)
        if low < 0 or top >= view.vocab_size:
            raise ValueError(f"token ids must be in [0, {view.vocab_size}), got values in [{low}, {top}]")
        stops = view.default_stop_ids if stop_token_ids is None else tuple(int(t) for t in stop_token_ids)
        adapters = _as_adapters(lora)
        t_load = _now(view.device, timing)
        forward.load_norm_weights(norm_overrides)
        if forward.load_lora(adapters) and self.graphs is not None:
            self.graphs.clear()
        load_s = _now(view.device, timing) - t_load
        training = [(m, m.training) for m in model.modules()]
        model.eval()  # no dropout in rollouts (peft's LoRA dropout included); restored below
        try:
            with torch.no_grad():
                if max_batch is not None and len(prompts) > max_batch:
                    out = run_continuous(self, forward, prompts, caps, params, seed, stops, timing, row_seeds,
                                         int(max_batch))
                else:
                    out = self._run(forward, prompts, caps, params, seed, stops, timing, row_seeds)
                self.last_timing.load_s = load_s
                return out
        finally:
            for m, flag in training:
                m.training = flag

    @_on_model_gpu
    def warmup(self, batch: int, prompt_len: int, max_new_tokens: int, lora=None) -> None:
        """Do the one-time work of a (batch, prompt_len, max_new_tokens) call before timing one:
        a short generation (kernel selection, Triton autotuning at these shapes), then a capture
        of the decode graph of every length bucket the call will visit. The captures run one
        step each at the bucket's last column; the K/V they write there are overwritten before
        any real step reads them (a step writes its column before attending to it)."""
        prompts = [[1] * prompt_len for _ in range(batch)]
        # also builds the forward pass, and compiles the fused sampler (temperature > 0 on CUDA)
        self.generate(prompts, 2, temperature=1.0, seed=0, stop_token_ids=[], lora=lora)
        if self.decode_backend == "eager":
            return
        device = self._view.device
        self._ensure_cache(self._forward, batch, prompt_len + max_new_tokens - 1)  # full size now
        step = self._decoder(self._forward, batch, torch.zeros(batch, dtype=torch.long, device=device), prompt_len,
                             padded=False)
        token = torch.zeros(batch, dtype=torch.long, device=device)
        last = prompt_len + max_new_tokens - 2  # the last column a call writes
        if self.decode_backend == "compile":  # one graph over the whole cache
            columns = [last]
        else:  # the last column of every length bucket up to `last`
            columns = sorted({min(c, last) for c in range(self.length_step - 1, last + self.length_step,
                                                          self.length_step)})
        with torch.no_grad():
            for column in columns:
                step(token, column)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def release(self) -> None:
        """Give the KV cache's memory and any merged weight copies back until the next call. Remappable ones
        (``remap_cache``) keep their addresses and the graphs that use them; otherwise the graphs go too."""
        merged = self._forward.merged if self._forward is not None else None
        copies = merged is not None and bool(merged.layout)  # (an NVFP4 base merges nothing: no copies)
        if self.cache is not None and self.cache.remappable and (not copies or merged.remappable):
            self.cache.unmap()
            if copies:
                merged.unmap()
            return
        self._free_all()

    def _free_all(self) -> None:
        self._free_cache()
        if self._forward is not None:
            self._forward.drop_merged()

    @property
    def resident_cache_bytes(self) -> int:
        """Bytes of KV cache memory allocated now (0 after ``release()``)."""
        return self.cache.nbytes if self.cache is not None and self.cache.resident else 0

    def _free_cache(self) -> None:
        if self.graphs is not None:  # the graphs go before the memory they point into
            self.graphs.clear()
            self.graphs = None
        if self.cache is not None:
            self.cache.close()
        self.cache, self._compiled = None, None

    # ---- internals ------------------------------------------------------------------------------
    def _prepare(self, model, lora) -> ForwardPass:
        """(Re)build the forward pass if the model's modules or the LoRA mode changed."""
        view = ModelView(model)
        bypass = lora is not None and view.is_peft
        signature = (view.signature(), bypass)
        if signature != self._signature or (self._forward is not None and self._forward.is_stale()):
            self._free_all()  # the graphs belong to the old pass: a remappable cache goes with them
            self._forward = None  # drop the old pass (and its fused-buffer references) before fusing anew
            fuse = self.decode_backend == "graphs+fused"
            self._forward = ForwardPass(view, self.decode_attention, fuse_elementwise=fuse, bypass_peft=bypass,
                                        glue_kernels=self.glue_kernels, fuse_projections=self.fuse_projections,
                                        attention_launch=self.attention_launch, lora_kernels=self.lora_kernels,
                                        lora_in_gemm=self.lora_in_gemm, lora_fold=self.lora_fold,
                                        lora_merge=self.lora_merge, remap_merged=self.remap_cache)
            self._signature, self._view = signature, view
        return self._forward

    def _ensure_cache(self, forward: ForwardPass, batch: int, columns: int) -> KVCache:
        view = forward.view
        if self.decode_backend == "eager":
            rows, length = batch, columns
        else:
            rows = batch_bucket(batch, self.batch_buckets)
            length = length_bucket(columns, self.length_step, max(self.max_seq_len, columns))
        if self.cache is not None and self.cache.fits(rows, length):
            self.cache.map()  # (a released remappable cache: memory at its old addresses again)
            return self.cache
        self._free_cache()  # (not the merged copies: this call's adapters are in them already)
        shape = (view.n_layers, rows, view.n_kv_heads, length, view.head_dim, view.dtype, view.device)
        try:
            self.cache = KVCache(*shape, remappable=self.remap_cache)
        except DriverError as error:  # the driver refused its virtual memory API (some sandboxes): the plain cache
            warnings.warn(f"remap_cache off: {error}; the decode graphs will be captured again after each release()",
                          stacklevel=2)
            self.remap_cache = False
            self.cache = KVCache(*shape)
        return self.cache

    def _run(self, forward, prompts, caps, params, seed, stops, timing, row_seeds=None) -> list[Completion]:
        view = forward.view
        max_new_tokens = max(caps)
        device = view.device
        batch, plen = len(prompts), max(len(p) for p in prompts)
        t0 = _now(device, timing)

        # Left-padded prompt block, per-row pad counts, RoPE positions, prefill mask.
        tokens, positions, pad, mask = left_padded(prompts)
        padded = mask is not None
        tokens, positions, pad = tokens.to(device), positions.to(device), pad.to(device)
        mask = mask.to(device) if padded else None
        cache = self._ensure_cache(forward, batch, plen + max_new_tokens - 1)
        generator = torch.Generator(device=device).manual_seed(int(seed)) if seed is not None else None
        streams = RowStreams(row_seeds, device) if row_seeds is not None and not params.greedy else None

        def draw(logits, position):
            race = streams.exponentials(logits.shape[-1], position) if streams is not None else None
            return sample(logits, params, generator, race)
        stop_tensor = torch.tensor(stops, dtype=torch.long, device=device) if stops else None
        # per-row token budgets: a row is done once it has its budget (None: every row has max_new_tokens)
        budget = torch.tensor(caps, dtype=torch.long, device=device) if min(caps) < max_new_tokens else None
        can_end_early = stop_tensor is not None or budget is not None

        out_tokens = torch.empty(batch, max_new_tokens, dtype=torch.long, device=device)
        out_logprobs = torch.empty(batch, max_new_tokens, dtype=torch.float32, device=device)
        done = torch.zeros(batch, dtype=torch.bool, device=device)

        logits = forward.prefill(tokens, positions, mask, cache)
        token, logprob = draw(logits, 0)
        out_tokens[:, 0], out_logprobs[:, 0] = token, logprob
        if stop_tensor is not None:
            done |= torch.isin(token, stop_tensor)
        if budget is not None:
            done |= budget <= 1
        t1 = _now(device, timing)

        step = self._decoder(forward, batch, pad, plen, padded)
        steps = 0
        for t in range(1, max_new_tokens):
            if can_end_early and t % self.check_every == 0 and bool(done.all()):
                break
            logits = step(token, plen + t - 1)
            token, logprob = draw(logits, t)
            out_tokens[:, t], out_logprobs[:, t] = token, logprob
            if stop_tensor is not None:
                done |= torch.isin(token, stop_tensor)
            if budget is not None:
                done |= budget <= t + 1
            steps = t
        t2 = _now(device, timing)
        if timing:
            self.last_timing = Timing(prefill_s=t1 - t0, decode_s=t2 - t1, steps=steps, batch=batch,
                                      extra={"backend": self.decode_backend, "cache_bytes": cache.nbytes})
        return _completions(out_tokens[:, :steps + 1].cpu(), out_logprobs[:, :steps + 1].cpu(), set(stops), caps)

    def _decoder(self, forward: ForwardPass, batch: int, pad: torch.Tensor, plen: int, padded: bool):
        """A function ``(last tokens [batch], column) -> logits [batch, V]`` for this call's backend."""
        cache = self.cache
        if self.decode_backend == "eager":
            column = torch.zeros(1, dtype=torch.long, device=pad.device)

            def eager_step(token, col):
                column.fill_(col)
                # exact length, and no mask when nothing is padded: the same calls HF makes
                return forward.decode_step(token, column, pad, col + 1, cache, masked=padded)
            return eager_step

        rows = batch_bucket(batch, self.batch_buckets)
        forward.reserve_columns(cache.length)
        if self.graphs is None:
            self.graphs = DecodeGraphs(lambda tok, col, pd, kv: forward.decode_step(tok, col, pd, kv, cache),
                                       pad.device)
        tok_buf, col_buf, pad_buf = self.graphs.static_inputs(rows)
        pad_buf[:batch] = pad
        pad_buf[batch:] = plen  # spare rows attend only to the decode columns they write themselves
        tok_buf[batch:] = 0

        if self.decode_backend == "compile":
            if self._compiled is None:
                self._compiled = torch.compile(forward.decode_step, mode="reduce-overhead", dynamic=False)

            def compiled_step(token, col):
                tok_buf[:batch] = token
                col_buf.fill_(col)
                return self._compiled(tok_buf, col_buf, pad_buf, cache.length, cache)[:batch]
            return compiled_step

        def graph_step(token, col):
            tok_buf[:batch] = token
            col_buf.fill_(col)
            kv_len = length_bucket(col + 1, self.length_step, cache.length)
            return self.graphs.run(rows, kv_len)[:batch]
        return graph_step


# ---- the functional API -------------------------------------------------------------------------
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def generate(model, prompt_ids, max_new_tokens, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0,
             seed: int | None = None, stop_token_ids=None, lora=None, norm_overrides=None, *,
             prompt_mask: torch.Tensor | None = None, max_seq_len: int | None = None,
             decode_backend: str = "auto", row_seeds=None, max_batch: int | None = None) -> list[Completion]:
    """Sample continuations of a batch of prompts from a Llama/Qwen2 causal LM (bf16 or NVFP4).

    prompt_ids: list of prompts (lists or 1-D tensors of token ids, any lengths), or a 2-D tensor
        with ``prompt_mask`` marking real tokens (left or right padding). ``[]`` gives ``[]``.
    max_new_tokens: tokens to generate at most: one int for every prompt, or a list of one per prompt
        (a row is done at its own budget; the call runs until the last row is done).
    temperature: 0 = greedy. ``top_p`` / ``top_k`` filter the distribution (1.0 / 0 = off).
    seed: seeds this call's ``torch.Generator``; same seed, batch and device give the same samples.
    row_seeds: instead of ``seed``, one integer in [0, 2^64) per prompt: row ``r`` samples from its own
        stream (``sampling.RowStreams``), so its completion does not depend on the other rows, their
        number or order (same device and weights; batched matmuls can still differ in the last bits).
    stop_token_ids: default: the model's ``generation_config.eos_token_id``; ``[]`` = never stop early.
    lora: ``{module name: LoraAdapter}`` (or ``(A, B, scale)`` tuples), e.g. ``lora_from_peft(peft_model)``,
        applied unmerged by the engine. A PeftModel passed as ``model`` runs its own adapters unmerged
        without this argument.
    norm_overrides: ``{"model.layers.3.input_layernorm": weight, ...}`` used instead of those RMSNorm
        weights for this call only (AQN's noisy weights); the model's parameters are never modified.
    max_batch: at most this many rows decode at once; further prompts queue and each takes the row of
        the next sequence to finish (continuous batching, ``engine/continuous.py``). None: all prompts
        in one batch. The KV cache holds ``max_batch`` rows.

    Returns one ``Completion`` per prompt. The engine (KV cache, CUDA graphs) is cached per model
    and reused; ``release(model)`` frees it.
    """
    engine = _ENGINES.get(model)
    if engine is None or engine.max_seq_len != (max_seq_len or engine.max_seq_len) or \
            decode_backend not in ("auto", engine.decode_backend):
        engine = RolloutEngine(model, max_seq_len=max_seq_len, decode_backend=decode_backend, keep_alive=False)
        _ENGINES[model] = engine
    return engine.generate(prompt_ids, max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                           stop_token_ids=stop_token_ids, lora=lora, norm_overrides=norm_overrides,
                           prompt_mask=prompt_mask, row_seeds=row_seeds, max_batch=max_batch)


def release(model) -> None:
    """Free the cached engine's KV cache and CUDA graphs for ``model`` (e.g. before a training step)."""
    engine = _ENGINES.pop(model, None)
    if engine is not None:
        engine.release()


def to_padded(completions: list[Completion], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids [B, T] long, mask [B, T] bool, logprobs [B, T] float32)``, right-padded with ``pad_id`` / 0."""
    width = max((len(c.token_ids) for c in completions), default=0)
    ids = torch.full((len(completions), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(completions), width, dtype=torch.bool)
    logprobs = torch.zeros(len(completions), width, dtype=torch.float32)
    for r, c in enumerate(completions):
        n = len(c.token_ids)
        ids[r, :n] = torch.tensor(c.token_ids, dtype=torch.long)
        mask[r, :n] = True
        logprobs[r, :n] = torch.tensor(c.logprobs, dtype=torch.float32)
    return ids, mask, logprobs


# ---- helpers ------------------------------------------------------------------------------------
def _as_prompt_lists(prompt_ids, prompt_mask) -> list[list[int]]:
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() != 2:
            raise ValueError(f"a tensor of prompts must be 2-D [batch, length], got shape {tuple(prompt_ids.shape)}")
        if prompt_mask is None:
            prompts = [row.tolist() for row in prompt_ids]
        elif prompt_mask.shape != prompt_ids.shape:
            raise ValueError(f"prompt_mask shape {tuple(prompt_mask.shape)} != "
                             f"prompt_ids shape {tuple(prompt_ids.shape)}")
        else:
            prompts = []
            for r, (row, keep) in enumerate(zip(prompt_ids.tolist(), prompt_mask.bool().tolist())):
                idx = [j for j, k in enumerate(keep) if k]
                if idx and idx[-1] - idx[0] + 1 != len(idx):
                    raise ValueError(f"prompt_mask row {r} is not one contiguous block: "
                                     "only left or right padding is supported")
                prompts.append([row[j] for j in idx])
    else:
        prompts = []
        for p in prompt_ids:
            if isinstance(p, (int,)) or (isinstance(p, torch.Tensor) and p.dim() == 0):
                raise ValueError("prompt_ids must be a list of prompts (each a list of token ids); "
                                 "wrap a single prompt in a list: [ids]")
            prompts.append(p.tolist() if isinstance(p, torch.Tensor) else [int(t) for t in p])
    for r, p in enumerate(prompts):
        if not p:
            _raise_empty(r)
    return prompts


def _raise_empty(r: int):
    raise ValueError(f"prompt {r} is empty: every prompt needs at least one token (e.g. the BOS token)")


def _as_adapters(lora) -> dict[str, LoraAdapter] | None:
    if lora is None:
        return None
    if not isinstance(lora, dict):
        raise ValueError("lora must be a dict {module name: LoraAdapter or (A, B, scale)}; "
                         "for a PeftModel pass the model itself, or lora_from_peft(peft_model)")
    return {name: a if isinstance(a, LoraAdapter) else LoraAdapter(*a) for name, a in lora.items()}


def _token_budgets(max_new_tokens, rows: int) -> list[int]:
    """``max_new_tokens`` as one budget per row (an int for all rows, or a sequence of one per prompt)."""
    caps = list(max_new_tokens) if isinstance(max_new_tokens, (list, tuple)) else [max_new_tokens] * rows
    if len(caps) != rows:
        raise ValueError(f"max_new_tokens has {len(caps)} budgets for {rows} prompts: give one int, or one per prompt")
    for cap in caps:
        if isinstance(cap, bool) or int(cap) != cap or cap < 1:
            raise ValueError(f"max_new_tokens must be positive integers, got {cap!r}")
    return [int(c) for c in caps]


def _completions(tokens: torch.Tensor, logprobs: torch.Tensor, stops: set[int], caps: list[int]) -> list[Completion]:
    out = []
    for row_t, row_l, cap in zip(tokens.tolist(), logprobs.tolist(), caps):
        row_t, row_l = row_t[:cap], row_l[:cap]
        end = next((j + 1 for j, t in enumerate(row_t) if t in stops), None)
        if end is None:
            out.append(Completion(row_t, row_l, "length"))
        else:
            out.append(Completion(row_t[:end], row_l[:end], "stop"))
    return out


def _now(device: torch.device, timing: bool) -> float:
    if timing and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
