"""Static against continuous batching on one model: the same prompts, the same completions, two schedules.

An RL rollout's completions end at different lengths (``bench/workloads.py``'s ``gsm8k-like`` lengths). A static
batch of ``slots`` rows decodes until its longest member is done, then the next batch starts; continuous batching
(``engine/continuous.py``) gives each finished row's slot to the next queued prompt. ``scheduling_study`` runs both
on the same engine with per-prompt seeds (``row_seeds``), so each prompt's completion is the same token for token
in both schedules (the study checks that), and records where every sequence ran: its row and the decode steps it
held it. A sequence's token 0 comes from its prefill (a call of its own, between decode steps), its tokens 1..n-1
from the next n-1 decode steps; so a sequence of n tokens admitted before decode step ``s`` holds its row for steps
``[s, s + n - 1)``, and both schedules are drawn on one axis of decode steps (``plots/scheduling.py``).

``slot_utilization`` here is decoded tokens / (``slots`` x decode steps): the share of the rectangle of reserved
rows that produced a kept token. ``qerl bench rollout`` counts prefills as steps too, and a static rollout's last,
smaller batch at its own row count; this study keeps ``slots`` rows reserved throughout, as a trainer's memory plan
does.

On a CPU, a decode step's cost grows with its rows far more than on a GPU, where the step is bound by reading the
weights once whatever the rows; so the wall-clock gain measured here understates a GPU's, and the decode-step
counts are the figure to read. (On a GPU the timed calls also capture the CUDA graphs of length buckets the short
warm-up call did not reach; `qerl bench rollout` warms every bucket before it times.) GPU measurements of the same
comparison are `qerl bench rollout --scheduling static,continuous --workload gsm8k-like` (README, results/).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from qerl_lib.bench.workloads import WORKLOADS, sample_lengths
from qerl_lib.engine.rollout import RolloutEngine
from qerl_lib.studies.result_reading import device_name


@dataclass
class SchedulingConfig:
    slots: int = 6  # rows decoding at once (the static batch size; continuous batching's row count)
    max_new_tokens: int = 128  # the longest completion: the workload's lengths are scaled to it
    workload: str = "gsm8k-like"  # bench/workloads.WORKLOADS
    temperature: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"slots must be a positive integer (rows decoding at once), got {self.slots!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or \
                self.max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be an integer >= 2, got {self.max_new_tokens!r}")
        if self.workload not in WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}, got {self.workload!r}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (the study samples), got {self.temperature!r}")


def static_timeline(lengths: list[int], slots: int) -> list[list[int]]:
    """``[sequence, row, first decode step, end decode step]`` of each prompt under static batching: batches of
    ``slots`` prompts in order, each prefilled when the previous batch's longest sequence is done."""
    timeline, offset = [], 0
    for start in range(0, len(lengths), slots):
        batch = lengths[start:start + slots]
        timeline += [[start + r, r, offset, offset + n - 1] for r, n in enumerate(batch)]
        offset += max(batch) - 1
    return timeline


def continuous_timeline(admissions: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """The same rows from continuous batching's ``Timing.extra["admissions"]`` (``[sequence, row, decode step
    before which it was prefilled]``) and each completion's length."""
    return sorted([seq, row, first, first + lengths[seq] - 1] for seq, row, first in admissions)


def _summary(timeline: list[list[int]], slots: int, seconds: float, tokens: int) -> dict:
    steps = max(end for *_, end in timeline)
    decoded = sum(end - first for *_, first, end in timeline)
    return {"seconds": seconds, "tok_s": tokens / seconds, "decode_steps": steps,
            "slot_utilization": decoded / (slots * steps) if steps else None, "timeline": timeline}


def scheduling_study(model, prompts: list[list[int]], config: SchedulingConfig | None = None,
                     engine: RolloutEngine | None = None) -> dict:
    """Generate ``prompts`` (token id lists) twice, static then continuous, each prompt to its own length drawn
    from ``config.workload``; returns the config, the lengths, each schedule's seconds, tokens/s, decode steps,
    slot utilization and timeline, continuous batching's refills, and whether the completions were the same."""
    config = config or SchedulingConfig()
    if not prompts:
        raise ValueError("prompts is empty: give the study at least one prompt (token id lists)")
    n, slots = len(prompts), min(config.slots, len(prompts))
    caps = sample_lengths(config.workload, n, config.max_new_tokens, config.seed)
    seeds = [config.seed * 1_000_003 + i for i in range(n)]
    engine = engine or RolloutEngine(model)
    kw = dict(temperature=config.temperature, stop_token_ids=[], timing=True)
    engine.generate(prompts[:slots], 2, row_seeds=seeds[:slots], **kw)  # warm-up: first-call costs out of the timing

    started, static = time.perf_counter(), []
    for i in range(0, n, slots):
        static += engine.generate(prompts[i:i + slots], caps[i:i + slots], row_seeds=seeds[i:i + slots], **kw)
    static_s = time.perf_counter() - started

    started = time.perf_counter()
    continuous = engine.generate(prompts, caps, row_seeds=seeds, max_batch=slots, **kw)
    continuous_s = time.perf_counter() - started
    extra = engine.last_timing.extra
    lengths = [len(c.token_ids) for c in continuous]
    if lengths != caps or [len(c.token_ids) for c in static] != caps:
        raise RuntimeError("a completion stopped before its token budget (the study passes no stop tokens)")
    out = {"config": {**asdict(config), "slots": slots, "prompts": n}, "lengths": caps,
           "useful_tokens": sum(caps),
           "same_completions": all(a.token_ids == b.token_ids for a, b in zip(static, continuous)),
           "static": _summary(static_timeline(caps, slots), slots, static_s, sum(caps))}
    if slots < n:
        out["continuous"] = _summary(continuous_timeline(extra["admissions"], lengths), slots, continuous_s, sum(caps))
    else:  # one batch: continuous batching runs the static call (no queue to refill from)
        out["continuous"] = _summary(out["static"]["timeline"], slots, continuous_s, sum(caps))
    out["continuous"].update({k: extra.get(k, 0) for k in ("refills", "refill_prefills")})
    steps = out["static"]["decode_steps"]
    out["steps_saved"] = 1 - out["continuous"]["decode_steps"] / steps if steps else 0.0
    out["speedup"] = static_s / continuous_s
    return out


PAIR_KEYS = ("model", "weights", "rank", "batch", "prompt_len", "gen_len", "workload", "prompts")


def gpu_scheduling_rows(results_dir: str | Path) -> list[dict]:
    """The committed GPU measurements of the same comparison: every ``qerl bench rollout`` file under
    ``results_dir`` with a static and a continuous row of the kit's engine for one configuration (``PAIR_KEYS``),
    as ``{file, device, <PAIR_KEYS>, static_tok_s, continuous_tok_s, continuous_over_static, static/continuous
    slot utilization, vllm_tok_s}`` (vLLM's row of that configuration, or None)."""
    out = []
    for path in sorted(Path(results_dir).glob("*.json")):
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            continue
        rows = doc.get("rows") if isinstance(doc, dict) else None
        if not isinstance(rows, list):
            continue
        measured = [r for r in rows if isinstance(r, dict) and r.get("scheduling") and r.get("error") is None
                    and r.get("tok_s")]
        for cont in (r for r in measured if r["scheduling"] == "continuous" and r.get("engine") == "qerl"):
            key = {k: cont.get(k) for k in PAIR_KEYS}
            same = [r for r in measured if all(r.get(k) == v for k, v in key.items())]
            static = [r for r in same if r["scheduling"] == "static" and r.get("engine") == "qerl"]
            vllm = [r for r in same if r.get("engine") == "vllm"]
            if static:
                out.append({"file": path.name, "device": device_name(doc, path.name), **key,
                            "static_tok_s": static[0]["tok_s"], "continuous_tok_s": cont["tok_s"],
                            "continuous_over_static": cont["tok_s"] / static[0]["tok_s"],
                            "static_slot_utilization": static[0].get("slot_utilization"),
                            "continuous_slot_utilization": cont.get("slot_utilization"),
                            "vllm_tok_s": vllm[0]["tok_s"] if vllm else None})
    return out


def format_study(study: dict) -> str:
    """A fixed-width table of ``scheduling_study``'s two schedules."""
    lines = [f"{'schedule':<11s} {'decode steps':>12s} {'slots busy':>10s} {'seconds':>8s} {'tok/s':>7s} "
             f"{'refills':>8s}"]
    for name in ("static", "continuous"):
        part = study[name]
        refills = f"{part['refills']:>8d}" if "refills" in part else f"{'-':>8s}"
        busy = part["slot_utilization"]
        busy = f"{100 * busy:>9.0f}%" if busy is not None else f"{'-':>10s}"
        lines.append(f"{name:<11s} {part['decode_steps']:>12d} {busy} {part['seconds']:>8.1f} {part['tok_s']:>7.1f} "
                     f"{refills}")
    lines.append(f"{study['config']['prompts']} prompts on {study['config']['slots']} rows, "
                 f"{study['useful_tokens']} tokens; decode steps saved {100 * study['steps_saved']:.0f}%, "
                 f"wall-clock speedup {study['speedup']:.2f}x; same completions: {study['same_completions']}")
    return "\n".join(lines)


def format_gpu_rows(rows: list[dict]) -> str:
    """A fixed-width table of ``gpu_scheduling_rows`` (throughputs in generated tokens per second)."""
    if not rows:
        return "no committed GPU measurement pairs a static and a continuous row (qerl bench rollout --scheduling)"
    lines = ["tokens/s of the static batch, of continuous batching and of vLLM on the same workload; ratio: "
             "continuous / static",
             f"{'device':<16s} {'model':<11s} {'weights':<7s} {'rank':>4s} {'rows':>4s} {'prompts':>7s} "
             f"{'static':>7s} {'cont.':>7s} {'ratio':>6s} {'vLLM':>7s}  file"]
    for r in rows:
        vllm = f"{r['vllm_tok_s']:>7.0f}" if r["vllm_tok_s"] else f"{'-':>7s}"
        lines.append(f"{r['device'][:16]:<16s} {r['model']:<11s} {r['weights']:<7s} {r['rank']:>4d} {r['batch']:>4d} "
                     f"{r['prompts']:>7d} {r['static_tok_s']:>7.0f} {r['continuous_tok_s']:>7.0f} "
                     f"{r['continuous_over_static']:>5.2f}x {vllm}  {r['file']}")
    return "\n".join(lines)
