"""Programmatic dependent launch (PDL): one switch for the kernels of the decode step that use it.

A kernel launched with PDL may start while the kernel before it in the stream is still running,
as soon as every CTA of that kernel has executed ``griddepcontrol.launch_dependents``. It must
then execute ``griddepcontrol.wait`` (Triton: ``gdc_wait``) before it reads anything the previous
kernel writes, and before it writes anything: the wait returns when the previous kernel has
finished and its writes are visible. The kit's decode kernels (``kernels/mma.py``, the Gluon GEMMs
``kernels/fp4_wgmma.py`` and ``kernels/fp4_wgmma_producer.py`` and the permute of x, ``engine/glue.py``,
``engine/attention.py``) read only constants (weights, scales) before their wait and trigger their
successor right after it, so a launch overlaps at most one kernel and the stream order of every read
and write is kept (the LoRA shrink's one exception is argued in ``kernels/lora.py``). What it saves is
the gap between dependent kernels (launch latency, the prologue and first weight loads of a matmul)
and lets the LoRA shrink run beside its GEMM: on an H100 the Gluon GEMMs' PDL alone was worth 7.7% of
the 7B decode step at batch 32 with LoRA r16 (dev/LOG.md section 40). The split-K sum
(``kernels/splitk.py``) stays a plain launch: under PDL it measured slower.

Hopper (sm_90) and later; on by default there, off elsewhere. The environment variable
``QERL_PDL=0`` turns it off (every kernel then launches plainly; the wait and trigger instructions
are no-ops). It is read at each launch decision, so it applies to kernels launched (or CUDA graphs
captured) after it is set.
"""

from __future__ import annotations

import functools
import os

import torch

PDL_ENV = "QERL_PDL"


def enabled() -> bool:
    """Whether ``QERL_PDL`` (read now; default 1) allows programmatic dependent launch."""
    value = os.environ.get(PDL_ENV, "1")
    if value not in ("0", "1"):
        raise ValueError(f"{PDL_ENV} must be 0 or 1, got {value!r}")
    return value == "1"


def use_for(device: torch.device, requested: bool | None = None) -> bool:
    """Whether kernels on ``device`` launch with PDL now: enabled, CUDA, compute capability >= 9. ``requested``
    (a launch's own ``pdl`` argument): None takes that answer, False turns PDL off, True keeps the answer."""
    if requested is not None and not requested:
        return False
    return device.type == "cuda" and enabled() and _capability_major(device.index) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index: int | None) -> int:
    return torch.cuda.get_device_capability(index if index is not None else torch.cuda.current_device())[0]
