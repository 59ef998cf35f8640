"""A/B switches for the NVFP4 GEMM launches' programmatic dependent launch (dev/LOG.md section 40).

    PRODUCER_PDL=0 python3 dev/sweeps/producer_pdl_ab.py bench rollout ...   # the producer GEMM launched plainly
    OTHER_PDL=0 python3 dev/sweeps/producer_pdl_ab.py bench rollout ...      # fp4_wgmma and its permute
    python3 dev/sweeps/producer_pdl_ab.py bench rollout ...                  # as the library does (both 1)

Runs the ``qerl`` CLI with the rest of the arguments. A switch at 0 makes those launches see PDL as off, as
before section 40 (run 1: the producer kernel; runs 2-3: the others); every other kernel keeps ``QERL_PDL``.
(Run 2 also switched the split-K sum's PDL, ``splitk.reduce_splits``; it measured slower and was removed.)
A measurement switch only: the library's own switch is ``QERL_PDL``, which covers every decode kernel.
"""
from __future__ import annotations

import os
import sys
import types

from qerl_lib.cli import main
from qerl_lib.kernels import fp4_wgmma, fp4_wgmma_producer

OFF = types.SimpleNamespace(use_for=lambda device, requested=None: False)  # pdl.use_for's signature
if os.environ.get("PRODUCER_PDL", "1") == "0":
    fp4_wgmma_producer.pdl_switch = OFF
    print("producer_pdl_ab: the producer kernel launches without PDL", file=sys.stderr)
if os.environ.get("OTHER_PDL", "1") == "0":
    fp4_wgmma.pdl_switch = OFF
    print("producer_pdl_ab: fp4_wgmma and its permute launch without PDL", file=sys.stderr)

raise SystemExit(main(sys.argv[1:]))
