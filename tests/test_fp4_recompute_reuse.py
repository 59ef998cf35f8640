"""A checkpointed recompute hands its expanded NVFP4 weight to the layer's backward (`nvfp4_linear`'s
``RecomputeStash``): two expansions per weight and step instead of three, the same values.

* CPU, Triton interpreter (one subprocess): two kernel-path layers at 200 rows (the dequantize + cuBLAS
  launch), under non-reentrant and reentrant checkpointing and without it, and with a first layer whose input
  needs no gradient (its recompute must keep nothing: no backward would take it). Counted: the expansions
  (``fp4_gemm.dequantize_exact`` calls). Compared: outputs and input gradients, bit for bit, against the
  same model with ``QERL_FP4_RECOMPUTE_REUSE=0``. Every stash is empty after the backward.
* CUDA (skipped without a GPU): the same on one Qwen2.5-7B MLP shape at 2304 rows.
"""
from __future__ import annotations

import textwrap

import pytest
import torch

from tests.conftest import run_triton_interpreter

SCRIPT = textwrap.dedent("""
    import json, os, sys
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint
    from qerl_lib.kernels import fp4_gemm
    from qerl_lib.models.nvfp4_linear import NVFP4Linear, RECOMPUTE_REUSE_ENV

    device = sys.argv[1] if len(sys.argv) > 2 else "cpu"
    rows, k, n = json.loads(sys.argv[1]) if device == "cpu" else (2304, 3584, 18944)
    if device == "cpu":  # as on a GPU: the layers' "auto" calls take the Triton path (here, the interpreter)
        resolve = fp4_gemm._resolve_impl
        fp4_gemm._resolve_impl = lambda impl, x: "triton" if impl == "auto" else resolve(impl, x)
    calls = []
    expand = fp4_gemm.dequantize_exact
    fp4_gemm.dequantize_exact = lambda *a, **kw: calls.append(1) or expand(*a, **kw)
    torch.manual_seed(0)
    layers = [NVFP4Linear.from_linear(nn.Linear(a, b, bias=False).to(torch.bfloat16), impl="kernel", name=f"l{i}")
              .to(device) for i, (a, b) in enumerate(((k, n), (n, k)))]
    x0 = torch.randn(rows, k, dtype=torch.bfloat16, device=device)
    block = lambda x: layers[1](torch.relu(layers[0](x)))

    def run(mode, reuse):
        os.environ[RECOMPUTE_REUSE_ENV] = "1" if reuse else "0"
        x = x0.clone().requires_grad_(True)
        calls.clear()
        if mode == "frozen-input":  # the first layer's input needs no gradient, the second's does (through p)
            p = torch.ones((), dtype=x0.dtype, device=device, requires_grad=True)
            y = checkpoint(lambda x, p: layers[1](torch.relu(layers[0](x)) * p), x0, p, use_reentrant=False)
        else:
            y = block(x) if mode == "plain" else checkpoint(block, x, use_reentrant=mode == "reentrant")
        forward = len(calls)
        y.float().square().sum().backward()
        return {"forward": forward, "total": len(calls), "y": y.detach(), "grad": x.grad,
                "stashes_empty": all(layer._recompute_stash.held is None for layer in layers),
                "x_grad": x.grad is not None}

    out = {"takes_dense": fp4_gemm.takes_dense(rows, layers[0].prepare_kernel(), x0)}
    base = run("plain", False)
    for mode in ("plain", "non-reentrant", "reentrant", "frozen-input"):
        for reuse in (False, True):
            r = run(mode, reuse)
            out[f"{mode}-{reuse}"] = {"forward": r["forward"], "total": r["total"], "stashes_empty": r["stashes_empty"],
                                      "y_equal": bool(torch.equal(r["y"], base["y"])),
                                      "grad_equal": not r["x_grad"] or bool(torch.equal(r["grad"], base["grad"]))}
    print("RESULTS " + json.dumps(out))
""")


def check(results):
    assert results["takes_dense"], "the rows chosen must take the dequantize + cuBLAS launch"
    # forward; total off / on. frozen-input: the first layer has no backward (its input needs no gradient), so its
    # recompute keeps nothing; the second hands its expansion over: 2 + 2 + 1 -> 2 + 2 + 0
    want = {"plain": (2, 4, 4), "non-reentrant": (2, 6, 4), "reentrant": (2, 6, 4), "frozen-input": (2, 5, 4)}
    for mode, (forward, off, on) in want.items():
        for reuse, total in ((False, off), (True, on)):
            case = results[f"{mode}-{reuse}"]
            assert case["stashes_empty"] and case["y_equal"] and case["grad_equal"], (mode, reuse, case)
            assert (case["forward"], case["total"]) == (forward, total), (mode, reuse, case)


def test_recompute_hands_its_expanded_weight_to_the_backward_in_the_interpreter():
    check(run_triton_interpreter(SCRIPT, [200, 64, 48]))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (CUDA not available)")
def test_cuda_recompute_hands_its_expanded_weight_to_the_backward():
    import json
    import os
    import subprocess
    import sys

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "cuda", "gpu"], cwd=repo, capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", "")),
                          timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")), None)
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    check(json.loads(line[len("RESULTS "):]))


def test_a_stash_gives_its_weight_once_and_only_for_its_own_weight():
    from qerl_lib.models.nvfp4_linear import RecomputeStash

    stash, mine, other, w = RecomputeStash(), object(), object(), torch.zeros(2)
    stash.held = (mine, w)
    assert stash.take(other) is None and stash.held is None  # a stale entry is dropped, not used
    stash.held = (mine, w)
    assert stash.take(mine) is w and stash.take(mine) is None
