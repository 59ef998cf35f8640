"""`qerl bench rollout`'s arguments and handler (the measuring itself: `bench/rollout.py`).

``--json`` is rewritten (atomically) after every row, so a run cut short keeps its rows; run again with the same
file and settings, it keeps the rows finished without an error and measures only the rest (`bench/rollout_resume.py`;
a file of other settings, or not one run's record, is refused, and ``--force`` starts over). ``--merge`` combines
results files, a configuration measured again replacing its earlier rows.
"""

from __future__ import annotations

import argparse
import sys

from qerl_lib.bench import rollout
from qerl_lib.bench.rollout import (DEFAULT_WEIGHTS, LORA_FOLD, MODELS, WEIGHTS, RolloutBenchConfig, plan_sweep,
                                    run_rollout_bench)
from qerl_lib.bench.rollout_report import TABLE_COLUMNS, merge_results, render_rollout_report
from qerl_lib.bench.table import table_header
from qerl_lib.bench.workloads import WORKLOADS
from qerl_lib.engine.forward import DECODE_ATTENTION
from qerl_lib.engine.rollout import DECODE_BACKENDS
from qerl_lib.kernels.fp4_gemm import SMALL_M_BACKENDS


def add_arguments(p: argparse.ArgumentParser) -> None:
    def ints(s):
        try:
            return tuple(int(x) for x in s.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None

    def names(s):
        return tuple(x.strip() for x in s.split(",") if x.strip())

    p.add_argument("--models", type=names, default=RolloutBenchConfig.models, help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--batch", type=ints, default=RolloutBenchConfig.batches, dest="batches")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=2048)
    p.add_argument("--lora-rank", type=ints, default=(0,), dest="lora_ranks", help="e.g. 0,16,32,64 (0 = no adapter)")
    p.add_argument("--weights", type=names, default=DEFAULT_WEIGHTS,
                   help=f"comma list of {', '.join(WEIGHTS)} (nf4: the QLoRA baseline, needs bitsandbytes)")
    p.add_argument("--backends", type=names, default=("auto",),
                   help=f"engine decode backends to compare: {', '.join(DECODE_BACKENDS)}")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-hf-baseline", action="store_false", dest="hf_baseline")
    p.add_argument("--hf-gen-len", type=int, default=None, help="generated tokens for the transformers baseline")
    p.add_argument("--hf-batch", type=ints, default=(64,), dest="hf_batches",
                   help="batches at which the transformers baseline runs (default 64)")
    p.add_argument("--init", choices=("random_codes", "quantize"), default="random_codes")
    p.add_argument("--profile", action="store_true",
                   help="print a kernel-time table of a few decode steps per model (torch.profiler)")
    p.add_argument("--no-fuse-projections", action="store_false", dest="fuse_projections",
                   help="call q/k/v and gate/up one by one (the engine fuses them on CUDA by default)")
    p.add_argument("--decode-attention", choices=DECODE_ATTENTION, default=None,
                   help="decode attention of the engine (default: the split-KV Triton kernel on CUDA)")
    p.add_argument("--fp4-small-m", choices=SMALL_M_BACKENDS, default="auto",
                   help="NVFP4 GEMM kernel for decode (M <= 8): auto = the mma.sync CUDA kernel where it runs")
    p.add_argument("--workload", choices=WORKLOADS, default="fixed",
                   help="fixed: every row generates --gen-len tokens; gsm8k-like: uneven lengths up to --gen-len "
                        "(GSM8K solution lengths, bench/workloads.py), as RL rollouts end")
    p.add_argument("--scheduling", type=names, default=("static",),
                   help="static: the rollout's prompts in batches of --batch, each until its longest row ends; "
                        "continuous: --batch rows, each refilled from the queue as its sequence ends (comma list)")
    p.add_argument("--prompts", type=int, default=None,
                   help="completions per rollout (default: one batch); with more, static runs several batches")
    p.add_argument("--lora-in-gemm", action="store_true",
                   help="NVFP4 decode: the mma.sync GEMM adds its group's adapters itself instead of kernels/lora.py's "
                        "two launches after it (measured slower on an H100; dev/LOG.md section 25)")
    p.add_argument("--lora-fold", choices=tuple(LORA_FOLD), default="auto",
                   help="the gate/up group's LoRA expand inside the SiLU x up kernel: auto (above 8 rows, where it "
                        "measured faster on an H100; dev/LOG.md section 29), on, off")
    p.add_argument("--lora-merge", type=names, default=("off",),
                   help="on: a bf16 base's adapters merged into engine-owned weight copies for the rollout "
                        "(engine/merged.py: no adapter launches, one copy of the weights more); off,on: both")
    p.add_argument("--no-lora-kernels", action="store_false", dest="lora_kernels",
                   help="apply adapters with torch matmuls (one per group + one addmm per member) instead of "
                        "kernels/lora.py's two launches per group")
    p.add_argument("--engines", type=names, default=("kit",),
                   help="kit and/or vllm: vLLM 0.24 on the same checkpoint, prompts and GPU, in its own process "
                        "(bench/vllm_peer.py; bf16, nvfp4 and nf4 weights; nf4 needs bitsandbytes on --vllm-pythonpath)")
    p.add_argument("--vllm-pythonpath", default=None,
                   help="PYTHONPATH of the vLLM process, e.g. /tmp/vsite:/tmp/site (default: this process's)")
    p.add_argument("--vllm-workdir", default=None, help="folder for the checkpoint vLLM loads (default: temp)")
    p.add_argument("--json", default=None, dest="json_out",
                   help="write the results JSON here (atomically), rewritten after every row; if it exists, the same "
                        "command resumes it: its rows without an error are kept and not measured again (a file of "
                        "other settings is refused; other files can be combined with --merge)")
    p.add_argument("--force", action="store_true", help="start over: replace an existing --json instead of resuming it")
    p.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                   help="instead of measuring: merge these results files into --json and print the table (--json may "
                        "be one of them)")


def run_cli(args) -> int:
    import json

    from qerl_lib.bench.rollout_resume import resume_rows
    from qerl_lib.io import prepare_output_file, write_json_atomic

    if args.merge:
        from pathlib import Path

        from qerl_lib.errors import UserError

        docs = [json.loads(Path(f).read_text()) for f in args.merge]
        for name, doc in zip(args.merge, docs):
            whole = isinstance(doc, dict) and isinstance(doc.get("rows"), list) and {"provenance", "config"} <= set(doc)
            if not whole:
                raise UserError(f"{name} is not a results file of `qerl bench rollout --json` (it needs rows, "
                                "provenance and config): pass only files that command wrote")
        try:
            result = merge_results(docs)
        except TypeError as e:  # a row with fields this kit's rows do not have (or lack)
            raise UserError(f"the rows of {', '.join(args.merge)} do not match this kit's rollout rows ({e}): "
                            "measure them again with this version") from None
        if args.json_out:
            write_json_atomic(args.json_out, result)
        print(render_rollout_report(result))
        return 0

    cfg = RolloutBenchConfig(models=args.models, batches=args.batches, prompt_len=args.prompt_len,
                             gen_len=args.gen_len, lora_ranks=args.lora_ranks, weights=args.weights,
                             backends=args.backends, repeats=args.repeats, hf_baseline=args.hf_baseline,
                             hf_gen_len=args.hf_gen_len, hf_batches=args.hf_batches, init=args.init,
                             profile=args.profile, fuse_projections=args.fuse_projections,
                             decode_attention=args.decode_attention, fp4_small_m=args.fp4_small_m,
                             workload=args.workload, lora_kernels=args.lora_kernels, lora_in_gemm=args.lora_in_gemm,
                             lora_fold=args.lora_fold, lora_merge=args.lora_merge,
                             scheduling=args.scheduling,
                             prompts=args.prompts, engines=args.engines, vllm_pythonpath=args.vllm_pythonpath,
                             vllm_workdir=args.vllm_workdir)
    # --json: an existing file is resumed (its finished rows kept, bench/rollout_resume.py), unless --force
    kept, earlier_runs = [], []
    if args.json_out:
        prepare_output_file(args.json_out, force=None, flag="--json")  # a folder is refused; a file is read below
        if not args.force:
            kept, earlier_runs = resume_rows(args.json_out, cfg, rollout.BENCH_DEVICE)

    def stamp(doc: dict) -> dict:
        """The document with the runs whose rows it kept in its provenance."""
        if earlier_runs:
            doc["provenance"]["resumed_from"] = earlier_runs
        return doc

    if kept:
        planned = sum(len(entries) for *_, entries in plan_sweep(cfg))
        print(f"kept {len(kept)} row(s) from {args.json_out}; {planned - len(kept)} to measure", flush=True)
    print(table_header(TABLE_COLUMNS), flush=True)
    checkpoint = (lambda doc: write_json_atomic(args.json_out, stamp(doc))) if args.json_out else None
    result = stamp(run_rollout_bench(cfg, log=lambda line: print(line, flush=True), checkpoint=checkpoint, kept=kept))
    if args.json_out:
        write_json_atomic(args.json_out, result)
    print(render_rollout_report(result))
    print(json.dumps(result["summary"]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qerl_lib.bench.rollout", description="rollout throughput: bf16 vs NVFP4 (vs NF4) engines")
    add_arguments(parser)
    from qerl_lib.errors import UserError

    try:
        return run_cli(parser.parse_args(argv))
    except UserError as e:
        print(f"bench rollout: error: {e}", file=sys.stderr)
        return 2
