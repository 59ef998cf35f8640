"""vLLM as a peer in `qerl bench rollout --engines kit,vllm`: same checkpoint, same prompts, same GPU, same run.

For each model and weights the kit times, `prepare_peer` writes, before the kit's engine touches the model, what
vLLM needs to serve the very same model: the checkpoint (bf16 ``save_pretrained``; NVFP4A16 in compressed-tensors
format through ``models.checkpoint.save_nvfp4_checkpoint``, which vLLM runs on its Marlin FP4 kernels; or QLoRA's
NF4 base as a bitsandbytes pre-quantized checkpoint through ``models.nf4.save_nf4_checkpoint``, the kit's own NF4
codes, which vLLM serves through its bitsandbytes path, as the paper's QLoRA rollouts ran) and, per LoRA rank, a
peft adapter folder with the adapters the kit's rows use (``bench.rollout.random_lora``, same seed). After the kit's
rows, the caller frees the model and `run_peer` starts ``bench/vllm_runner.py`` in a separate process under vLLM's
packages; its results become one row per (batch, rank) with ``"engine": "vllm"``.

Like for like, and where it is not: the prompts are the kit's token ids, every completion runs to
its length of the kit's workload (``ignore_eos``; all ``gen_len`` when fixed), temperature 1, and
``tok_s`` counts generated tokens over the wall time of the whole call, prefill included, as the
kit's rows do. vLLM pages its KV cache and always schedules continuously: with ``--prompts`` above
the batch it keeps ``batch`` sequences running and admits queued prompts as others end, which is
what the kit's ``continuous`` rows do (its engine's concurrency cap is fixed at start, so such a
comparison takes one batch size). Its engine start (compilation, graph capture) is outside the
timing, as the kit's warm-up is. Peak memory is not comparable (vLLM
reserves ``gpu_memory_utilization`` of the GPU up front) and is left empty. vLLM's NF4 rows need
bitsandbytes on ``--vllm-pythonpath`` as well.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from qerl_lib.errors import UserError

ENGINES = ("kit", "vllm")
PEER_WEIGHTS = ("bf16", "nvfp4", "nf4")
VLLM_QUANTIZATION = {"nf4": "bitsandbytes"}  # LLM(quantization=...) where the checkpoint's format needs naming
RUNNER = Path(__file__).with_name("vllm_runner.py")
PEER_ENV = {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def write_checkpoint(model, weights: str, folder: str | Path) -> Path:
    """The model as a checkpoint vLLM loads: bf16 safetensors, compressed-tensors NVFP4A16, or bitsandbytes NF4."""
    folder = Path(folder)
    if weights == "nvfp4":
        from qerl_lib.models.checkpoint import save_nvfp4_checkpoint

        return save_nvfp4_checkpoint(model, folder, force=True)
    if weights == "nf4":
        from qerl_lib.models.nf4 import save_nf4_checkpoint

        return save_nf4_checkpoint(model, folder, force=True)
    if weights == "bf16":
        model.save_pretrained(folder, safe_serialization=True)
        return folder
    raise UserError(f"vLLM peer rows take weights {', '.join(PEER_WEIGHTS)}, not {weights!r}")


def write_adapter(adapters: dict, folder: str | Path, base_dir: str | Path) -> Path:
    """``adapters`` (module path -> ``LoraAdapter``, as ``bench.rollout.random_lora`` returns) as a peft LoRA
    folder: ``adapter_config.json`` and ``adapter_model.safetensors`` with peft's key names."""
    from safetensors.torch import save_file

    if not adapters:
        raise ValueError("write_adapter: no adapters")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    ranks = {a.A.shape[0] for a in adapters.values()}
    scales = {float(a.scale) for a in adapters.values()}
    if len(ranks) != 1 or len(scales) != 1:
        raise ValueError(f"write_adapter: one rank and one scale expected, got ranks {ranks}, scales {scales}")
    rank, scale = ranks.pop(), scales.pop()
    tensors = {}
    for path, a in adapters.items():
        tensors[f"base_model.model.{path}.lora_A.weight"] = a.A.detach().to("cpu", torch.bfloat16).contiguous()
        tensors[f"base_model.model.{path}.lora_B.weight"] = a.B.detach().to("cpu", torch.bfloat16).contiguous()
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": scale * rank,
              "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_rslora": False,
              "target_modules": sorted({p.rsplit(".", 1)[-1] for p in adapters}),
              "base_model_name_or_path": str(base_dir), "inference_mode": True}
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def run_runner(spec: dict, pythonpath: str | None, timeout_s: float = 3600, python: str = sys.executable) -> dict:
    """``bench/vllm_runner.py`` on ``spec`` in a fresh process with ``PYTHONPATH=pythonpath``; its result
    document, or one with every row's error when the process itself fails."""

    def failed(message: str) -> dict:
        return {"vllm": None, "rows": [{"batch": b, "rank": r, "error": message[:300]}
                                       for b in spec["batches"] for r in spec["ranks"]]}

    with tempfile.TemporaryDirectory(prefix="qerl-vllm-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "rows.json"
        spec_path.write_text(json.dumps(spec))
        env = {**os.environ, **PEER_ENV}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        try:  # -P: the runner's own folder stays off sys.path (its siblings are the kit's modules)
            proc = subprocess.run([python, "-P", str(RUNNER), str(spec_path), str(out_path)], env=env,
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return failed(f"vLLM timed out after {timeout_s:.0f} s")
        except OSError as exc:  # the interpreter itself could not start
            return failed(f"vLLM process failed: {exc}")
        if proc.returncode != 0 or not out_path.is_file():
            lines = [ln for ln in (proc.stderr or "").strip().splitlines() if ln.strip()]
            return failed(f"vLLM process failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
        return json.loads(out_path.read_text())


def prepare_peer(model, name: str, weights: str, cfg, log=print) -> dict:
    """Write what vLLM needs for ``model`` (``name``/``weights``) into a new temporary folder: the checkpoint,
    one adapter per LoRA rank of ``cfg`` (`RolloutBenchConfig`; the kit's own adapters, same seed), and the
    runner's spec (the kit's prompts). Call it before the kit's engine touches the model (the engine fuses
    projections in place), and `run_peer` after the caller has freed the model, so vLLM gets the GPU."""
    from qerl_lib.bench.rollout import random_lora, random_prompts
    from qerl_lib.bench.workloads import sample_lengths

    peer = {"name": name, "weights": weights, "folder": None, "spec": None}
    if weights not in PEER_WEIGHTS:
        return peer
    folder = Path(tempfile.mkdtemp(prefix="qerl-vllm-ckpt-", dir=cfg.vllm_workdir))
    peer["folder"] = str(folder)
    log(f"{name} {weights}: writing the checkpoint for vLLM into {folder} ...")
    model_dir = write_checkpoint(model, weights, folder / "model")
    n = cfg.prompts or max(cfg.batches)  # the kit's prompts and lengths for n rows begin with those for fewer
    adapters = {str(r): str(write_adapter(random_lora(model, r, cfg.seed), folder / f"lora_r{r}", model_dir))
                for r in cfg.lora_ranks if r}
    peer["spec"] = {"model_dir": str(model_dir), "adapters": adapters, "batches": list(cfg.batches),
                    "ranks": list(cfg.lora_ranks), "prompt_len": cfg.prompt_len, "gen_len": cfg.gen_len,
                    "prompts": random_prompts(n, cfg.prompt_len, model.config.vocab_size, cfg.seed),
                    "lengths": sample_lengths(cfg.workload, n, cfg.gen_len, cfg.seed), "rollout_prompts": cfg.prompts,
                    "repeats": cfg.repeats, "seed": cfg.seed,
                    "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
                    "quantization": VLLM_QUANTIZATION.get(weights)}
    return peer


def peer_row(cfg, name: str, weights: str, batch: int, rank: int, backend: str = "vllm", **kw):
    """The `Row` vLLM's measurement of ``batch`` and ``rank`` fills (``cfg``: `RolloutBenchConfig`); ``backend``
    names vLLM's version once it ran."""
    from qerl_lib.bench.rollout import Row

    queued = (cfg.prompts or batch) > batch  # vLLM refills finished rows from the queue, as the kit's "continuous"
    return Row(name, weights, batch, rank, backend, "vllm", cfg.prompt_len, cfg.gen_len, workload=cfg.workload,
               prompts=cfg.prompts, scheduling="continuous" if queued else "static", **kw)


def run_peer(peer: dict, cfg, log=print) -> list:
    """vLLM's `Row`s (``"engine": "vllm"``) for a `prepare_peer` result, one per batch and rank of ``cfg``;
    the temporary folder is removed afterwards."""
    import shutil

    name, weights = peer["name"], peer["weights"]

    def row(b, r, backend="vllm", **kw):
        return peer_row(cfg, name, weights, b, r, backend, **kw)

    if peer["spec"] is None:
        return [row(b, r, error=f"not run: vLLM peer rows take {', '.join(PEER_WEIGHTS)}")
                for b in cfg.batches for r in cfg.lora_ranks]
    try:
        log(f"{name} {weights}: vLLM (its engine start takes minutes) ...")
        result = run_runner(peer["spec"], cfg.vllm_pythonpath)
    finally:
        shutil.rmtree(peer["folder"], ignore_errors=True)
    rows = []
    for r in result["rows"]:
        rows.append(row(r["batch"], r["rank"], backend=f"vllm {result.get('vllm')}", tok_s=r.get("tok_s"),
                        repeats_s=r.get("repeats_s") or [],
                        error=r.get("error"), useful_tokens=r.get("tokens")))
        log(f"{name} {weights} vllm {result.get('vllm')} batch {r['batch']} rank {r['rank']}: "
            + (f"{r['tok_s']:.0f} tok/s" if r.get("tok_s") else f"error: {r.get('error')}"))
    return rows
