"""`qerl quantize`, `qerl inspect` and `qerl export`: NVFP4 checkpoints from the command line."""

from __future__ import annotations

import json
import re


def register(sub) -> None:
    p = sub.add_parser("quantize", help="write an NVFP4A16 compressed-tensors checkpoint of a dense model")
    p.add_argument("--model", required=True, help="dense model (bf16, fp16 or fp32 safetensors): local folder, hub id, "
                                                  "or 'smollm2' (embedded)")
    p.add_argument("--out", required=True, help="output folder (written atomically; never the model folder)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    p.add_argument("--scheme", default="NVFP4A16", help="quantization scheme (only NVFP4A16: 4-bit weights, bf16 activations)")
    p.add_argument("--backend", choices=("llmcompressor", "native"), default="llmcompressor",
                   help="llmcompressor: the reference tool (oneshot, data-free); native: this kit's quantizer. "
                        "Both quantize in the dtype the model is stored in (fp32 weights are not rounded to bf16 "
                        "first; dense tensors keep that dtype), so model.safetensors and config.json are "
                        "byte-identical for bf16, fp16 and fp32 models; llmcompressor also writes recipe.yaml "
                        "(default: llmcompressor)")
    p.add_argument("--device", default="cpu", help="device for the native backend (e.g. cuda)")
    p.set_defaults(func=_quantize)

    p = sub.add_parser("inspect", help="per-module formats and resident linear-weight bytes vs bf16")
    p.add_argument("model", nargs="?", default=None, help="model folder or hub id (bf16 or NVFP4)")
    p.add_argument("--config", default=None,
                   help="instead of a model: build a random NVFP4 model from data/configs/<NAME>.json (e.g. qwen2.5-7b)")
    p.add_argument("--init", choices=("random_codes", "quantize"), default="random_codes",
                   help="with --config: draw random codes (fast) or quantize random bf16 weights (slow on CPU)")
    p.add_argument("--device", default="cpu", help="where to build/load the model (e.g. cuda)")
    p.add_argument("--json", action="store_true", help="print only the JSON summary")
    p.set_defaults(func=_inspect)

    p = sub.add_parser("export", help="merge a LoRA adapter into its base model and write a standalone checkpoint")
    p.add_argument("--model", required=True, help="base model the adapter was trained on (bf16 or NVFP4)")
    p.add_argument("--lora", required=True, help="adapter folder (peft format, from training)")
    p.add_argument("--out", required=True, help="output folder (written atomically; never the model or adapter folder)")
    p.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--merge", action="store_true",
                      help="merged dense bf16 weights (the default: what export writes without --requantize)")
    kind.add_argument("--requantize", action="store_true", help="re-quantize the merged weights to NVFP4A16")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=_export)


def _quantize(args) -> int:
    from qerl_lib.models.loader import quantize_checkpoint

    out = quantize_checkpoint(args.model, args.out, scheme=args.scheme, backend=args.backend, device=args.device,
                              force=args.force)
    print(f"wrote {args.scheme} checkpoint ({args.backend}) to {out}")
    return 0


def module_format_summary(model) -> list[dict]:
    """Modules with their own tensors, grouped over layer indices: kind, format, count, shapes, bytes."""
    from qerl_lib.models.nvfp4_linear import NVFP4Linear

    rows: dict[tuple, dict] = {}
    seen: set = set()  # storages already counted: a tied lm_head shows as "tied", 0 bytes
    for name, module in model.named_modules():
        own = [t for t in list(module._parameters.values()) + list(module._buffers.values()) if t is not None]
        if not own or any(part.startswith("lora_") for part in name.split(".")):
            continue
        pattern = re.sub(r"\.\d+\.", ".*.", name)
        if isinstance(module, NVFP4Linear):
            fmt, shape = "nvfp4", [module.out_features, module.in_features]
        else:
            weight = module._parameters.get("weight")
            fmt = str((weight if weight is not None else own[0]).dtype).replace("torch.", "")
            shape = list((weight if weight is not None else own[0]).shape)
        fresh = [t for t in own if (t.untyped_storage().data_ptr(), t.device) not in seen]
        seen.update((t.untyped_storage().data_ptr(), t.device) for t in own)
        if not fresh:
            fmt += " (tied)"
        row = rows.setdefault((pattern, fmt), {"module": pattern, "type": type(module).__name__, "format": fmt,
                                               "count": 0, "shape": shape, "bytes": 0})
        row["count"] += 1
        row["bytes"] += sum(t.numel() * t.element_size() for t in fresh)
    return list(rows.values())


def _inspect(args) -> int:
    from qerl_lib.errors import UserError
    from qerl_lib.models.loader import build_random_model, linear_weight_bytes, load_model

    if (args.model is None) == (args.config is None):
        raise UserError("pass either a MODEL (folder or hub id) or --config NAME (e.g. --config qwen2.5-7b)")
    if args.config is not None:
        model = build_random_model(args.config, nvfp4=True, init=args.init, device=args.device)
        source = f"random NVFP4 model from config {args.config} (init={args.init})"
    else:
        model = load_model(args.model, device=args.device)
        source = str(args.model)
    summary = linear_weight_bytes(model)
    if str(args.device).startswith("cuda"):
        import torch

        summary["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()  # whole model + build temporaries
    rows = module_format_summary(model)
    if not args.json:
        print(f"{source}")
        print(f"{'module':<44} {'type':<18} {'format':<16} {'count':>5} {'shape':>14} {'MiB':>10}")
        for r in rows:
            shape = "x".join(map(str, r["shape"]))
            print(f"{r['module'][:44]:<44} {r['type'][:18]:<18} {r['format']:<16} {r['count']:>5} {shape:>14} "
                  f"{r['bytes'] / 2**20:>10.2f}")
        mib = 2**20
        if summary["nvfp4_layers"]:
            print(f"NVFP4 linear weights: {summary['nvfp4_bytes'] / mib:.1f} MiB resident (codes + scales) vs "
                  f"{summary['nvfp4_bf16_bytes'] / mib:.1f} MiB in bf16: ratio {summary['nvfp4_ratio']:.4f} "
                  f"({summary['nvfp4_layers']} layers)")
        print(f"all linear weights (incl. {summary['dense_layers']} dense, e.g. lm_head): "
              f"{summary['total_bytes'] / mib:.1f} MiB vs {summary['total_bf16_bytes'] / mib:.1f} MiB bf16: "
              f"ratio {summary['total_ratio']:.4f}")
    print(json.dumps({"source": source, **summary}))
    return 0


def _export(args) -> int:
    from qerl_lib.models.lora import export_model

    out = export_model(args.model, args.lora, args.out, requantize=args.requantize, device=args.device,
                       force=args.force)
    kind = "NVFP4A16 (re-quantized)" if args.requantize else "bf16 (merged)"
    print(f"wrote {kind} checkpoint to {out}")
    return 0
