"""Programmatic dependent launch (PDL): one switch for the kernels of the decode step that use it.

A kernel launched with PDL may start while the kernel before it in the stream is still running,
as soon as every CTA of that kernel has executed ``griddepcontrol.launch_dependents``. It must
then execute ``griddepcontrol.wait`` (Triton: ``gdc_wait``) before it reads anything the previous
kernel writes, and before it writes anything: the wait returns when the previous kernel has
finished and its writes are visible. The kit's decode kernels (``fp4_kernel_mma``, ``engine_glue``,
``engine_attention``) read only constants (weights, scales) before their wait and trigger their
successor right after it, so a launch overlaps at most one kernel and the stream order of every
read and write is kept. What it saves is the gap between dependent kernels (launch latency, the
prologue and first weight loads of a matmul), a few microseconds out of ~300 kernels per step.

Hopper (sm_90) and later; on by default there, off elsewhere. ``QERL_PDL=0`` or ``set_enabled(False)``
turns it off (every kernel then launches plainly; the wait and trigger instructions are no-ops).
"""

from __future__ import annotations

import functools
import os

import torch


def _from_env() -> bool:
    value = os.environ.get("QERL_PDL", "1")
    if value not in ("0", "1"):
        raise ValueError(f"QERL_PDL must be 0 or 1, got {value!r}")
    return value == "1"


_enabled = _from_env()


def set_enabled(enabled: bool) -> bool:
    """Turn PDL on or off for kernels launched from now on; returns the previous setting.
    (CUDA graphs captured earlier keep the launches they recorded.)"""
    global _enabled
    previous, _enabled = _enabled, bool(enabled)
    return previous


def is_enabled() -> bool:
    return _enabled


def use_for(device: torch.device) -> bool:
    """Whether kernels on ``device`` launch with PDL now: enabled, CUDA, compute capability >= 9."""
    return _enabled and device.type == "cuda" and _capability_major(device.index) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())[0]
