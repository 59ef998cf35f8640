"""`qerl train` (GRPO/DAPO with LoRA on a bf16 / NF4 / NVFP4 base, AQN in mode qerl), `qerl plot-run` and
`qerl plot-steps`."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def register(sub) -> None:
    from qerl_lib.train.aqn import SCHEDULES
    from qerl_lib.train.presets import AQN_TARGETS, BASE_FORMATS, DECODE_BACKENDS, MODES, PRESETS, REPORT_TO

    p = sub.add_parser("train", help="RL fine-tuning (GRPO/DAPO) of LoRA adapters on a frozen bf16/NF4/NVFP4 base",
                       description="Presets: " + ", ".join(PRESETS) + ". Modes: lora (bf16 base), qlora (NF4 base), "
                                   "nvfp4 (NVFP4 base), qerl (NVFP4 base + adaptive quantization noise).")
    p.add_argument("--preset", required=True, help=f"one of: {', '.join(PRESETS)}")
    p.add_argument("--mode", default=None, help=f"{' | '.join(MODES)} (default: the preset's, qerl)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default: the preset's)")
    p.add_argument("--seed", type=int, default=None, help="run seed: LoRA init, data order, rollouts, AQN noise")
    p.add_argument("--out", default=None,
                   help="run folder (default: artifacts/train/PRESET-ARM-seedS, ARM being the mode or an ablation's "
                        "label such as bf16+aqn)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    p.add_argument("--model", default=None, help="model folder or hub id instead of the preset's")
    p.add_argument("--data-path", default=None, help="local problems file (GSM8K-schema jsonl) for file/gsm8k data")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None)
    p.add_argument("--is-correction", choices=("on", "off"), default=None,
                   help="truncated importance sampling with the engine's logprobs (default off, see qerl_lib/train/grpo.py)")
    p.add_argument("--decode-backend", choices=DECODE_BACKENDS, default=None,
                   help="rollout engine decode path (default auto: graphs+fused on GPU, eager on CPU)")
    p.add_argument("--rollout-lora-merge", action="store_true", default=None,
                   help="bf16 base (mode lora): roll out with the adapters merged into the engine's own weight copies "
                        "(no adapter launches; one more copy of the weights in memory during the rollout)")
    p.add_argument("--save-steps", type=int, default=None, help="checkpoint every N steps (default: the preset's)")
    p.add_argument("--save-total-limit", type=int, default=None,
                   help="complete checkpoints kept, newest first (default: the preset's)")
    p.add_argument("--num-gpus", type=int, default=1,
                   help="data-parallel processes, one per GPU: runs `accelerate launch --config_file "
                        "data/accelerate/one_node.yaml --num_processes N -m qerl_lib train ...` (the global batch "
                        "stays the preset's)")
    p.add_argument("--prompts-per-step", type=int, default=None,
                   help="prompts per optimizer step, over all processes (default: the preset's)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="completions per forward/backward on each process (default: the preset's)")
    p.add_argument("--checkpoint-layers", type=int, default=None,
                   help="with gradient checkpointing: how many decoder layers recompute in the backward (the others "
                        "keep their activations: no recompute, more memory); default all")
    p.add_argument("--pad-to-multiple-of", type=int, default=None, metavar="N",
                   help="pad the trainer's prompts and completions each to a multiple of N tokens: fewer distinct "
                        "lengths, fewer per-shape set-ups (cuDNN attention plans); 0: to each batch's longest "
                        "(default: the preset's: 64 for Qwen2.5, 0 for SmolLM2)")
    p.add_argument("--report-to", choices=REPORT_TO, default=None,
                   help="also send the step metrics (kit names) to a tracker, offline, under --out: tensorboard "
                        "(OUT/tensorboard), trackio (OUT/trackio), wandb (WANDB_MODE=offline unless set); default none")
    g = p.add_argument_group("ablations (each independent of the others; a mode is shorthand for --base and --aqn)")
    g.add_argument("--base", choices=BASE_FORMATS, default=None,
                   help="frozen base format instead of the mode's (mxfp4: dense weights fake-quantized to MXFP4)")
    g.add_argument("--aqn", choices=AQN_TARGETS, default=None,
                   help="adaptive quantization noise: off, rollout (the paper's), both (also the trainer's forward)")
    g.add_argument("--schedule", choices=SCHEDULES, default=None, help="AQN σ schedule (default exponential)")
    g.add_argument("--sigma-start", type=float, default=None, help="AQN σ of the first noisy stage")
    g.add_argument("--sigma-end", type=float, default=None, help="AQN σ of the last stage")
    g.add_argument("--aqn-stages", type=int, default=None,
                   help="AQN stages K >= 2 (stage 0 is noise-free); a run of fewer steps gets one stage per step")
    g.add_argument("--lr", type=float, default=None, help="learning rate for any base (default: the preset's per base)")
    g.add_argument("--lora-rank", type=int, default=None, help="LoRA rank (default: the preset's)")
    g.add_argument("--level", type=int, default=None, help="task level (arith: operations; expr: 1-5)")
    p.set_defaults(func=_train)

    p = sub.add_parser("plot-run", help="reward, entropy, σ and time-split curves of one or more training runs")
    p.add_argument("runs", nargs="+", help="run folders written by `qerl train` (each holds metrics.jsonl)")
    p.add_argument("--out", default=None, help="PNG path (default: RUN/training_curves.png for one run)")
    p.set_defaults(func=_plot_run)

    p = sub.add_parser("plot-steps", help="the GRPO step by phase (rollout, trainer, rest) per mode and model, from "
                                          "`qerl bench train --json`")
    p.add_argument("json", help="a JSON written by `qerl bench train --json`")
    p.add_argument("--out", default=None, help="PNG path (default: the JSON's path with .png)")
    p.set_defaults(func=_plot_steps)


def _train(args) -> int:
    from qerl_lib.errors import UserError
    from qerl_lib.train.presets import make_config

    if args.num_gpus < 1:
        raise UserError(f"--num-gpus {args.num_gpus}: use 1 or more")
    from qerl_lib.paths import ARTIFACTS_DIR

    overrides = {"model": args.model, "data_path": args.data_path, "device": args.device,
                 "decode_backend": args.decode_backend, "save_steps": args.save_steps,
                 "save_total_limit": args.save_total_limit, "base_format": args.base,
                 "aqn_target": args.aqn, "aqn_schedule": args.schedule, "sigma_start": args.sigma_start,
                 "sigma_end": args.sigma_end, "aqn_stages": args.aqn_stages, "lr": args.lr,
                 "lora_rank": args.lora_rank, "data_level": args.level, "report_to": args.report_to,
                 "prompts_per_step": args.prompts_per_step, "micro_batch": args.micro_batch,
                 "checkpoint_layers": args.checkpoint_layers, "rollout_lora_merge": args.rollout_lora_merge,
                 "pad_to_multiple_of": args.pad_to_multiple_of}
    if args.is_correction is not None:
        overrides["is_correction"] = args.is_correction == "on"
    config = make_config(args.preset, mode=args.mode, steps=args.steps, seed=args.seed,
                         **{k: v for k, v in overrides.items() if v is not None})
    out = args.out or ARTIFACTS_DIR / "train" / f"{config.preset}-{config.arm_label}-seed{config.seed}"

    if args.num_gpus > 1 and "WORLD_SIZE" not in os.environ:
        from qerl_lib.train.grpo import accumulation_steps

        os.environ["WORLD_SIZE"] = str(args.num_gpus)  # check the split here, before launching anything
        try:
            accumulation_steps(config)
        finally:
            del os.environ["WORLD_SIZE"]
        return _launch(args.num_gpus)

    from qerl_lib.train.grpo import train

    summary = train(config, out, resume=args.resume)
    if not summary:  # not the first process of an `accelerate launch`: that one reports
        return 0
    seconds = summary["seconds"]
    rollouts = "" if summary["rollouts"] == summary["steps"] else f" ({summary['rollouts']} rollouts)"
    print(f"done: {summary['steps']} steps{rollouts} in {seconds['step_seconds']:.0f}s "
          f"(rollout {seconds['rollout_seconds']:.0f}s = {100 * (summary['rollout_share'] or 0):.0f}%, "
          f"training {seconds['train_seconds']:.0f}s); reward first {summary['window']} steps "
          f"{_fmt(summary['first']['reward'])} -> last {_fmt(summary['last']['reward'])}; summary in {out}/summary.json")
    return 0


def _fmt(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _plot_run(args) -> int:
    from pathlib import Path

    from qerl_lib.errors import UserError
    from qerl_lib.io import prepare_output_file
    from qerl_lib.plots.training import plot_runs
    from qerl_lib.train.metrics import read_run_config

    runs = {}
    for run in args.runs:
        metrics = Path(run) / "metrics.jsonl"
        if not metrics.is_file():
            raise UserError(f"{run} has no metrics.jsonl: pass a folder written by `qerl train`")
        label = Path(run).name
        config = Path(run) / "run.json"
        if config.is_file():
            label = read_run_config(config, fix="pass a `qerl train` run folder").get("mode", label)
            label = label if label not in runs else Path(run).name
        runs[label] = metrics
    out = args.out or (Path(args.runs[0]) / "training_curves.png" if len(args.runs) == 1 else None)
    if out is None:
        raise UserError("several runs: pass --out FILE.png for the comparison figure")
    inputs = [f for run in args.runs for f in (Path(run) / "metrics.jsonl", Path(run) / "run.json")]
    prepare_output_file(out, inputs, force=None, suffix=".png")  # a figure, never over a run's files
    try:
        print(plot_runs(runs, out))
    except ValueError as exc:  # a metrics file without a step yet (the message names it)
        raise UserError(f"{exc}: train at least one step first, or pass another run folder") from None
    return 0


def _launch(num_gpus: int) -> int:
    """Re-run this command under `accelerate launch` with one process per GPU."""
    from qerl_lib.paths import DATA_DIR

    argv = sys.argv[1:]
    args = [a for i, a in enumerate(argv) if not (a == "--num-gpus" or (i and argv[i - 1] == "--num-gpus")
                                                 or a.startswith("--num-gpus="))]
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(DATA_DIR / "accelerate" / "one_node.yaml"), "--num_processes", str(num_gpus), "-m", "qerl_lib",
               *args]
    print("running: " + " ".join(command[2:]), flush=True)
    return subprocess.call(command)


def _plot_steps(args) -> int:
    from pathlib import Path

    from qerl_lib.errors import UserError
    from qerl_lib.io import prepare_output_file
    from qerl_lib.plots.train_step import plot_train_steps

    src = Path(args.json)
    hint = "pass the file written by `qerl bench train --json`"
    if not src.is_file():
        raise UserError(f"{src} does not exist: {hint}")
    try:
        doc = json.loads(src.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{src} is not JSON ({exc}): {hint}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("rows"), list):
        raise UserError(f"{src} has no 'rows' list: {hint}")
    out = prepare_output_file(args.out, [src], force=None, suffix=".png") if args.out else src.with_suffix(".png")
    try:
        print(plot_train_steps(src, out))
    except ValueError as exc:  # names the file and what is missing
        raise UserError(str(exc)) from None
    except KeyError as exc:
        raise UserError(f"{src}: a step row lacks {exc}: {hint}") from None
    return 0
