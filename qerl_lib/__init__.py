"""qerl_lib: a thin, readable library for QeRL (NVFP4 + LoRA reinforcement learning for LLMs).

Layers, each using only those below it:

    nvfp4 (format)  ->  fp4_kernel  ->  layers (NVFP4Linear)  ->  loader / lora  ->  engine
    ->  grpo, evaluation, bench  ->  cli

`aqn`, `data`, `rewards` and `plots` stand alone on the ground floor; `io`, `envinfo` and
`paths` are small utilities every floor may use.

The top-level names below are imported lazily, so `import qerl_lib` stays fast and a
missing optional dependency only matters when you use the piece that needs it.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    # format
    "quantize": "qerl_lib.nvfp4", "dequantize": "qerl_lib.nvfp4", "NVFP4Weight": "qerl_lib.nvfp4",
    "fake_quantize_": "qerl_lib.formats",
    # kernel and layers
    "fp4_matmul": "qerl_lib.fp4_kernel", "fp4_linear": "qerl_lib.fp4_kernel",
    "prepare_fp4_weights": "qerl_lib.fp4_kernel", "NVFP4Linear": "qerl_lib.layers",
    # models
    "load_model": "qerl_lib.loader", "replace_linear_with_nvfp4": "qerl_lib.loader",
    "quantize_checkpoint": "qerl_lib.loader", "save_nvfp4_checkpoint": "qerl_lib.loader",
    "build_random_model": "qerl_lib.loader", "linear_weight_bytes": "qerl_lib.loader",
    "attach_lora": "qerl_lib.lora", "merge_to_bf16": "qerl_lib.lora",
    "prepare_embedded_model": "qerl_lib.embedded", "resolve_model": "qerl_lib.embedded",
    # rollouts and noise
    "generate": "qerl_lib.engine", "RolloutEngine": "qerl_lib.engine", "Completion": "qerl_lib.engine",
    "AQNConfig": "qerl_lib.aqn", "AQNController": "qerl_lib.aqn", "apply_norm_overrides": "qerl_lib.aqn",
    # scoring and evaluation
    "score_answer": "qerl_lib.rewards", "extract_answer": "qerl_lib.rewards", "SafeReward": "qerl_lib.rewards",
    "evaluate": "qerl_lib.evaluation", "EvalConfig": "qerl_lib.evaluation",
    # training
    "train": "qerl_lib.grpo", "make_config": "qerl_lib.grpo_presets",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qerl_lib' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
