"""`qerl bench gemm` (NVFP4 x BF16 GEMM vs BF16 in the forward and backward layouts, qerl_lib.bench.gemm),
`qerl bench train` (one GRPO step per mode through the real trainer, qerl_lib.studies.train_bench) and
`qerl bench rollout` (rollout throughput, qerl_lib.bench.rollout; its arguments and handler live in
qerl_lib.bench.rollout_cli).
"""

from __future__ import annotations

import argparse
import json
import sys


def _int_list(text: str, least: int = 1) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(v < least for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {least}, got {text!r}")
    return values


def _count_list(text: str) -> list[int]:
    """Comma-separated counts, 0 included (e.g. decoder layers)."""
    return _int_list(text, least=0)


def _str_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def register(sub) -> None:
    bench = sub.add_parser("bench", help="GPU benchmarks (fixed-width table + JSON with provenance)")
    bsub = bench.add_subparsers(dest="bench_command", metavar="WHAT")
    bsub.required = True

    from qerl_lib.bench import gemm, rollout_cli
    from qerl_lib.bench.workloads import WORKLOADS

    p = bsub.add_parser("gemm", help="fused NVFP4 x BF16 GEMM vs torch BF16 on every projection shape of the models")
    p.add_argument("--models", type=_str_list, default=list(gemm.DEFAULT_MODELS),
                   help=f"comma-separated configs from data/configs/ (default: {','.join(gemm.DEFAULT_MODELS)})")
    p.add_argument("--m", dest="ms", type=_int_list, default=list(gemm.DEFAULT_MS),
                   help="comma-separated batch sizes M (tokens per GEMM)")
    p.add_argument("--layouts", type=_str_list, default=list(gemm.LAYOUTS),
                   help="hf: one shape per HF projection module; fused: vLLM-style qkv and gate_up (default: both)")
    p.add_argument("--directions", type=_str_list, default=list(gemm.DIRECTIONS),
                   help="fwd: y = x @ W.T; bwd: the input gradient dy @ W (default: both)")
    p.add_argument("--eager", action="store_true", help="time Python launches instead of CUDA-graph replays")
    p.add_argument("--json", default=None, help="write the full results JSON here (atomic)")
    p.set_defaults(func=_gemm)

    p = bsub.add_parser("train", help="one GRPO step (rollout + scoring + forward/backward + optimizer) through the "
                                      "real trainer, random-weight Qwen2.5 shapes, per mode")
    p.add_argument("--models", type=_str_list, default=["qwen2.5-7b"], help="configs from data/configs/")
    p.add_argument("--modes", type=_str_list, default=["lora", "qlora", "nvfp4", "qerl"])
    p.add_argument("--batches", type=_int_list, default=[8], help="completions per step")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=2048)
    p.add_argument("--steps", type=int, default=4,
                   help="steps per case; the first is warm-up, the row reports the medians of the rest (default 4: "
                        "three, so one slow step, such as a first-time kernel compilation, does not set them)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward (default: each process's share)")
    p.add_argument("--groups", type=int, default=1, help="prompts per step (the batch splits into that many groups)")
    p.add_argument("--num-gpus", type=_int_list, default=[1],
                   help="comma-separated data-parallel process counts, e.g. 1,2 (rows get speedup_vs_1gpu)")
    p.add_argument("--no-gradient-checkpointing", action="store_true")
    p.add_argument("--checkpoint-layers", type=_count_list, default=None,
                   help="comma-separated counts of decoder layers that recompute under checkpointing, one case each "
                        "(e.g. 28,14,0; the others keep their activations); default all")
    p.add_argument("--mismatch-forward", action="store_true", help="also run the μ = 1 mismatch forward")
    p.add_argument("--preset-settings", action="store_true",
                   help="run each model's qwen2.5-SIZE-gsm8k preset as `qerl train` would (its batch, lengths, "
                        "micro-batch, μ, rank, rollout rows); --batches, --prompt-len, --gen-len, --lora-rank, "
                        "--micro-batch, --groups, --num-gpus, --no-gradient-checkpointing, --mismatch-forward and "
                        "--checkpoint-layers are then refused, while --num-iterations still sets μ")
    p.add_argument("--num-iterations", type=int, default=None,
                   help="μ, policy updates per rollout (default: 1, or the preset's with --preset-settings)")
    p.add_argument("--rollout-lora-merge", type=_str_list, default=["off"],
                   help="off, on or off,on: mode lora's rollout with the adapters merged into a copy of the bf16 "
                        "base (qerl train --rollout-lora-merge); the quantized modes always run once, unmerged")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed",
                   help="completion lengths: fixed (every row --gen-len; random weights rarely stop) or gsm8k-like "
                        "(each row stops at its own length drawn from GSM8K's solutions, scaled to --gen-len, new "
                        "draws every step: RL's uneven, changing lengths)")
    p.add_argument("--pad-to-multiple-of", type=_count_list, default=None, metavar="N[,N...]",
                   help="comma-separated paddings of the trainer's prompts and completions, one case each; 0: to the "
                        "batch's longest, e.g. 0,64 (default: the preset's, 64)")
    p.add_argument("--dry-run", action="store_true",
                   help="build and check every case and its trainer config, list them (and those an existing --json "
                        "already holds, which would be skipped), run nothing")
    p.add_argument("--json", default=None,
                   help="write the rows JSON here (atomic), rewritten after every case; if it exists, the same command "
                        "resumes it: its cases without an error are kept and not run again (a file holding other cases "
                        "is refused)")
    p.add_argument("--force", action="store_true", help="start over: replace an existing --json instead of resuming it")
    p.set_defaults(func=_train)

    # `qerl bench rollout`: its arguments and handler live in qerl_lib.bench.rollout_cli
    p = bsub.add_parser("rollout", help="rollout speed (TTFT, TPOT, tok/s, peak VRAM): bf16 vs NVFP4 engines")
    rollout_cli.add_arguments(p)
    p.set_defaults(func=rollout_cli.run_cli)


def _train(args) -> int:
    from dataclasses import replace

    from qerl_lib.errors import UserError
    from qerl_lib.io import prepare_output_file, write_json_atomic
    from qerl_lib.studies.train_bench import TrainCase, case_key, format_bench, resume_rows, run_bench

    merges = args.rollout_lora_merge
    if not merges or set(merges) - {"off", "on"}:
        raise UserError(f"--rollout-lora-merge takes off, on or off,on, got {','.join(merges) or 'nothing'}")

    def merge_values(mode: str) -> list[bool]:
        return [m == "on" for m in merges] if mode == "lora" else [False]

    paddings = args.pad_to_multiple_of or [None]  # None: the preset's
    if args.preset_settings:
        changed = [f"--{k.replace('_', '-')}" for k, default in (("batches", [8]), ("prompt_len", 256),
                   ("gen_len", 2048), ("lora_rank", 32), ("micro_batch", None), ("groups", 1), ("num_gpus", [1]),
                   ("no_gradient_checkpointing", False), ("mismatch_forward", False), ("checkpoint_layers", None))
                   if getattr(args, k) != default]
        if changed:
            raise UserError(f"--preset-settings runs the preset's own settings: drop {', '.join(changed)}")
        cases = [replace(TrainCase.from_preset(m, mode, steps=args.steps, num_iterations=args.num_iterations,
                                               rollout_lora_merge=g), workload=args.workload, pad_to_multiple_of=q)
                 for m in args.models for mode in args.modes for g in merge_values(mode) for q in paddings]
    else:
        cases = [TrainCase(model=m, mode=mode, batch=b, prompt_len=args.prompt_len, gen_len=args.gen_len,
                           steps=args.steps, lora_rank=args.lora_rank, micro_batch=args.micro_batch,
                           gradient_checkpointing=not args.no_gradient_checkpointing,
                           mismatch_forward=args.mismatch_forward, groups=args.groups, num_gpus=n,
                           num_iterations=args.num_iterations or 1, checkpoint_layers=c, rollout_lora_merge=g,
                           workload=args.workload, pad_to_multiple_of=q)
                 for m in args.models for b in args.batches for mode in args.modes for g in merge_values(mode)
                 for n in args.num_gpus for c in (args.checkpoint_layers or [None]) for q in paddings]
    # --json: an existing file is resumed (its finished cases kept, see studies/train_bench.py), unless --force
    kept, earlier_runs = [], []
    if args.json:
        prepare_output_file(args.json, force=None, flag="--json")  # a folder is refused; a file is read below
        if not args.force:
            kept, earlier_runs = resume_rows(args.json, cases)
    skipped = {case_key(row) for row in kept}
    if args.dry_run:  # a GPU job's commands checked before device time is spent on them
        from qerl_lib.studies.train_bench import case_config

        for case in cases:
            case_config(case)
            print(f"{case.model} {case.mode}{'+m' if case.rollout_lora_merge else ''} batch {case.batch} "
                  f"({case.groups} group(s), {case.num_gpus} GPU(s)), {case.prompt_len} + {case.gen_len} tokens, "
                  f"r{case.lora_rank}, {case.steps} steps" + (f"  (skip: in {args.json})" if case_key(case) in skipped
                                                               else ""))
        would = ""
        if args.json:
            would = (f", {args.json} would be replaced (--force)" if args.force else
                     f", {sum(case_key(c) in skipped for c in cases)} already in {args.json} would be skipped")
        print(f"{len(cases)} case(s) checked{would}; nothing ran (--dry-run)")
        return 0
    command = " ".join(["qerl", *sys.argv[1:]])

    def stamp(record: dict) -> dict:
        """The record with this command (and the runs whose rows it kept) in its provenance."""
        record["provenance"]["command"] = command
        if earlier_runs:
            record["provenance"]["resumed_from"] = earlier_runs
        return record

    if args.json:  # the record so far is written after every case, so a crash keeps every finished one
        if kept:
            print(f"kept {len(kept)} row(s) from {args.json}; running "
                  f"{sum(case_key(c) not in skipped for c in cases)} case(s)", flush=True)
        record = run_bench(cases, kept=kept, checkpoint=lambda rec: write_json_atomic(args.json, stamp(rec)))
    else:  # nothing to resume or to keep: the plain call
        record = run_bench(cases)
    stamp(record)
    print(format_bench(record))
    if args.json:
        write_json_atomic(args.json, record)
        print(f"wrote {args.json} (draw it: qerl plot-steps {args.json})")
    return 0


def _gemm(args) -> int:
    from qerl_lib.bench.gemm import LAYOUTS, check_directions, render_gemm_report, run_gemm_benchmark
    from qerl_lib.errors import UserError
    from qerl_lib.io import write_json_atomic

    bad = [x for x in args.layouts if x not in LAYOUTS]
    if bad:
        raise UserError(f"--layouts accepts {' and '.join(LAYOUTS)}, got {bad}")
    check_directions(args.directions)  # before the CUDA check: a typo is reported on any machine
    # `qerl ...` and `python -m qerl_lib ...` both leave the sub-command in sys.argv[1:]
    command = " ".join(["qerl", *sys.argv[1:]])
    doc = run_gemm_benchmark(args.models, args.ms, layouts=args.layouts, directions=args.directions,
                             graph=not args.eager, command=command)
    print(render_gemm_report(doc))
    if args.json:
        print(f"wrote {write_json_atomic(args.json, doc)}")
    # last stdout line: one JSON document (the acceptance summary)
    print(json.dumps({"benchmark": "gemm", "device": doc["provenance"]["device"].get("name"),
                      "summary": doc["summary"]}))
    return 0 if all(s["all_ok"] for s in doc["summary"].values()) else 1
