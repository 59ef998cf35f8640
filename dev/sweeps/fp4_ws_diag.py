"""Section 34 (dev/LOG.md): which part of ``fp4_wgmma_ws`` stops with an illegal instruction. Each variant
runs one forward and one backward launch in its own process (an illegal instruction ends the CUDA context) and
saves its cubins; variants are source edits of the module, written beside them and imported from there.

    PYTHONPATH=$PWD python dev/sweeps/fp4_ws_diag.py            # all variants (files in $DIAG_DIR, /tmp/ws_diag)
    PYTHONPATH=$PWD python dev/sweeps/fp4_ws_diag.py VARIANT    # one, in this process
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

OUT = os.environ.get("DIAG_DIR", "/tmp/ws_diag")  # variant sources and cubins; the caller tars it
os.makedirs(OUT, exist_ok=True)
EDITS = {
    "full": [],
    # the scale bytes still arrive by TMA, but the decode warps use a constant 1.0 (E4M3 0x38) instead of reading them
    "no_scale_read": [("            sb = _step_scales(s_smem.index(s), i, WPR)\n",
                       "            sb = gl.full([ROWS, WPR // 2], 56, gl.uint8, _SCALES_LAYOUT)\n")],
    # no scale TMA at all (and a constant scale)
    "no_scale_tma": [("            sb = _step_scales(s_smem.index(s), i, WPR)\n",
                      "            sb = gl.full([ROWS, WPR // 2], 56, gl.uint8, _SCALES_LAYOUT)\n"),
                     (" + s_desc.block_type.nbytes, pred=ok)", ", pred=ok)"),
                     (" " * 12 + "_tma_load(s_desc, [step * _BK, off_n // 16], bar, s_smem.index(slot), pred=ok)\n", ""),
                     (" " * 12 + "_tma_load(s_desc, [off_n, (step * (_BK // 16)) // _SB * _SB], bar, "
                      "s_smem.index(slot), pred=ok)\n", "")],
}


def variant_module(name: str):
    from qerl_lib.kernels import fp4_wgmma_ws as ws
    src = open(ws.__file__).read()
    for old, new in EDITS[name]:
        assert src.count(old) == 1, (name, old)
        src = src.replace(old, new)
    path = os.path.join(OUT, f"ws_{name}.py")
    open(path, "w").write(src)
    spec = importlib.util.spec_from_file_location(f"ws_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_one(name: str) -> None:
    import torch

    from qerl_lib.kernels.fp4_gemm import prepare_fp4_weights
    from qerl_lib.quant.nvfp4 import quantize, reference_grad_input, reference_matmul
    mod = variant_module(name)
    m, n, k = 200, 512, 512
    g = torch.Generator(device="cuda").manual_seed(0)
    q = quantize((torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16))
    w = prepare_fp4_weights(q.weight_packed, q.weight_scale, q.weight_global_scale)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", generator=g).to(torch.bfloat16)
    for direction, a, cols, ref in (("fwd", x, n, reference_matmul(x, q)), ("bwd", dy, k, reference_grad_input(dy, q))):
        out = torch.full((m, cols), float("nan"), dtype=torch.bfloat16, device="cuda")
        mod.launch(a, w.words, w.scales, w.global_scale, None, out, direction)
        for i, kern in enumerate(mod._fp4_ws_kernel.device_caches[0][0].values()):  # saved before the sync
            open(os.path.join(OUT, f"ws_{name}_{direction}_{i}.cubin"), "wb").write(kern.asm["cubin"])
        torch.cuda.synchronize()
        err = float((out.float() - ref.float()).abs().mean() / ref.float().abs().mean())
        print(f"{name} {direction}: ran, mean rel err {err:.2e}, nan {int(out.isnan().sum())}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_one(sys.argv[1])
    else:
        for name in EDITS:
            r = subprocess.run([sys.executable, __file__, name], capture_output=True, text=True, timeout=120)
            tail = (r.stdout + r.stderr).strip().splitlines()
            print(f"== {name}: rc {r.returncode}", *[t for t in tail if "ran," in t or "Error" in t][:4], sep="\n  ",
                  flush=True)
