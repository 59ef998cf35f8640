"""Launch shapes of kernels/lora.py in the engine: decode ms per step of random Qwen2.5-7B NVFP4 + LoRA r16,
batch 8, 256 + 512 tokens, for K columns per shrink program x K-slice cap x expand tile width x warps
(environment: RANK, GRID, TAG); plus the same
without adapters and with the torch path, and a kernel-time table (torch.profiler over graph replays) of the
default shape. Writes lora_kernel_sweep.json to $OUT. Run: python dev/sweeps/lora_kernel_sweep.py

With BATCHES (e.g. "8,32,64"; section 27 of dev/LOG.md) it instead times, per batch size and per rank of RANKS
(default "16,64"), who adds the shrink's K-slice partials (the expand kernel or the shrink's last slice) x K
columns per shrink program, against no adapter at the same batch (GEN new tokens, default 512).

With ABLATE=1 (and BATCHES) it times, per batch and rank, the step with both LoRA kernels, with the expand kernel
not launched, with the shrink not launched, and with neither (wrong outputs; timing only): how much of the adapter's
cost a design that removes one of the two launches per group could save at most (dev/LOG.md section 28).

With BEFORE_KERNELS=<path to an older kernels/lora.py> (and BATCHES) it times, per batch and rank, the step with
that file's ``apply_`` (its kernels and launch constants, patched in) against today's, in one process, plus today's
with the module constants of COMPARE_VARIANTS (JSON: name -> {constant: value}) (section 28).
"""

import itertools
import json
import os
import sys

import torch

sys.path.insert(0, os.getcwd())
from qerl_lib.bench.rollout import load_bench_model, random_lora, random_prompts  # noqa: E402
from qerl_lib.engine import forward as forward_mod  # noqa: E402
from qerl_lib.engine.rollout import RolloutEngine  # noqa: E402
from qerl_lib.io import provenance  # noqa: E402
from qerl_lib.kernels import lora as lk  # noqa: E402

BATCH, PROMPT, GEN, RANK = 8, 256, int(os.environ.get("GEN", "512")), int(os.environ.get("RANK", "16"))
OUT = os.environ.get("OUT", ".")


def ms_per_step(model, lora, use_kernels=True, profile=False, batch=None, **engine_kwargs):
    batch = batch or BATCH
    engine = RolloutEngine(model, max_seq_len=PROMPT + GEN, lora_kernels=use_kernels, **engine_kwargs)
    prompts = random_prompts(batch, PROMPT, model.config.vocab_size, 0)
    engine.warmup(batch, PROMPT, GEN, lora=lora)
    best = None
    for r in range(2):
        engine.generate(prompts, GEN, temperature=1.0, seed=r, stop_token_ids=[], lora=lora, timing=True)
        t = engine.last_timing
        ms = 1e3 * t.decode_s / t.steps
        best = ms if best is None else min(best, ms)
    table = None
    if profile:
        from torch.profiler import ProfilerActivity, profile as prof_ctx

        with prof_ctx(activities=[ProfilerActivity.CUDA]) as prof:
            engine.generate(prompts, 33, temperature=1.0, seed=0, stop_token_ids=[], lora=lora)
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=50)
    engine.release()
    return best, table


def no_adapter_row(model, batch: int, rows: list) -> float:
    """ms per decode step without an adapter at ``batch``: appended to ``rows``, printed, returned."""
    base, _ = ms_per_step(model, None, batch=batch)
    rows.append({"variant": "no adapter", "batch": batch, "ms": base})
    print(f"batch {batch}: no adapter {base:.3f} ms", flush=True)
    return base


# (EXPAND_SUMS_UP_TO_RANK, FEW_ROWS): the expand kernel sums at every rank / the shrink at every rank and batch
SUM_MODES = {"expand sums": (1 << 20, lk.FEW_ROWS), "shrink sums": (0, lk.MAX_M)}


def by_batch(model, batches: list[int], ranks: list[int]) -> None:
    rows = []
    default = (lk.K_PER_SPLIT, lk.K_PER_SPLIT_MANY_ROWS, lk.EXPAND_SUMS_UP_TO_RANK, lk.FEW_ROWS)
    # VARIANTS: e.g. "256e,512s" (K columns per shrink program, e = the expand sums, s = the shrink sums)
    names = {"e": "expand sums", "s": "shrink sums"}
    variants = [(int(v[:-1]), names[v[-1]]) for v in os.environ.get("VARIANTS", "256e,256s,512e,512s,1024e,1024s").split(",")]
    for batch in batches:
        base = no_adapter_row(model, batch, rows)
        for rank in ranks:
            lora = random_lora(model, rank, 0)
            for kps, mode in variants:
                lk.K_PER_SPLIT = lk.K_PER_SPLIT_MANY_ROWS = kps
                lk.EXPAND_SUMS_UP_TO_RANK, lk.FEW_ROWS = SUM_MODES[mode]
                ms, _ = ms_per_step(model, lora, batch=batch)
                rows.append({"variant": "kernels", "batch": batch, "rank": rank, "k_per_split": kps, "sums": mode,
                             "ms": ms, "overhead_pct": 100 * (ms / base - 1)})
                print(f"batch {batch:3d} rank {rank:3d} k/split {kps:5d} {mode}: {ms:.3f} ms (+{100 * (ms / base - 1):.1f}%)",
                      flush=True)
                lk.K_PER_SPLIT, lk.K_PER_SPLIT_MANY_ROWS, lk.EXPAND_SUMS_UP_TO_RANK, lk.FEW_ROWS = default
                _write(rows, {"batches": batches, "ranks": ranks}, "lora_kernel_sweep_by_batch.json")
            del lora


class _NoLaunch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _ZeroedTorch:
    """``lk.torch`` while the shrink is left out: ``torch.empty`` hands out one zeroed buffer per shape, so the
    never-written ``xa`` and partials read as zeros, not as NaN garbage that would make the sampler emit
    out-of-range token ids; the buffers are made once (warm-up), so graph replays launch nothing extra."""

    def __init__(self):
        self._buffers = {}

    def empty(self, *shape, dtype=None, device=None):
        key = (shape, dtype, str(device))
        if key not in self._buffers:
            self._buffers[key] = torch.zeros(*shape, dtype=dtype, device=device)
        return self._buffers[key]

    def __getattr__(self, name):
        return getattr(torch, name)


def ablate(model, batches: list[int], ranks: list[int]) -> None:
    rows = []
    kernels = {"shrink": lk._shrink_kernel, "expand": lk._expand_kernel}
    variants = {"both kernels": (), "no expand": ("expand",), "no shrink": ("shrink",), "neither": ("shrink", "expand")}
    for batch in batches:
        base = no_adapter_row(model, batch, rows)
        for rank in ranks:
            lora = random_lora(model, rank, 0)
            for name, skipped in variants.items():
                for kernel in skipped:
                    setattr(lk, f"_{kernel}_kernel", _NoLaunch())
                if "shrink" in skipped:
                    lk.torch = _ZeroedTorch()
                try:
                    ms, _ = ms_per_step(model, lora, batch=batch)
                finally:
                    for kernel, fn in kernels.items():
                        setattr(lk, f"_{kernel}_kernel", fn)
                    lk.torch = torch
                rows.append({"variant": name, "batch": batch, "rank": rank, "ms": ms, "overhead_pct": 100 * (ms / base - 1)})
                print(f"batch {batch:3d} rank {rank:3d} {name:13s}: {ms:.3f} ms (+{100 * (ms / base - 1):.1f}%)", flush=True)
                _write(rows, {"batches": batches, "ranks": ranks}, "lora_ablation.json")
            del lora


def compare(model, batches: list[int], ranks: list[int], path: str) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("lora_before", path)
    before = importlib.util.module_from_spec(spec)
    sys.modules["lora_before"] = before  # dataclasses look their module up while the file runs
    spec.loader.exec_module(before)
    today_apply = lk.apply_
    # COMPARE_VARIANTS: '{"name": {"CONSTANT": value}}', today's file with module constants changed; the key
    # "engine" holds RolloutEngine keyword arguments instead (e.g. {"fold": {"engine": {"lora_fold": true}}}), and
    # "forward" constants of qerl_lib.engine.forward (section 29's {"norms too": {"forward": {"FOLD_GROUPS": ["gate_up",
    # "o"]}}} needs commit e62f1b9, where that switch existed)
    extra = json.loads(os.environ.get("COMPARE_VARIANTS") or "{}")
    rows = []
    for batch in batches:
        base = no_adapter_row(model, batch, rows)
        for rank in ranks:
            lora = random_lora(model, rank, 0)
            for name in ("before", "today", *extra):
                consts = dict(extra.get(name, {}))
                engine_kwargs = consts.pop("engine", {})
                forward_consts = {c: tuple(v) if isinstance(v, list) else v for c, v in consts.pop("forward", {}).items()}
                saved_forward = {c: getattr(forward_mod, c) for c in forward_consts}
                for c, value in forward_consts.items():
                    setattr(forward_mod, c, value)
                saved = {c: getattr(lk, c) for c in consts}
                if name == "before":  # the old file's apply_ (its kernels and launch constants)
                    lk.apply_ = before.apply_
                for c, value in consts.items():
                    setattr(lk, c, value)
                try:
                    ms, _ = ms_per_step(model, lora, batch=batch, **engine_kwargs)
                finally:
                    lk.apply_ = today_apply
                    for c, value in saved.items():
                        setattr(lk, c, value)
                    for c, value in saved_forward.items():
                        setattr(forward_mod, c, value)
                rows.append({"variant": name, "batch": batch, "rank": rank, "ms": ms, "overhead_pct": 100 * (ms / base - 1)})
                print(f"batch {batch:3d} rank {rank:3d} {name:12s}: {ms:.3f} ms (+{100 * (ms / base - 1):.1f}%)", flush=True)
                _write(rows, {"batches": batches, "ranks": ranks, "before": path}, "lora_compare.json")
            del lora


def _write(rows, settings: dict, name: str) -> None:
    doc = {"benchmark": "lora_kernel_sweep", "provenance": provenance(),
           "settings": {"model": "qwen2.5-7b", "weights": "nvfp4", "prompt_len": PROMPT, "gen_len": GEN, **settings},
           "rows": rows}
    with open(os.path.join(OUT, name + ".tmp"), "w") as f:
        json.dump(doc, f, indent=1)
    os.replace(os.path.join(OUT, name + ".tmp"), os.path.join(OUT, name))


def main():
    model = load_bench_model("qwen2.5-7b", "nvfp4", torch.device("cuda"))
    if os.environ.get("BATCHES"):
        if os.environ.get("BEFORE_KERNELS"):
            compare(model, [int(b) for b in os.environ["BATCHES"].split(",")],
                    [int(r) for r in os.environ.get("RANKS", "16,64").split(",")], os.environ["BEFORE_KERNELS"])
            return
        if os.environ.get("ABLATE") == "1":
            ablate(model, [int(b) for b in os.environ["BATCHES"].split(",")],
                   [int(r) for r in os.environ.get("RANKS", "16,64").split(",")])
            return
        by_batch(model, [int(b) for b in os.environ["BATCHES"].split(",")],
                 [int(r) for r in os.environ.get("RANKS", "16,64").split(",")])
        return
    lora = random_lora(model, RANK, 0)
    rows = []
    base, _ = ms_per_step(model, None)
    torch_path, _ = ms_per_step(model, lora, use_kernels=False)
    rows.append({"variant": "no adapter", "ms": base})
    rows.append({"variant": "torch path", "ms": torch_path})
    print(f"no adapter {base:.3f} ms, torch path {torch_path:.3f} ms", flush=True)
    default = (lk.K_PER_SPLIT, lk.MAX_SPLITS, lk.BLOCK_N, lk.SHRINK_WARPS, lk.EXPAND_WARPS)
    # GRID (JSON lists of choices, in this order) overrides the first run's grid
    choices = json.loads(os.environ.get("GRID", "[[256, 512, 1024], [32], [64, 128, 256], [2, 4], [4]]"))
    grid = [default] + [c for c in itertools.product(*choices) if c != default]
    for kps, splits, bn, sw, ew in grid:
        lk.K_PER_SPLIT, lk.MAX_SPLITS, lk.BLOCK_N, lk.SHRINK_WARPS, lk.EXPAND_WARPS = kps, splits, bn, sw, ew
        ms, table = ms_per_step(model, lora, profile=(kps, splits, bn, sw, ew) == default and not os.environ.get("GRID"))
        rows.append({"variant": "kernels", "k_per_split": kps, "max_splits": splits, "block_n": bn,
                     "shrink_warps": sw, "expand_warps": ew, "ms": ms, "overhead_pct": 100 * (ms / base - 1)})
        print(f"k/split {kps:5d} max splits {splits:3d} block_n {bn:4d} warps {sw}/{ew}: {ms:.3f} ms "
              f"(+{100 * (ms / base - 1):.1f}%)", flush=True)
        if table:
            print(table, flush=True)
            rows[-1]["profile"] = table
    _write(rows, {"batch": BATCH, "rank": RANK}, f"lora_kernel_sweep_r{RANK}{os.environ.get('TAG', '')}.json")


if __name__ == "__main__":
    main()
