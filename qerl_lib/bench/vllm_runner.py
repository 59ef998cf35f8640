"""vLLM's side of `qerl bench rollout --engines kit,vllm`, run as its own process.

    python -P vllm_runner.py SPEC.json ROWS.json

It runs under vLLM's own packages (``--vllm-pythonpath``: vLLM pins its own compressed-tensors,
which must not meet the kit's), so it imports only the standard library and vLLM, never
``qerl_lib``. ``SPEC.json`` (written by ``bench/vllm_peer.py``): the checkpoint folder the kit
wrote (and ``quantization`` where its format needs naming), the prompts as token ids, batches, LoRA ranks with
their adapter folders, lengths, repeats.
One ``LLM`` serves every (batch, rank) of the checkpoint (engine start with compilation and CUDA
graphs takes minutes, so it is paid once); each pair gets one untimed warm-up call, then
``repeats`` timed ``generate`` calls at temperature 1 with ``ignore_eos``: the first
``rollout_prompts`` prompts (default: the batch's), each completion to its own length from
``lengths`` (the kit's workload: all ``gen_len`` when fixed, uneven for "gsm8k-like"). vLLM's
scheduler keeps at most ``max_num_seqs`` = the largest batch running and admits queued prompts
as others finish. ``tok_s`` = generated tokens / the median call's wall time, the same definition
as the kit's rows (prefill included).
A failure becomes the error of the rows it hits, so the kit's rows survive any vLLM problem.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback


def _error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"[:300]


def run(spec: dict) -> dict:
    """Every (batch, rank) row of ``spec`` on one vLLM engine."""
    pairs = [(b, r) for b in spec["batches"] for r in spec["ranks"]]
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        max_rank = max([r for r in spec["ranks"] if r] or [0])
        lora_kw = dict(enable_lora=True, max_lora_rank=max_rank, max_loras=1) if max_rank else {}
        quant_kw = {"quantization": spec["quantization"]} if spec.get("quantization") else {}  # bitsandbytes: NF4
        llm = LLM(model=spec["model_dir"], dtype="bfloat16", max_model_len=spec["prompt_len"] + spec["gen_len"],
                  max_num_seqs=max(spec["batches"]), gpu_memory_utilization=spec["gpu_memory_utilization"],
                  skip_tokenizer_init=True, seed=spec["seed"], **lora_kw, **quant_kw)
    except Exception as exc:  # noqa: BLE001 -- no engine: every row carries why
        traceback.print_exc()
        return {"vllm": None, "rows": [{"batch": b, "rank": r, "error": _error(exc)} for b, r in pairs]}
    rows = []
    for batch, rank in pairs:
        n = spec.get("rollout_prompts") or batch
        prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"][:n]]
        lengths = spec.get("lengths") or [spec["gen_len"]] * n
        lora = LoRARequest(f"rank{rank}", rank, spec["adapters"][str(rank)]) if rank else None
        try:
            warm = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
            llm.generate(prompts[:batch], warm, lora_request=lora, use_tqdm=False)
            params = [SamplingParams(temperature=1.0, max_tokens=length, ignore_eos=True) for length in lengths[:n]]
            times, tokens = [], 0
            for _ in range(spec["repeats"]):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
                times.append(time.perf_counter() - start)
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            rows.append({"batch": batch, "rank": rank, "tok_s": tokens / statistics.median(times), "tokens": tokens,
                         "repeats_s": [round(t, 4) for t in times], "error": None})
        except Exception as exc:  # noqa: BLE001 -- this row failed; the next may not
            traceback.print_exc()
            rows.append({"batch": batch, "rank": rank, "error": _error(exc)})
    return {"vllm": getattr(vllm, "__version__", None), "rows": rows}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -P vllm_runner.py SPEC.json ROWS.json", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        result = run(json.load(f))
    tmp = argv[1] + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
