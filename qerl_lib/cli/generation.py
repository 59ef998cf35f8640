"""`qerl generate` (chat completions through the rollout engine) and `qerl eval` (see eval_command.py)."""

from __future__ import annotations

import json
import sys
from pathlib import Path


def register(sub) -> None:
    from qerl_lib.cli.eval_command import register_eval

    _register_generate(sub)
    register_eval(sub)


def _register_generate(sub) -> None:
    p = sub.add_parser("generate", help="sample chat completions with the kit's rollout engine")
    p.add_argument("--model", default="smollm2",
                   help="model folder (bf16 or NVFP4 checkpoint), hub id, or 'smollm2' (embedded; the default)")
    p.add_argument("--lora", default=None, help="LoRA adapter folder (peft format) applied unmerged")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message")
    src.add_argument("--prompts",
                     help="file of user messages: one per line, or .jsonl with a 'prompt' or 'question' field")
    p.add_argument("--n", type=int, default=1, help="completions per prompt")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    p.add_argument("--dtype", choices=("auto", "bf16", "fp32"), default="auto",
                   help="activation/weight dtype (auto: bf16 on CUDA, fp32 on CPU where bf16 matmuls are slow)")
    p.add_argument("--json", action="store_true", help="print one JSON object per completion instead of text")
    p.set_defaults(func=_generate)


def read_prompts(path: str) -> list[str]:
    """User messages from a text file (one per line) or a .jsonl file ('prompt' or 'question' field)."""
    from qerl_lib.errors import UserError

    file = Path(path)
    if not file.is_file():
        raise UserError(f"--prompts {path}: no such file")
    raw = file.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark some editors write
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise UserError(f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x}): re-save the file as UTF-8") from None
    lines = [line for line in text.splitlines() if line.strip()]
    if file.suffix != ".jsonl":
        return lines
    prompts = []
    for i, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}:{i}: not valid JSON ({e.msg}); use one JSON object per line") from None
        text = record.get("prompt", record.get("question")) if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise UserError(f"{path}:{i}: needs a string 'prompt' or 'question' field")
        prompts.append(text)
    return prompts


def _generate(args) -> int:
    import torch
    from transformers import AutoTokenizer

    from qerl_lib.cli.devices import resolve_cli_device
    from qerl_lib.engine.rollout import generate
    from qerl_lib.engine.sampling import SamplingParams
    from qerl_lib.errors import UserError
    from qerl_lib.models.loader import load_model, resolve_model_dir

    if args.n < 1 or args.max_new_tokens < 1:
        raise UserError("--n and --max-new-tokens must be >= 1")
    messages = [args.prompt] if args.prompt is not None else read_prompts(args.prompts)
    if not messages:
        raise UserError(f"{args.prompts} holds no prompts: write one user message per line (or a .jsonl with "
                        "'prompt' fields)")
    try:
        SamplingParams(args.temperature, args.top_p, args.top_k)  # checked before the model loads
    except ValueError as e:
        raise UserError(f"{e} (--temperature / --top-p / --top-k)") from None
    if args.lora:
        from qerl_lib.models.lora import check_adapter_dir

        check_adapter_dir(args.lora)
    device = resolve_cli_device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}.get(
        args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)

    folder = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    model = load_model(folder, device=device, dtype=dtype)
    if args.lora:
        from qerl_lib.models.lora import load_adapters

        model = load_adapters(model, args.lora, is_trainable=False)  # the engine runs it unmerged

    if tokenizer.chat_template:
        prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": m}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=True)["input_ids"] for m in messages]
    else:
        print("note: the tokenizer has no chat template; prompts are used as plain text", file=sys.stderr)
        prompt_ids = [tokenizer(m)["input_ids"] for m in messages]
    batch = [ids for ids in prompt_ids for _ in range(args.n)]
    try:
        completions = generate(model, batch, args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
                               top_k=args.top_k, seed=args.seed)
    except ValueError as e:  # prompt too long, bad sampling parameters: the message names the fix
        raise UserError(str(e)) from None

    for k, c in enumerate(completions):
        i, j = divmod(k, args.n)
        text = tokenizer.decode(c.token_ids, skip_special_tokens=True)
        if args.json:
            print(json.dumps({"prompt_index": i, "sample": j, "prompt": messages[i], "completion": text,
                              "finish_reason": c.finish_reason, "num_tokens": len(c.token_ids),
                              "logprob_sum": sum(c.logprobs), "token_ids": c.token_ids}))
        else:
            print(f"=== prompt {i}, sample {j} ({c.finish_reason}, {len(c.token_ids)} tokens) ===")
            print(text.strip())
    return 0
