"""`qerl eval`: accuracy of a base, NVFP4 or LoRA model on generated arithmetic or GSM8K.

One command for every kind of model, because the rollout engine runs them all: a dense folder
(bf16), an NVFP4A16 compressed-tensors folder (packed weights, FP4 kernel on GPU), and either of
them with ``--lora DIR`` (a peft adapter folder, applied unmerged). Reports pass@1 (mean over K
samples, with a 95% bootstrap interval over problems), pass@K, format rate and mean length;
``--json`` writes the summary with provenance and ``--records`` (default: next to it) one jsonl
line per problem. ``--greedy`` is temperature 0 with one sample.

Registered by `qerl_lib.cli.generation.register` through `register_eval(sub)`.

Examples::

    qerl eval --model smollm2 --data arith --n 64 --greedy
    qerl eval --model smollm2 --data gsm8k --path gsm8k_test.jsonl --n 50 --samples 4 \\
        --json artifacts/eval_smollm2.json
    qerl eval --model artifacts/nvfp4_model --lora artifacts/run1/adapters --data gsm8k --path test.jsonl
"""

from __future__ import annotations

import json
from pathlib import Path

from qerl_lib.cli.devices import resolve_cli_device
from qerl_lib.errors import UserError


def register_eval(sub) -> None:
    p = sub.add_parser("eval", help="accuracy of a base / NVFP4 / LoRA model (pass@1 with a 95%% interval)",
                       description=__doc__.split("\n\n")[1])
    p.add_argument("--model", required=True, help="model folder, `smollm2` (embedded) or a hub id when online")
    p.add_argument("--lora", default=None, help="peft adapter folder to apply (unmerged) on top of --model")
    p.add_argument("--data", choices=("arith", "gsm8k", "file"), default="arith",
                   help="arith: generated problems; gsm8k: hub or --path; file: any GSM8K-schema --path")
    p.add_argument("--path", default=None, help="local GSM8K-schema jsonl (needed for gsm8k offline)")
    p.add_argument("--split", choices=("train", "test"), default="test")
    p.add_argument("--n", type=int, default=None, help="first N problems (default: 64 for arith, all otherwise)")
    p.add_argument("--samples", type=int, default=1, help="K completions per problem (pass@1 averages them)")
    p.add_argument("--temperature", type=float, default=0.6, help="paper's evaluation: 0.6; 0 = greedy")
    p.add_argument("--top-p", type=float, default=0.95, help="paper's evaluation: 0.95")
    p.add_argument("--greedy", action="store_true", help="temperature 0, one sample per problem")
    p.add_argument("--max-new-tokens", type=int, default=1024, help="official eval script: 1024")
    p.add_argument("--batch-size", type=int, default=64, help="completions per engine call")
    p.add_argument("--seed", type=int, default=0, help="sampling, arith generation and bootstrap seed")
    p.add_argument("--last-number-fallback", action="store_true",
                   help="also accept the last number of an unmarked completion (base models)")
    p.add_argument("--with-entropy", action="store_true", help="also the mean next-token entropy on own completions")
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1 ...")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="activation/dense-weight dtype (auto: bf16 on CUDA, fp32 on CPU where bf16 matmuls are slow)")
    p.add_argument("--json", default=None, help="write the summary (with provenance) here")
    p.add_argument("--records", default=None, help="per-problem jsonl (default: <json stem>.records.jsonl)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_eval)


def _resolve_device_dtype(device: str, dtype: str):
    import torch

    device = str(resolve_cli_device(device))
    if dtype == "auto":
        # The weights are bf16 values either way (float32 holds them exactly). CPUs without
        # AVX512-BF16 emulate bf16 matmuls, several times slower, so CPU computes in float32.
        dtype = "bf16" if device.startswith("cuda") else "fp32"
    return device, {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]


def _eval(args) -> int:
    from transformers import AutoTokenizer

    from qerl_lib.tasks.problems import load_problems
    from qerl_lib.io import provenance
    from qerl_lib.evals.evaluation import EvalConfig, evaluate
    from qerl_lib.io import prepare_output_file, write_json_atomic, write_jsonl_atomic
    from qerl_lib.models.loader import is_nvfp4_checkpoint, load_model, resolve_model_dir

    if args.n is not None and args.n < 1:
        raise UserError(f"--n must be >= 1 (the first N problems), got {args.n}")
    if args.greedy:
        args.temperature, args.samples = 0.0, 1
    if args.quiet:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Loading weights" bars
    try:
        config = EvalConfig(samples=args.samples, temperature=args.temperature, top_p=args.top_p,
                            max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=args.seed,
                            with_entropy=args.with_entropy, last_number_fallback=args.last_number_fallback)
    except ValueError as e:
        raise UserError(f"{e} (check --samples/--temperature/--top-p/--max-new-tokens/--batch-size)") from None
    # Data first: a wrong path, a non-UTF-8 file, an empty gold answer or an offline hub fails in a
    # second, before any model is loaded (load_problems checks every gold answer).
    problems = load_problems(args.data, split=args.split, n=args.n, seed=args.seed, path=args.path)
    records_path = args.records or (str(Path(args.json).with_suffix("")) + ".records.jsonl" if args.json else None)
    for flag, out in (("--json", args.json), ("--records", records_path)):  # never over the problems being read
        if out is not None:
            prepare_output_file(out, [args.path], force=None, flag=flag)
    if args.lora:
        from qerl_lib.models.lora import check_adapter_dir

        check_adapter_dir(args.lora)  # before the model loads
    device, dtype = _resolve_device_dtype(args.device, args.dtype)
    folder = resolve_model_dir(args.model)
    model = load_model(folder, device=device, dtype=dtype)
    if args.lora:
        from qerl_lib.models.lora import load_adapters

        model = load_adapters(model, args.lora, is_trainable=False)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))

    try:
        report = evaluate(model, tokenizer, problems, config, progress=not args.quiet)
    except ValueError as e:  # from the engine: prompt + max_new_tokens over the cache limit, bad ids; names the fix
        raise UserError(str(e)) from None
    s = report.summary
    kind = "nvfp4" if is_nvfp4_checkpoint(folder) else "dense"
    mode = "greedy" if config.greedy else f"T={config.temperature} top-p={config.top_p}"
    print(f"model {folder} ({kind}{' + LoRA ' + args.lora if args.lora else ''}) on {args.data} "
          f"{args.split}: {s['n_problems']} problems x {s['samples']} samples, {mode}, device {device}")
    print(f"{'pass@1':>8s} {'95% CI':>17s} {'pass@' + str(s['samples']):>8s} {'format':>7s} "
          f"{'length':>7s} {'cut':>6s}" + (f" {'entropy':>8s}" if config.with_entropy else ""))
    lo, hi = s["pass@1_ci95"]
    entropy = "" if not config.with_entropy else f" {'-':>8s}" if s["entropy"] is None else f" {s['entropy']:8.4f}"
    print(f"{s['pass@1']:8.4f} [{lo:7.4f}, {hi:7.4f}] {s['pass@k']:8.4f} {s['format_rate']:7.3f} "
          f"{s['mean_length']:7.1f} {s['truncated_rate']:6.3f}{entropy}")
    print(f"{report.timing['tokens_per_second']} tokens/s ({report.timing['sampling_seconds']} s sampling)")

    result = {"summary": s, "timing": report.timing,
              "model": {"path": str(folder), "kind": kind, "lora": args.lora, "device": device,
                        "dtype": str(dtype).removeprefix("torch.")},
              "data": {"source": args.data, "path": args.path, "split": args.split, "n": len(problems)},
              "provenance": provenance(command="qerl eval")}
    if args.json:
        print(f"wrote {write_json_atomic(args.json, result)}")
    if records_path:
        rows = [{k: v for k, v in r.items() if k != "completion_ids"} for r in report.records]
        print(f"wrote {write_jsonl_atomic(records_path, rows)} ({len(rows)} problems)")
    print(json.dumps({"pass@1": s["pass@1"], "pass@1_ci95": s["pass@1_ci95"], "pass@k": s["pass@k"],
                      "format_rate": s["format_rate"], "mean_length": s["mean_length"]}))
    return 0
