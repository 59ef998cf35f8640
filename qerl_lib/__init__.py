"""qerl_lib: a thin, readable library for QeRL (NVFP4 + LoRA reinforcement learning for LLMs).

Floors, each importing only those below it (each subpackage's docstring says what it may import):

    errors, io, paths, progress (utilities)  ->  quant, tasks, plots (ground floor)  ->  kernels  ->  models
    ->  engine  ->  train, evals, bench  ->  studies  ->  cli

The top-level names below are imported lazily, so `import qerl_lib` stays fast and a
missing optional dependency only matters when you use the piece that needs it.
"""

from __future__ import annotations

import importlib
import logging

__version__ = "0.1.0"

# bitsandbytes, on a CPU with AVX512-BF16, tries at import to fetch a CPU NF4 kernel from the hub and logs a
# warning when it cannot (offline, or without the `kernels` package). The kit turns that path off on every NF4
# layer (`models.nf4.keep_nf4_layout`), so the kernel would never run: only that one logger is quieted.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

# public name -> module that defines it
_LAZY = {
    # format
    "quantize": "qerl_lib.quant.nvfp4", "dequantize": "qerl_lib.quant.nvfp4", "NVFP4Weight": "qerl_lib.quant.nvfp4",
    "fake_quantize_": "qerl_lib.quant.formats",
    # kernel and layers
    "fp4_matmul": "qerl_lib.kernels.fp4_gemm", "fp4_linear": "qerl_lib.kernels.fp4_gemm",
    "fp4_grad_input": "qerl_lib.kernels.fp4_gemm",
    "prepare_fp4_weights": "qerl_lib.kernels.fp4_gemm", "NVFP4Linear": "qerl_lib.models.nvfp4_linear",
    # models
    "load_model": "qerl_lib.models.loader", "replace_linear_with_nvfp4": "qerl_lib.models.loader",
    "quantize_checkpoint": "qerl_lib.models.loader", "save_nvfp4_checkpoint": "qerl_lib.models.loader",
    "build_random_model": "qerl_lib.models.loader", "linear_weight_bytes": "qerl_lib.models.loader",
    "attach_lora": "qerl_lib.models.lora", "merge_to_bf16": "qerl_lib.models.lora",
    "prepare_embedded_model": "qerl_lib.models.embedded", "resolve_model": "qerl_lib.models.embedded",
    # rollouts and noise
    "generate": "qerl_lib.engine.rollout", "RolloutEngine": "qerl_lib.engine.rollout", "Completion": "qerl_lib.engine.rollout",
    "AQNConfig": "qerl_lib.train.aqn", "AQNController": "qerl_lib.train.aqn", "apply_norm_overrides": "qerl_lib.train.aqn",
    # scoring and evaluation
    "score_answer": "qerl_lib.tasks.rewards", "score_answers": "qerl_lib.tasks.rewards", "extract_answer": "qerl_lib.tasks.rewards", "SafeReward": "qerl_lib.tasks.rewards",
    "evaluate": "qerl_lib.evals.evaluation", "EvalConfig": "qerl_lib.evals.evaluation",
    # training
    "train": "qerl_lib.train.grpo", "make_config": "qerl_lib.train.presets",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qerl_lib' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
