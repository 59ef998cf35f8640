"""`qerl bench rollout`: rollout throughput and peak memory, bf16 vs NVFP4 (vs NF4) weights, with LoRA ranks.

What is measured
----------------
Each configuration (model, weights, batch, LoRA rank, decode backend, scheduling) generates after
``prompt_len``-token prompts either exactly ``gen_len`` tokens per row (``workload="fixed"``, stop
tokens ignored) or each row's own length (``"gsm8k-like"``, ``bench/workloads.py``), through
``qerl_lib.engine.rollout``. A rollout is ``prompts`` completions (default: one batch), run in
batches of ``batch`` (``scheduling="static"``) or on ``batch`` rows refilled as sequences end
(``"continuous"``, ``engine/continuous.py``):

* ``tok/s``: the rows' tokens / (prefill + decode wall time), the paper's "rollout throughput"
  (vLLM's generation throughput, prompt processing included); ``decode tok/s`` and ``ms/step``;
* ``TTFT``: prefill plus the first sampled token; ``slot_utilization``: tokens kept / row-steps run;
* ``peak``: ``torch.cuda.max_memory_allocated`` over the configuration (weights + activations + graph
  pools) plus the most the engine's remappable KV cache and copies had mapped (``engine/remap.py``; outside
  PyTorch's allocator, and mapped for the whole configuration), reset after the model is built; ``weights``: the built model's memory.

Method: ``engine.warmup`` first (one short generation for kernel selection and Triton autotuning,
then a CUDA-graph capture of every cache-length bucket), then ``repeats`` timed generations;
``transformers.generate`` gets one untimed full-length call first. The table shows the median
and the JSON keeps every repeat. Timings synchronise the device.

Models: ``smollm2`` is the embedded SmolLM2-135M-Instruct (real weights; NVFP4 by quantizing
them with ``replace_linear_with_nvfp4``), and the only model on which ``transformers``'
``generate`` is also timed, as the baseline the engine must beat. ``qwen2.5-{3b,7b,14b,32b}``
are random weights of the real shapes (``data/configs/``), which is all throughput depends on:
NVFP4 layers get random codes and block scales (``init="random_codes"``: same bytes and
kernel work as quantized weights, without quantizing 32B parameters first). ``smollm2-shape``
is SmolLM2's architecture with random weights, for when the embedded model is not at hand.
LoRA adapters of rank r on all seven projections are random too, applied unmerged by the engine.

Where this deviates from the paper's setup (Tables 5-9: vLLM on one H100, rollout batch 2/8,
256-token prompts, up to 2048 generated, gpu_memory_utilization matched): here generation is
fixed-length (the paper's completions stop at EOS, so its averages mix lengths), weights are
random, and the engine is this kit's rather than vLLM + Marlin. ``--engines kit,vllm`` adds vLLM's
rows on the very same checkpoint, adapters and prompts, in the same run (``bench/vllm_peer.py``);
``--weights nf4`` adds QLoRA's bitsandbytes NF4 base (``models/nf4.py``) to the kit's rows.

Output (the command line is `bench/rollout_cli.py`): ``--json`` is rewritten (atomically) after every
row, so a run cut short keeps the rows it finished, and the same command run again resumes it: its rows without
an error are kept, the rest measured, and a model whose rows are all kept is not even built (`plan_unit` says what
a case is, `bench/rollout_resume.py` which rows are kept and which files are refused; ``--force`` starts over).
Runs of other settings are combined with ``--merge`` (a configuration in both keeps the row of the file named later).
"""

from __future__ import annotations

import gc
import itertools
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace

import torch

from qerl_lib.bench.rollout_report import (PAPER_TOK_S, TABLE_COLUMNS, TARGETS, format_row,  # noqa: F401 (re-exported)
                                           merge_results, render_rollout_report, summarize)
from qerl_lib.bench.workloads import WORKLOADS
from qerl_lib.engine.attention import AttentionLaunch
from qerl_lib.kernels.fp4_gemm import SMALL_M_BACKENDS
from qerl_lib.models.fused import PARENT, PROJECTIONS

MODELS = ("smollm2", "smollm2-shape", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
WEIGHTS = ("bf16", "nvfp4", "nf4")  # nf4: QLoRA's base (bitsandbytes, double quantization; models/nf4.py)
DEFAULT_WEIGHTS = ("bf16", "nvfp4")
# SmolLM2-135M-Instruct's architecture (its config.json), for random-weight runs without the model files.
SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, initializer_range=0.02)
SCHEDULING = ("static", "continuous")


@dataclass
class RolloutBenchConfig:
    """One sweep: every model x weights x batch x rank x backend."""

    models: tuple[str, ...] = ("smollm2", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b")
    batches: tuple[int, ...] = (1, 2, 8, 32, 64)
    prompt_len: int = 256
    gen_len: int = 2048
    lora_ranks: tuple[int, ...] = (0,)
    weights: tuple[str, ...] = DEFAULT_WEIGHTS
    backends: tuple[str, ...] = ("auto",)  # engine decode backends to compare
    repeats: int = 2
    hf_baseline: bool = True  # also time transformers' generate on smollm2
    hf_gen_len: int | None = None  # generated tokens for the (slow) baseline; default gen_len
    hf_batches: tuple[int, ...] = (64,)  # batches at which the baseline runs (it is slow)
    init: str = "random_codes"  # NVFP4 random weights: "random_codes" or "quantize"
    seed: int = 0
    profile: bool = False  # print a kernel-time table of an eager decode step per model
    fuse_projections: bool = True  # engine runs q/k/v and gate/up as one matmul each (models/fused.py)
    decode_attention: str | None = None  # None: the engine's default ("kernel" on CUDA)
    fp4_small_m: str = "auto"  # NVFP4 GEMM for M <= 8: "auto" (mma.sync CUDA kernel where it runs), "mma", "triton"
    workload: str = "fixed"  # "fixed" (every row gen_len tokens) or "gsm8k-like" (uneven lengths, bench/workloads.py)
    lora_kernels: bool = True  # adapters through kernels/lora.py (False: one matmul per group + one addmm per member)
    lora_in_gemm: bool = False  # NVFP4 decode GEMMs on the mma.sync kernel add their group's adapters themselves
    lora_fold: str = "auto"  # gate/up's LoRA expand inside SiLU x up: "auto" (above 8 rows), "on", "off"
    lora_merge: tuple[str, ...] = ("off",)  # "on": bf16 adapters merged into engine-owned copies (engine/merged.py)
    scheduling: tuple[str, ...] = ("static",)  # "static": batches of `batch` prompts; "continuous": `batch` rows refilled
    prompts: int | None = None  # completions per rollout (None: one batch); more than the batch queue for its rows
    engines: tuple[str, ...] = ("kit",)  # "vllm": vLLM on the same checkpoint in its own process (bench/vllm_peer.py)
    vllm_pythonpath: str | None = None  # PYTHONPATH of the vLLM process (its packages); None: this process's
    vllm_workdir: str | None = None  # where the checkpoint for vLLM is written (None: the system's temp folder)
    vllm_gpu_memory_utilization: float = 0.85

    def __post_init__(self):
        from qerl_lib.bench.vllm_peer import ENGINES
        from qerl_lib.errors import UserError

        if not self.engines or set(self.engines) - set(ENGINES):
            raise UserError(f"engines {self.engines}: choose from {', '.join(ENGINES)}")
        for m in self.models:
            if m not in MODELS:
                raise UserError(f"unknown model {m!r} in --models: choose from {', '.join(MODELS)}")
        for w in self.weights:
            if w not in WEIGHTS:
                raise UserError(f"unknown weights {w!r} in --weights: choose from {', '.join(WEIGHTS)}")
        if min(self.batches) < 1 or self.prompt_len < 1 or self.gen_len < 2 or self.repeats < 1:
            raise UserError(f"--batch, --prompt-len and --repeats must be >= 1 and --gen-len >= 2, got batches "
                            f"{list(self.batches)}, prompt_len {self.prompt_len}, repeats {self.repeats}, "
                            f"gen_len {self.gen_len}")
        if min(self.lora_ranks) < 0:
            raise UserError(f"--lora-rank takes ranks >= 0 (0 = no adapter), got {list(self.lora_ranks)}")
        if self.fp4_small_m not in SMALL_M_BACKENDS:
            raise UserError(f"fp4_small_m must be one of {', '.join(SMALL_M_BACKENDS)}, got {self.fp4_small_m!r}")
        if self.init not in ("random_codes", "quantize"):
            raise UserError(f"init must be 'random_codes' or 'quantize', got {self.init!r}")
        if self.workload not in WORKLOADS:
            raise UserError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        bad = [x for x in self.scheduling if x not in SCHEDULING]
        if bad or not self.scheduling:
            raise UserError(f"--scheduling takes one or more of {', '.join(SCHEDULING)}, got {list(self.scheduling)}")
        if not self.lora_merge or set(self.lora_merge) - {"off", "on"}:
            raise UserError(f"--lora-merge takes one or more of off, on, got {list(self.lora_merge)}")
        if self.lora_fold not in LORA_FOLD:
            raise UserError(f"lora_fold must be one of {', '.join(LORA_FOLD)}, got {self.lora_fold!r}")
        if self.prompts is not None and self.prompts < 1:
            raise UserError(f"--prompts must be >= 1 (completions per rollout), got {self.prompts}")
        if "vllm" in self.engines and self.prompts is not None and len(self.batches) > 1:
            raise UserError("--prompts with --engines vllm takes one --batch (vLLM's running-sequence cap is "
                             "fixed when its engine starts): run one batch size per call")


LORA_FOLD = {"auto": None, "on": True, "off": False}  # RolloutBenchConfig.lora_fold -> RolloutEngine(lora_fold=)


@dataclass
class Row:
    model: str
    weights: str
    batch: int
    rank: int
    backend: str
    engine: str  # "qerl" or "hf-generate"
    prompt_len: int
    gen_len: int
    tok_s: float | None = None
    decode_tok_s: float | None = None
    ms_per_step: float | None = None
    ttft_ms: float | None = None  # the rollout's first call: its adapters' load + prefill (median over repeats)
    peak_gib: float | None = None
    weights_gib: float | None = None  # what building the model allocated on the GPU (None off CUDA)
    kv_cache_gib: float | None = None
    repeats_s: list = field(default_factory=list)
    error: str | None = None
    workload: str = "fixed"  # bench/workloads.py: with "gsm8k-like", gen_len is the longest a row may run
    useful_tokens: int | None = None  # the rows' completion tokens (tok_s counts these)
    slot_utilization: float | None = None  # useful tokens / (rows x decode steps + rows x prefills), as measured
    scheduling: str = "static"  # "static": batches of `batch` prompts in turn; "continuous": `batch` rows, refilled
    prompts: int | None = None  # completions per rollout (None: `batch`)
    schedule: dict | None = None  # continuous rows: refills, refill_prefills, compactions, refill_s (last repeat)
    lora_merged: bool = False  # the adapters ran merged into engine-owned bf16 copies (RolloutEngine(lora_merge=))


# ---- models -------------------------------------------------------------------------------------
def load_bench_model(name: str, weights: str, device: torch.device, init: str = "random_codes", seed: int = 0):
    """The model to time: embedded SmolLM2 (real weights) or a random model of a real shape."""
    from qerl_lib.models.loader import build_random_model, replace_linear_with_nvfp4

    if name == "smollm2":
        from transformers import AutoModelForCausalLM

        from qerl_lib.models.embedded import resolve_model

        model = AutoModelForCausalLM.from_pretrained(resolve_model("smollm2"), dtype=torch.bfloat16).to(device).eval()
        return replace_linear_with_nvfp4(model) if weights == "nvfp4" else _nf4(model, weights, device)
    if name == "smollm2-shape":
        import json
        import tempfile
        from pathlib import Path

        from transformers import LlamaConfig

        folder = Path(tempfile.mkdtemp(prefix="smollm2-shape-"))
        cfg = LlamaConfig(**SMOLLM2_SHAPE)
        (folder / "config.json").write_text(json.dumps(cfg.to_dict()))
        return _nf4(build_random_model(folder / "config.json", torch.bfloat16, device, nvfp4=weights == "nvfp4",
                                       init=init, seed=seed), weights, device)
    return _nf4(build_random_model(name, torch.bfloat16, device, nvfp4=weights == "nvfp4", init=init, seed=seed),
                weights, device)


def _nf4(model, weights: str, device: torch.device):
    """``model`` with its Linears (not lm_head) as bitsandbytes NF4 when ``weights`` is "nf4", as QLoRA loads it."""
    if weights != "nf4":
        return model
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        from qerl_lib.errors import UserError

        raise UserError("--weights nf4 needs bitsandbytes: pip install bitsandbytes (requirements.txt pins it)")
    from qerl_lib.models.nf4 import to_nf4

    return to_nf4(model, device, torch.bfloat16).eval()


def random_lora(model, rank: int, seed: int = 0) -> dict:
    """Rank-``rank`` adapters on all seven projections of every layer (random, non-zero), for the engine."""
    from qerl_lib.engine.forward import ModelView
    from qerl_lib.engine.rollout import LoraAdapter

    view = ModelView(model)
    gen = torch.Generator(device=view.device).manual_seed(seed)
    out = {}
    for i in range(view.n_layers):
        for proj in PROJECTIONS:
            m = view.projection(i, proj)
            a = torch.randn(rank, m.in_features, generator=gen, device=view.device) / m.in_features ** 0.5
            b = torch.randn(m.out_features, rank, generator=gen, device=view.device) * 0.01
            out[f"model.layers.{i}.{PARENT[proj]}.{proj}"] = LoraAdapter(a.to(view.dtype), b.to(view.dtype), 2.0)
    return out


# ---- timing -------------------------------------------------------------------------------------
def random_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    """``batch`` prompts of ``prompt_len`` random token ids in ``[10, vocab)``, reproducible from ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, prompt_len), generator=gen).tolist()


def time_engine(model, row: Row, backend: str, lora, repeats: int, seed: int, fuse_projections: bool = True,
                decode_attention: str | None = None, glue_kernels: bool = True,
                attention_launch: AttentionLaunch | None = None, lora_kernels: bool | None = None,
                lora_in_gemm: bool = False, lora_fold: bool | None = None) -> Row:
    """Fill ``row``'s timings: a fresh ``RolloutEngine`` (the keyword arguments are its own) warmed up,
    then ``repeats`` rollouts of ``row.prompts`` random prompts (default ``row.batch``), each row to its
    length of ``row.workload`` (all ``gen_len`` when "fixed"); medians. ``row.scheduling`` "static" runs
    them in batches of ``row.batch``, each until its longest row is done; "continuous" runs ``row.batch``
    rows and refills each from the queue as it finishes (``engine/continuous.py``). ``tok_s`` counts the
    rows' tokens, not the idle slots."""
    from qerl_lib.bench.workloads import sample_lengths
    from qerl_lib.engine.continuous import headroom
    from qerl_lib.engine.rollout import RolloutEngine

    n = row.prompts or row.batch
    continuous = row.scheduling == "continuous" and n > row.batch
    engine = RolloutEngine(model, decode_backend=backend, max_seq_len=row.prompt_len + row.gen_len,
                           fuse_projections=fuse_projections, decode_attention=decode_attention,
                           glue_kernels=glue_kernels, attention_launch=attention_launch, lora_kernels=lora_kernels,
                           lora_in_gemm=lora_in_gemm, lora_fold=lora_fold, lora_merge=row.lora_merged)
    row.backend = engine.decode_backend
    prompts = random_prompts(n, row.prompt_len, model.config.vocab_size, seed)
    lengths = sample_lengths(row.workload, n, row.gen_len, seed)
    useful = sum(lengths)
    # the continuous cache is longer by its headroom: capture every length bucket it will visit now
    engine.warmup(row.batch, row.prompt_len, row.gen_len + (headroom(engine) if continuous else 0), lora=lora)
    totals, decodes, firsts, slot_steps = [], [], [], 0
    for r in range(repeats):
        kw = dict(temperature=1.0, seed=seed + r, stop_token_ids=[], lora=lora, timing=True)
        total = decode = 0.0
        first, tokens, slot_steps = None, 0, 0
        calls = [(prompts, lengths)] if continuous else \
            [(prompts[i:i + row.batch], lengths[i:i + row.batch]) for i in range(0, n, row.batch)]
        for chunk, caps in calls:
            out = engine.generate(chunk, caps, max_batch=row.batch if continuous else None, **kw)
            t = engine.last_timing
            if not continuous and t.steps != max(caps) - 1:
                raise RuntimeError(f"expected {max(caps) - 1} decode steps, ran {t.steps}")
            tokens += sum(len(c.token_ids) for c in out)
            # the adapters' load counts (a merged copy is rewritten every call), in the prefill's share; the time
            # to first token is the first call's (a static rollout of more prompts than rows makes several calls)
            total, decode = total + t.load_s + t.prefill_s + t.decode_s, decode + t.decode_s
            first = t.load_s + t.prefill_s if first is None else first
            slot_steps += t.batch * (t.steps + 1) + (t.extra.get("refills", 0) if continuous else 0)
        if tokens != useful:
            raise RuntimeError(f"expected {useful} tokens, the rollout returned {tokens}")
        totals.append(total)
        decodes.append(decode)
        firsts.append(first)
    total, decode = statistics.median(totals), statistics.median(decodes)
    row.tok_s = useful / total
    steps = slot_steps / row.batch  # decode steps (+ prefills) of one row: the rollout's length in steps
    row.decode_tok_s = (useful - row.batch) / decode if steps > 1 else None
    row.ms_per_step = 1e3 * decode / (steps - len(calls)) if steps > len(calls) else None
    row.useful_tokens, row.slot_utilization = useful, round(useful / slot_steps, 4)
    row.ttft_ms = 1e3 * statistics.median(firsts)
    row.repeats_s = [round(x, 4) for x in totals]
    row.kv_cache_gib = engine.cache.nbytes / 2**30 if engine.cache is not None else None
    if continuous:
        row.schedule = {k: t.extra[k] for k in ("refills", "refill_prefills", "compactions", "refill_s")}
    engine.release()
    return row


def time_hf_generate(model, row: Row, repeats: int, seed: int) -> Row:
    """transformers' own generate: sampling at temperature 1, EOS suppressed with min_new_tokens.

    The warm-up is one full-length call: the first generate of each new sequence length pays
    one-time costs (kernel and heuristic selection per shape), and an 8-token warm-up left them in
    the first timed repeat, 2.7-2.9x slower than the second, which understated transformers' speed
    in the median of two."""
    prompts = torch.tensor(random_prompts(row.batch, row.prompt_len, model.config.vocab_size, seed), device=model.device)
    mask = torch.ones_like(prompts)
    kwargs = dict(attention_mask=mask, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                  max_new_tokens=row.gen_len, min_new_tokens=row.gen_len, pad_token_id=0)
    with torch.no_grad():
        model.generate(prompts, **kwargs)  # warm-up at full length (see the docstring)
        totals = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = model.generate(prompts, **kwargs)
            torch.cuda.synchronize()
            totals.append(time.perf_counter() - t0)
            assert out.shape[1] == row.prompt_len + row.gen_len
    row.backend, row.engine = "-", "hf-generate"
    row.tok_s = row.batch * row.gen_len / statistics.median(totals)
    row.repeats_s = [round(x, 4) for x in totals]
    return row


def profile_decode(model, batch: int, prompt_len: int, backend: str = "auto", steps: int = 32, rows: int = 40) -> str:
    """Where a decode step's GPU time goes: torch.profiler's kernel table for ``steps`` steps of the
    given backend (CUPTI also records the kernels a replayed CUDA graph runs), prefill included."""
    from torch.profiler import ProfilerActivity, profile

    from qerl_lib.engine.rollout import RolloutEngine

    engine = RolloutEngine(model, decode_backend=backend, max_seq_len=prompt_len + steps + 8)
    prompts = random_prompts(batch, prompt_len, model.config.vocab_size, 0)
    engine.warmup(batch, prompt_len, steps + 1)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(prompts, steps + 1, stop_token_ids=[])
        torch.cuda.synchronize()
    launches = sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")
    engine.release()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)
    return f"{launches} kernels over prefill + {steps} steps ({engine.decode_backend})\n{table}"


# ---- the sweep ----------------------------------------------------------------------------------
BENCH_DEVICE = "cuda"  # where the sweep runs (the engine's speed path is CUDA graphs); the CPU tests set "cpu"


def plan_unit(cfg: RolloutBenchConfig, name: str, weights: str) -> list[tuple[str, Row]]:
    """The rows the sweep measures on one model and weights (one build of the model), in the order it writes them,
    each with how it is measured: "kit" (the engine at ``cfg``'s settings, a fresh engine per row), "hf"
    (transformers' generate), "kit-hf" (the engine at the baseline's lengths, for a like-for-like ratio) or "vllm"
    (vLLM's rows, all from one process: `bench/vllm_peer.py`). Each row still names the backend asked for: a
    measured one names the backend the engine ran ("auto" resolved)."""
    from qerl_lib.bench.vllm_peer import peer_row

    out = []
    for batch in cfg.batches if "kit" in cfg.engines else ():
        for rank in cfg.lora_ranks:
            # merging is a bf16 base's option with an adapter (NVFP4 and NF4 bases stay unmerged)
            merges = [m == "on" for m in cfg.lora_merge if m == "off" or (rank and weights == "bf16")]
            for backend, scheduling, merge in itertools.product(cfg.backends, cfg.scheduling, merges):
                out.append(("kit", Row(name, weights, batch, rank, backend, "qerl", cfg.prompt_len, cfg.gen_len,
                                       workload=cfg.workload, scheduling=scheduling, prompts=cfg.prompts,
                                       lora_merged=merge)))
        if name == "smollm2" and weights == "bf16" and cfg.hf_baseline and batch in cfg.hf_batches:
            gen = cfg.hf_gen_len or cfg.gen_len
            out.append(("hf", Row(name, weights, batch, 0, "-", "hf-generate", cfg.prompt_len, gen)))
            if gen != cfg.gen_len:  # the engine at the baseline's length too, for a like-for-like ratio
                out.append(("kit-hf", Row(name, weights, batch, 0, cfg.backends[0], "qerl", cfg.prompt_len, gen)))
    if "vllm" in cfg.engines:
        out += [("vllm", peer_row(cfg, name, weights, b, r)) for b in cfg.batches for r in cfg.lora_ranks]
    return out


def plan_sweep(cfg: RolloutBenchConfig) -> list[tuple[str, str, list[tuple[str, Row]]]]:
    """(model, weights, `plan_unit`) for every model x weights of ``cfg``, in the sweep's order."""
    return [(name, weights, plan_unit(cfg, name, weights)) for name in cfg.models for weights in cfg.weights]


def run_rollout_bench(cfg: RolloutBenchConfig, log=print, checkpoint=None, kept=()) -> dict:
    """Measure every row of `plan_sweep` and return the results document (provenance, code hashes, config, rows in
    the sweep's order, summary). ``kept``: row dicts of an earlier run of these settings
    (`rollout_resume.resume_rows`): a planned row with one there is not measured again, that row takes its place,
    and a model and weights whose rows are all kept is not even built. ``checkpoint(document)``, when given, gets the
    document so far (kept rows included) after every row measured, so a run cut short keeps its numbers."""
    from qerl_lib.bench.rollout_resume import case_key, planned_key
    from qerl_lib.errors import UserError
    from qerl_lib.io import provenance
    from qerl_lib.kernels import mma
    from qerl_lib.models.nvfp4_linear import set_small_m_kernel

    device = torch.device(BENCH_DEVICE)
    plan = plan_sweep(cfg)
    earlier: dict[tuple, list[Row]] = {}
    for values in kept:
        earlier.setdefault(case_key(values), []).append(Row(**values))
    done: dict[tuple[int, int], Row] = {}  # (unit, row of plan_unit) -> its row, kept or measured
    for u, (_, _, entries) in enumerate(plan):
        for i, (_, row) in enumerate(entries):
            same = earlier.get(planned_key(row, device.type))
            if same:
                done[u, i] = same.pop(0)
    todo = sum(len(entries) for *_, entries in plan) - len(done)
    if todo and device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("qerl bench rollout needs a CUDA GPU (the engine's speed path is CUDA graphs)")
    prov = provenance()
    prov["fp4_small_m_kernel"] = ("triton" if cfg.fp4_small_m == "triton" or not mma.available()
                                  else "mma (qerl_lib/kernels/mma.cu)")

    def document() -> dict:
        return _document(cfg, [done[k] for k in sorted(done)], prov)

    def finished(u: int, i: int, row: Row) -> None:  # every finished row is also written out
        done[u, i] = row
        if checkpoint is not None:
            checkpoint(document())

    for u, (name, weights, entries) in enumerate(plan):
        left = [i for i in range(len(entries)) if (u, i) not in done]
        if not left:
            continue
        _free()
        held = _allocated_gib(device)  # what earlier builds of this process left allocated: not this model's
        try:
            model = load_bench_model(name, weights, device, cfg.init, cfg.seed)
        except torch.cuda.OutOfMemoryError as e:
            finished(u, -1, Row(name, weights, 0, 0, "-", "qerl", cfg.prompt_len, cfg.gen_len,
                                error=f"OOM building: {e}"[:200]))
            log(f"{name} {weights}: OOM while building")
            continue
        peer_left = [i for i in left if entries[i][0] == "vllm"]
        if peer_left:  # before the kit's engine fuses projections in place
            from qerl_lib.bench.vllm_peer import prepare_peer

            peer = prepare_peer(model, name, weights, cfg, log)
        set_small_m_kernel(model, cfg.fp4_small_m)
        weights_gib = None if held is None else _allocated_gib(device) - held
        if cfg.profile:
            try:
                log(f"== profile {name} {weights} batch {cfg.batches[0]}\n"
                    + profile_decode(model, cfg.batches[0], cfg.prompt_len, cfg.backends[0]))
            except Exception as e:  # a profiling failure must not stop the measurements
                log(f"profile failed: {type(e).__name__}: {e}")
        lora, lora_rank = None, 0
        for i in left:
            kind, row = entries[i]
            if kind == "vllm":
                continue
            if kind == "kit" and row.rank != lora_rank:  # the same seed's adapters serve every batch of a rank
                lora = None
                lora, lora_rank = (random_lora(model, row.rank, cfg.seed) if row.rank else None), row.rank
            row.weights_gib = weights_gib
            finished(u, i, _measure(_timing(kind, model, lora if kind == "kit" else None, cfg), row, log, device))
        del model, lora
        if peer_left:  # the kit's model is gone: vLLM gets the GPU
            from qerl_lib.bench.vllm_peer import run_peer

            _free()
            measured = {(r.batch, r.rank): r for r in run_peer(peer, cfg, log)}
            for i in peer_left:
                _, row = entries[i]
                done[u, i] = measured.get((row.batch, row.rank)) or replace(row, error="vLLM returned no row")
            if checkpoint is not None:
                checkpoint(document())
    _free()
    return document()


def _timing(kind: str, model, lora, cfg: RolloutBenchConfig):
    """The function `_measure` calls to fill a planned row of ``kind`` (`plan_unit`)."""
    if kind == "hf":
        return lambda row: time_hf_generate(model, row, cfg.repeats, cfg.seed)
    if kind == "kit-hf":  # no adapter, the engine's default options: the baseline's like for like
        return lambda row: time_engine(model, row, row.backend, None, cfg.repeats, cfg.seed)
    return lambda row: time_engine(model, row, row.backend, lora, cfg.repeats, cfg.seed, cfg.fuse_projections,
                                   cfg.decode_attention, lora_kernels=cfg.lora_kernels, lora_in_gemm=cfg.lora_in_gemm,
                                   lora_fold=LORA_FOLD[cfg.lora_fold])


def _allocated_gib(device: torch.device) -> float | None:
    """The memory PyTorch's allocator holds on the device now, or None off CUDA."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated() / 2**30


def _document(cfg: RolloutBenchConfig, rows: list[Row], prov: dict) -> dict:
    return {"provenance": prov, "code": code_hashes(), "config": asdict(cfg), "rows": [asdict(r) for r in rows],
            "summary": summarize(rows)}


# The modules whose code sets the rollout numbers, relative to qerl_lib/.
CODE_FILES = ("engine/rollout.py", "engine/continuous.py", "engine/forward.py", "engine/reference_ops.py", "engine/cache.py",
              "engine/remap.py", "engine/adapters.py", "engine/attention.py", "engine/merged.py", "engine/glue.py", "engine/sampling.py",
              "kernels/pdl.py", "kernels/fp4_gemm.py", "kernels/launch_rule.py", "kernels/splitk.py", "kernels/fp4_wgmma.py",
              "kernels/fp4_wgmma_producer.py", "kernels/fp4_wgmma_ws.py", "kernels/fp4_decode.py", "kernels/mma.py",
              "kernels/mma.cu", "kernels/mma_lora.cuh", "kernels/fp4_device.cuh", "kernels/fp4_ra.py", "kernels/fp4_ra.cu",
              "kernels/fp4_ra_backward.cuh",
              "kernels/lora.py", "models/nvfp4_linear.py", "models/fused.py",
              "models/loader.py", "bench/rollout.py")


def code_hashes() -> dict[str, str]:
    """sha256 (first 12 hex digits) of each of ``CODE_FILES``, keyed by its path under qerl_lib/: a
    benchmark may run on a tree that is not committed yet, so this pins which version of the kernels
    and the engine ran."""
    from pathlib import Path

    from qerl_lib.io import tree_sha256

    root = Path(__file__).resolve().parents[1]
    return {n: tree_sha256(root / n) for n in CODE_FILES if (root / n).is_file()}


def _measure(fn, row: Row, log, device: torch.device | None = None) -> Row:
    from qerl_lib.engine import remap

    _free()
    cuda = device is None or device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        remap.reset_peak_mapped()
    try:
        row = fn(row)
        # the engine's remappable cache (engine/remap.py) is outside PyTorch's allocator, and mapped throughout
        if cuda:
            row.peak_gib = (torch.cuda.max_memory_allocated() + remap.peak_mapped_bytes()) / 2**30
    except torch.cuda.OutOfMemoryError as e:
        row.error = f"OOM: {str(e)[:160]}"
    except Exception as e:  # keep the sweep going; the row records what failed
        row.error = f"{type(e).__name__}: {str(e)[:300]}"
    log(format_row(row))
    return row


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


if __name__ == "__main__":  # python -m qerl_lib.bench.rollout: the same arguments as `qerl bench rollout`
    from qerl_lib.bench.rollout_cli import main

    sys.exit(main())
