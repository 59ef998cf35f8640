"""The engine's remappable KV cache (`engine/remap.py`): memory given back between rollouts, graphs kept.

CPU: the driver structures' layouts against cuda.h, the engine's choice of path off CUDA, and the decode graphs'
capture stream (on their own device). CUDA: a buffer's
memory really returns to the driver and comes back at the same address, zero-filled in a cache; an engine with the
remappable cache, released between calls, samples exactly what an engine without it samples, without capturing
its graphs again; a cache that must grow is rebuilt; and on a second GPU (two visible), the same, on that GPU's memory.
"""

from __future__ import annotations

import contextlib
import ctypes
from pathlib import Path

import pytest
import torch

from qerl_lib.engine import cache as engine_cache
from qerl_lib.engine import remap
from qerl_lib.engine.rollout import RolloutEngine

from test_engine import PROMPTS, tiny_cuda_model, tiny_model


def test_driver_structures_have_cuda_h_layouts():
    # CUmemLocation {int type; int id}, CUmemAccessDesc {CUmemLocation; int flags}, CUmemAllocationProp
    # {int type; int handle types; CUmemLocation; void *win32 metadata; 8 bytes of allocFlags}
    assert ctypes.sizeof(remap._Location) == 8
    assert ctypes.sizeof(remap._AccessDesc) == 12
    assert ctypes.sizeof(remap._AllocationProp) == 32
    assert remap._AllocationProp.win32HandleMetaData.offset == 16
    assert remap._AllocationProp.allocFlags.offset == 24


def test_decode_graphs_capture_on_a_stream_of_their_own_device(monkeypatch):
    """PyTorch's default capture stream lives on whichever GPU was current at a process's first capture; a capture
    there launches on that GPU (dev/LOG.md section 111). The capture must use the warm-up stream, made on the
    graphs' device. Checked off CUDA with torch.cuda's stream and graph calls recorded."""
    made, captured = [], []

    class Stream:
        def __init__(self, device=None):
            self.device = device
            made.append(self)

        def wait_stream(self, other):
            pass

    class Graph:
        def __init__(self, graph, pool=None, stream=None):
            captured.append(stream)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream(device))
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: object())
    monkeypatch.setattr(torch.cuda, "graph", Graph)
    device = torch.device("cpu")  # stands in for cuda:1: the steps are plain tensor work
    graphs = engine_cache.DecodeGraphs(lambda tokens, column, pad, kv_len: tokens.float(), device)
    graphs.capture = True
    graphs._capture(2, 16)
    side = made[0]  # the first stream made: the warm-up's
    assert side.device == device and captured == [side]


def test_off_cuda_the_engine_keeps_its_plain_cache():
    assert not remap.supported(torch.device("cpu"))
    model = tiny_model("qwen2")
    engine = RolloutEngine(model, decode_backend="graphs", length_step=8, remap_cache=True)
    assert engine.remap_cache is False  # asked for, but there is no CUDA here
    engine.generate(PROMPTS[:2], 6, temperature=0, stop_token_ids=[])
    assert not engine.cache.remappable and engine.resident_cache_bytes == engine.cache.nbytes > 0
    engine.release()
    assert engine.cache is None and engine.resident_cache_bytes == 0


def test_a_driver_that_refuses_virtual_memory_leaves_the_plain_cache_and_copies(monkeypatch):
    """Where the driver has the API but refuses it (some sandboxes), the engine warns once and runs as without
    ``remap_cache``: a plain cache and plain merged copies, the same samples."""
    from qerl_lib.engine import merged as engine_merged
    from tests.test_engine_merged import adapters_for

    def refuse(*args, **kwargs):
        raise remap.DriverError("cuMemCreate", 801, "CUDA_ERROR_NOT_SUPPORTED")

    model = tiny_model("qwen2")
    ads = adapters_for(model)
    expected = RolloutEngine(model, decode_backend="graphs", length_step=8, lora_merge=True).generate(
        PROMPTS, 12, temperature=0, stop_token_ids=[], lora=ads)
    monkeypatch.setattr(engine_cache, "RemappableBuffer", refuse)
    monkeypatch.setattr(engine_merged, "RemappableBuffer", refuse)
    engine = RolloutEngine(model, decode_backend="graphs", length_step=8, lora_merge=True)
    engine.remap_cache = True  # as on a GPU whose driver claims the API (there is none on this CPU)
    with pytest.warns(UserWarning, match="remap_cache off: cuMemCreate failed: CUDA_ERROR_NOT_SUPPORTED"):
        out = engine.generate(PROMPTS, 12, temperature=0, stop_token_ids=[], lora=ads)
    assert engine.remap_cache is False and not engine.cache.remappable and engine._forward.merged.layout
    assert not engine._forward.merged.remappable
    assert [(c.token_ids, c.logprobs) for c in out] == [(c.token_ids, c.logprobs) for c in expected]
    engine.release()
    assert engine.cache is None and engine._forward.merged is None


def test_remap_needs_a_graph_backend():
    with pytest.raises(ValueError, match="needs decode_backend 'graphs' or 'graphs\\+fused'"):
        RolloutEngine(tiny_model("qwen2"), decode_backend="eager", remap_cache=True)


class _FakeBuffer:
    """A buffer whose ``map`` fails with the driver's out-of-memory code ``failures`` times, then maps."""

    def __init__(self, failures: int, code: int = 2, no_room: str = "unused"):
        self.mapped, self.failures, self.code, self.calls, self.no_room = False, failures, code, 0, no_room

    def map(self):
        self.calls += 1
        if self.failures:
            self.failures -= 1
            raise remap.DriverError("cuMemCreate", self.code, "CUDA_ERROR_X")
        self.mapped = True


@pytest.mark.parametrize("failures, outcome", [(0, "mapped"), (1, "mapped after emptying"), (2, "no room"),
                                               (-1, "other error")])
def test_mapping_returns_torchs_cached_blocks_once_then_fails_in_one_line(monkeypatch, failures, outcome):
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    buffer = _FakeBuffer(1, code=1) if failures < 0 else _FakeBuffer(
        failures, no_room="no room for the KV cache: lower rollout_batch")
    if outcome == "no room":
        with pytest.raises(torch.OutOfMemoryError, match="lower rollout_batch"):
            remap.map_or_raise(buffer)
        assert buffer.calls == 2 and emptied == [True]
    elif outcome == "other error":  # not out of memory: no retry, the driver's error itself
        with pytest.raises(remap.DriverError, match="CUDA_ERROR_X"):
            remap.map_or_raise(buffer)
        assert buffer.calls == 1 and not emptied
    else:
        assert remap.map_or_raise(buffer) is True and buffer.mapped
        assert emptied == ([True] if failures else []) and buffer.calls == failures + 1
        assert remap.map_or_raise(buffer) is False  # mapped already: nothing to do


def test_step_peak_counts_the_rollout_phase_with_the_remapped_memory(monkeypatch):
    """PyTorch's peak misses the remappable cache: a step's peak is the higher of PyTorch's step peak and the
    rollout phase's (PyTorch's then + the mapped bytes), and each step starts from zero."""
    from types import SimpleNamespace

    from qerl_lib.train import metrics

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 5e9)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    assert metrics._peak_memory(7e9) == (7.0, "cuda_max_allocated_in_step")  # the rollout phase was higher
    assert metrics._peak_memory(3e9)[0] == 5.0 and metrics._peak_memory()[0] == 5.0
    rollout = SimpleNamespace(rollout_peak_bytes=7e9, aqn=None)
    callback = metrics.RunMetrics(Path("unused"), None, [], rollout, quiet=True)
    callback.on_step_begin(None, None, None)
    assert rollout.rollout_peak_bytes == 0


def test_rollout_bench_peak_adds_the_most_the_engine_had_mapped(monkeypatch):
    from qerl_lib.bench import rollout as bench

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # _free: no empty_cache
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: 3 * 2**30)
    monkeypatch.setitem(remap._MAPPED, "now", 0)
    monkeypatch.setitem(remap._MAPPED, "peak", 5 * 2**30)  # from an earlier configuration: reset at the start

    def configuration(row):
        remap._MAPPED["now"] = 2 * 2**30  # the engine maps 2 GiB of cache, then releases it
        remap._MAPPED["peak"] = max(remap._MAPPED["peak"], remap._MAPPED["now"])
        remap._MAPPED["now"] = 0
        return row

    row = bench.Row(model="qwen2.5-7b", weights="nvfp4", batch=8, rank=0, backend="auto", engine="qerl", prompt_len=8,
                    gen_len=8)
    assert bench._measure(configuration, row, log=lambda *a: None).peak_gib == 5.0


@pytest.mark.cuda
def test_a_buffer_returns_its_memory_and_comes_back_at_the_same_address():
    device = torch.device("cuda")
    assert remap.supported(device), "CUDA virtual memory management should be available on this GPU"
    size, slack = 1 << 30, 8 << 20
    buffer = remap.RemappableBuffer(size, device)
    view = buffer.view()
    address = view.data_ptr()
    view.fill_(7)
    torch.cuda.synchronize()
    free_mapped = torch.cuda.mem_get_info()[0]  # (after the fill: its first launch loads kernels, which take memory)
    counted = remap.mapped_bytes()
    assert counted >= buffer.nbytes >= size and remap.peak_mapped_bytes() >= counted
    buffer.unmap()
    assert remap.mapped_bytes() == counted - buffer.nbytes
    free_unmapped = torch.cuda.mem_get_info()[0]
    assert free_unmapped >= free_mapped + size - slack, "unmap did not give the buffer's memory back"
    buffer.map()
    assert torch.cuda.mem_get_info()[0] <= free_unmapped - size + slack
    assert buffer.view().data_ptr() == address
    view.fill_(3)  # the old view is valid again once mapped
    assert int(buffer.view()[:: 1 << 20].sum()) == 3 * (size >> 20)
    torch.cuda.synchronize()
    free_remapped = torch.cuda.mem_get_info()[0]
    buffer.close()
    assert torch.cuda.mem_get_info()[0] >= free_remapped + size - slack


@pytest.mark.cuda
def test_a_remapped_cache_is_zero_filled():
    cache = engine_cache.KVCache(2, 4, 2, 64, 16, torch.bfloat16, torch.device("cuda"), remappable=True)
    cache.k.fill_(1.0)
    cache.v.fill_(float("nan"))
    address = cache.k.data_ptr()
    cache.unmap()
    assert not cache.resident
    cache.map()
    assert cache.resident and cache.k.data_ptr() == address
    assert int(torch.count_nonzero(cache.k)) == 0 and int(torch.count_nonzero(cache.v)) == 0
    cache.close()


@pytest.mark.cuda
@pytest.mark.parametrize("weights", ["bf16", "nvfp4"])
def test_released_engine_samples_as_before_without_capturing_again(weights, monkeypatch):
    model = tiny_cuda_model(weights)
    captures = []
    original = engine_cache.DecodeGraphs._capture
    monkeypatch.setattr(engine_cache.DecodeGraphs, "_capture",
                        lambda self, batch, kv_len: captures.append(kv_len) or original(self, batch, kv_len))
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=[11, 12, 13, 14])
    results = {}
    for remapped in (True, False):
        engine = RolloutEngine(model, length_step=16, remap_cache=remapped)  # several length buckets a call
        assert engine.remap_cache is remapped
        first = engine.generate(PROMPTS, 40, **kw)
        n_first = len(captures)
        engine.release()
        assert engine.resident_cache_bytes == 0
        second = engine.generate(PROMPTS, 40, **kw)
        results[remapped] = (first, second, len(captures) - n_first, n_first)
        captures.clear()
        engine.release()
    for remapped, (first, second, again, n_first) in results.items():
        assert n_first > 1
        assert [c.token_ids for c in second] == [c.token_ids for c in first], remapped
        assert [c.logprobs for c in second] == [c.logprobs for c in first], remapped
        assert again == (0 if remapped else n_first), (remapped, again, n_first)
    assert [c.token_ids for c in results[True][0]] == [c.token_ids for c in results[False][0]]


@pytest.mark.cuda
def test_a_remappable_cache_that_must_grow_is_rebuilt():
    model = tiny_cuda_model("bf16")
    engine = RolloutEngine(model, length_step=16, remap_cache=True)
    short = engine.generate(PROMPTS[:2], 8, temperature=0, stop_token_ids=[])
    engine.release()
    small = engine.cache
    longer = engine.generate(PROMPTS, 60, temperature=0, stop_token_ids=[])
    assert engine.cache is not small and engine.cache.remappable and engine.cache.resident
    again = RolloutEngine(model, length_step=16, remap_cache=False)
    assert [c.token_ids for c in longer] == [c.token_ids for c in again.generate(PROMPTS, 60, temperature=0,
                                                                                 stop_token_ids=[])]
    assert [c.token_ids for c in short] == [c.token_ids for c in again.generate(PROMPTS[:2], 8, temperature=0,
                                                                                stop_token_ids=[])]


@pytest.mark.cuda
def test_released_merged_copies_come_back_rewritten_without_capturing_again(monkeypatch):
    """lora_merge's weight copies are given back with the cache and rewritten at the next call: the same samples
    as an engine whose copies are freed and rebuilt, and no capture after the first call."""
    from tests.test_lora_kernels import _tiny_cuda_with_adapters

    model, ads = _tiny_cuda_with_adapters("bf16")
    captures = []
    original = engine_cache.DecodeGraphs._capture
    monkeypatch.setattr(engine_cache.DecodeGraphs, "_capture",
                        lambda self, batch, kv_len: captures.append(kv_len) or original(self, batch, kv_len))
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=[21, 22, 23, 24], lora=ads)
    results = {}
    for remapped in (True, False):
        engine = RolloutEngine(model, length_step=16, lora_merge=True, remap_cache=remapped)
        first = engine.generate(PROMPTS, 40, **kw)
        n_first = len(captures)
        free = torch.cuda.mem_get_info()[0]
        engine.release()
        merged = engine._forward.merged
        if remapped:
            assert merged.remappable and not merged.resident and merged.layout
            assert torch.cuda.mem_get_info()[0] >= free + merged.nbytes  # the copies' memory went back
        else:
            assert merged is None
        second = engine.generate(PROMPTS, 40, **kw)
        results[remapped] = (first, second, len(captures) - n_first, n_first)
        captures.clear()
    for remapped, (first, second, again, n_first) in results.items():
        assert [(c.token_ids, c.logprobs) for c in second] == [(c.token_ids, c.logprobs) for c in first], remapped
        assert n_first > 1 and again == (0 if remapped else n_first), (remapped, again, n_first)
    assert [c.token_ids for c in results[True][1]] == [c.token_ids for c in results[False][1]]


@pytest.mark.cuda
def test_lora_merge_over_nvfp4_holds_no_copies_and_keeps_its_graphs(monkeypatch):
    """An NVFP4 base merges nothing (merging would re-quantize the frozen policy): with lora_merge on, release()
    still unmaps only the cache and keeps the graphs, so the next call captures nothing and samples the same."""
    from tests.test_lora_kernels import _tiny_cuda_with_adapters

    model, ads = _tiny_cuda_with_adapters("nvfp4")
    captures = []
    original = engine_cache.DecodeGraphs._capture
    monkeypatch.setattr(engine_cache.DecodeGraphs, "_capture",
                        lambda self, batch, kv_len: captures.append(kv_len) or original(self, batch, kv_len))
    engine = RolloutEngine(model, length_step=16, lora_merge=True, remap_cache=True)
    kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=[31, 32, 33, 34], lora=ads)
    first = engine.generate(PROMPTS, 40, **kw)
    n_first = len(captures)
    merged = engine._forward.merged
    assert merged is None or not merged.layout, "an NVFP4 base should hold no merged copies"
    engine.release()
    assert engine.resident_cache_bytes == 0 and engine.graphs is not None
    second = engine.generate(PROMPTS, 40, **kw)
    assert n_first > 1 and len(captures) == n_first, (n_first, len(captures))
    assert [(c.token_ids, c.logprobs) for c in second] == [(c.token_ids, c.logprobs) for c in first]
    engine.release()


@pytest.mark.cuda
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two visible GPUs (one process on a multi-GPU machine)")
def test_a_second_gpu_gets_its_own_remappable_memory_and_keeps_its_graphs(monkeypatch):
    """Under data parallel each process runs its engine on cuda:LOCAL_RANK: a buffer made for cuda:1 (even while
    cuda:0 is current) takes and returns cuda:1's memory, and an engine there keeps its graphs across a release.
    The engine captures on a stream of its own device: on PyTorch's default capture stream, made on cuda:0 by the
    first capture, its Triton launches failed with "Pointer argument cannot be accessed" (dev/LOG.md section 111)."""
    second = torch.device("cuda", 1)
    size, slack = 1 << 29, 8 << 20
    torch.cuda.set_device(0)
    first_graph, counter = torch.cuda.CUDAGraph(), torch.zeros(1, device="cuda:0")
    with torch.cuda.graph(first_graph):  # the process's first capture is on cuda:0, as with any earlier CUDA test:
        counter.add_(1)                  # PyTorch keeps that default capture stream for the whole process
    buffer = remap.RemappableBuffer(size, second)
    view = buffer.view()
    assert view.device == second
    view.fill_(5)
    torch.cuda.synchronize(second)
    free_mapped = torch.cuda.mem_get_info(second)[0]
    buffer.unmap()
    assert torch.cuda.mem_get_info(second)[0] >= free_mapped + size - slack, "cuda:1's memory did not come back"
    buffer.map()
    view.fill_(2)
    assert int(buffer.view()[:: 1 << 20].sum()) == 2 * (size >> 20)
    buffer.close()

    captures = []
    original = engine_cache.DecodeGraphs._capture
    monkeypatch.setattr(engine_cache.DecodeGraphs, "_capture",
                        lambda self, batch, kv_len: captures.append(kv_len) or original(self, batch, kv_len))
    with torch.cuda.device(second):  # as `resolve_device` leaves a data-parallel process
        model = tiny_cuda_model("nvfp4").to(second)
        kw = dict(temperature=1.0, stop_token_ids=[], row_seeds=[41, 42, 43, 44])
        engine = RolloutEngine(model, length_step=16, remap_cache=True)
        first = engine.generate(PROMPTS, 40, **kw)
        n_first = len(captures)
        engine.release()
        second_call = engine.generate(PROMPTS, 40, **kw)
        plain = RolloutEngine(model, length_step=16, remap_cache=False).generate(PROMPTS, 40, **kw)
        engine.release()
    assert engine.cache.k.device == second and n_first > 1
    assert len(captures) - n_first == n_first  # only the plain engine captured again
    assert [(c.token_ids, c.logprobs) for c in second_call] == [(c.token_ids, c.logprobs) for c in first]
    assert [c.token_ids for c in plain] == [c.token_ids for c in first]
