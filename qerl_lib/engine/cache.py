"""The rollout engine's KV cache and its CUDA-graph decode runner.

KV cache
--------
One preallocated tensor for keys and one for values, ``[layers, batch, kv_heads, length, head_dim]``
in the model dtype, zero-filled (a masked column is multiplied by probability 0, and 0 * NaN would
still be NaN, so the cache never holds garbage from ``torch.empty``). Prompts are left-padded to a
common length ``P``: columns ``[0, P)`` hold the prompt, and decode step ``t`` writes column
``P + t`` for every row at once, so "where to write" is one number for the whole batch. The
cache is sized for the call (``P + max_new_tokens`` rounded up to a length bucket) and kept for
the next call when it is large enough.

CUDA graphs
-----------
At batch 8 a decode step of a 7B model launches ~700 kernels; the GPU finishes many of them
faster than Python can launch them. A CUDA graph records one step's launches once and replays
them with a single call. A graph fixes its tensors' addresses and shapes, so:

* inputs live in static buffers per batch bucket: ``tokens [b]``, ``column [1]``, ``pad [b]``;
  the loop copies new values in before each replay (no host synchronisation);
* a batch is rounded up to a bucket (1, 2, 4, 8, 16, 32, 48, 64, ...); the extra rows decode
  junk that is never read;
* attention reads only the first ``kv_len`` cache columns, ``kv_len`` rounded up to a multiple of
  ``length_bucket`` (256 by default): one graph per (batch bucket, length bucket), so a short
  sequence does not pay for reading the whole cache. Columns past the current one are masked.

Capture happens lazily, the first time a (batch, length) pair is needed, with the real inputs:
the warm-up run on a side stream computes exactly the step about to be replayed (it writes the
same K/V into the same column), so capturing mid-generation is safe. All graphs share one
memory pool, so a graph's output is valid only until the next replay; the engine consumes the
logits immediately.
"""

from __future__ import annotations

import math
from typing import Callable

import torch

from qerl_lib.engine.remap import Remappable, RemappableBuffer, map_or_raise

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256)


def batch_bucket(batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int:
    """Smallest bucket holding ``batch`` rows (multiples of the largest bucket beyond it)."""
    for b in buckets:
        if b >= batch:
            return b
    top = buckets[-1]
    return top * math.ceil(batch / top)


def length_bucket(columns: int, step: int, limit: int) -> int:
    """``columns`` rounded up to a multiple of ``step``, but never past ``limit`` (the cache length)."""
    return min(step * math.ceil(columns / step), limit)


class KVCache(Remappable):
    """Keys and values of every layer: ``k, v [layers, batch, kv_heads, length, head_dim]``.

    ``remappable``: both live in one `engine.remap.RemappableBuffer`, whose memory `unmap` gives back to the
    driver and `map` takes again at the same addresses (zero-filled), so graphs captured over the cache stay
    valid across the trainer's step; otherwise they come from PyTorch's allocator and are freed by dropping
    the cache."""

    def __init__(self, layers: int, batch: int, kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device, remappable: bool = False):
        shape = (layers, batch, kv_heads, length, head_dim)
        self._buffer = None
        if remappable:
            size = math.prod(shape) * dtype.itemsize
            no_room = (f"no room for the rollout's {2 * size / 2**30:.1f} GiB KV cache: lower rollout_batch "
                       "(rows decoding at once) or the completion length")
            self._buffer = RemappableBuffer(2 * size, device, no_room)
            raw = self._buffer.view()
            self.k, self.v = (raw[i * size:(i + 1) * size].view(dtype).view(shape) for i in (0, 1))
            self.k.zero_()
            self.v.zero_()
        else:
            self.k = torch.zeros(shape, dtype=dtype, device=device)
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        if self.k.is_cuda:
            # for decode_backend="compile": a tensor the step mutates in place may stay in
            # torch.compile's CUDA graphs only if its address is declared fixed (gpt-fast keeps its
            # cache as module buffers for the same reason)
            torch._dynamo.mark_static_address(self.k)
            torch._dynamo.mark_static_address(self.v)

    @property
    def batch(self) -> int:
        return self.k.shape[1]

    @property
    def length(self) -> int:
        return self.k.shape[3]

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    def fits(self, batch: int, length: int) -> bool:
        return self.batch >= batch and self.length >= length

    def map(self) -> None:
        """Memory behind a remappable cache's addresses again, zero-filled as a new cache is (a plain cache, or
        one mapped already: nothing to do)."""
        if self._buffer is None:
            return
        if map_or_raise(self._buffer):
            self.k.zero_()
            self.v.zero_()

    def close(self) -> None:
        """Free a remappable cache's memory and addresses now (a plain cache is freed when dropped)."""
        if self._buffer is not None:
            self._buffer.close()


StepFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class DecodeGraphs:
    """CUDA graphs of one decode step, keyed by (batch bucket, kv length). ``step(tokens, column,
    pad, kv_len) -> logits`` must be pure tensor work on static buffers (the engine's KV cache,
    norm weights and LoRA buffers)."""

    def __init__(self, step: StepFn, device: torch.device):
        self.step = step
        self.device = device
        # Off CUDA nothing is captured: the same buffers, buckets and masks run eagerly, which lets
        # the CPU tests check this path's bookkeeping (spare rows, length buckets) against plain eager.
        self.capture = device.type == "cuda"
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def static_inputs(self, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [batch], column [1], pad [batch]) buffers that every graph of this batch reads."""
        if batch not in self.inputs:
            self.inputs[batch] = (torch.zeros(batch, dtype=torch.long, device=self.device),
                                  torch.zeros(1, dtype=torch.long, device=self.device),
                                  torch.zeros(batch, dtype=torch.long, device=self.device))
        return self.inputs[batch]

    def run(self, batch: int, kv_len: int) -> torch.Tensor:
        """Replay (capturing first if needed) the step for this batch bucket and length bucket."""
        if not self.capture:
            return self.step(*self.static_inputs(batch), kv_len)
        key = (batch, kv_len)
        if key not in self.graphs:
            self.graphs[key] = self._capture(batch, kv_len)
        graph, logits = self.graphs[key]
        graph.replay()
        return logits

    def _capture(self, batch: int, kv_len: int):
        tokens, column, pad = self.static_inputs(batch)
        side = torch.cuda.Stream(device=self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up: lazy init, cuBLAS workspaces, Triton autotuning
            self.step(tokens, column, pad, kv_len)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # Captured on `side`, a stream of this device: PyTorch's default capture stream is made once per process,
        # on whichever device was current then, and a capture there would launch on the wrong GPU.
        with torch.cuda.graph(graph, pool=self.pool, stream=side):
            logits = self.step(tokens, column, pad, kv_len)
        return graph, logits

    def clear(self) -> None:
        self.graphs.clear()
        self.inputs.clear()
