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
    "load_model": "qerl_lib.loader",
    "fp4_matmul": "qerl_lib.fp4_kernel",
    "generate": "qerl_lib.engine",
    "prepare_embedded_model": "qerl_lib.embedded",
    "resolve_model": "qerl_lib.embedded",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'qerl_lib' has no attribute {name!r}")


__all__ = sorted(_LAZY) + ["__version__"]
