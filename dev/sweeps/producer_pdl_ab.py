"""A/B switch for the producer-warp FP4 GEMM's programmatic dependent launch (dev/LOG.md section 40).

    PRODUCER_PDL=0 python3 dev/sweeps/producer_pdl_ab.py bench rollout ...   # the GEMM launched plainly
    PRODUCER_PDL=1 python3 dev/sweeps/producer_pdl_ab.py bench rollout ...   # as the library does (default)

Runs the ``qerl`` CLI with the rest of the arguments. With ``PRODUCER_PDL=0`` the producer kernel's launches
(``fp4_wgmma_producer.linear``) see PDL as off, as before section 40; every other kernel keeps ``QERL_PDL``.
A measurement switch only: the library's own switch is ``QERL_PDL``, which covers every decode kernel.
"""
from __future__ import annotations

import os
import sys
import types

from qerl_lib.cli import main
from qerl_lib.kernels import fp4_wgmma_producer

if os.environ.get("PRODUCER_PDL", "1") == "0":
    fp4_wgmma_producer.pdl_switch = types.SimpleNamespace(use_for=lambda device: False)
    print("producer_pdl_ab: the producer kernel launches without PDL", file=sys.stderr)

raise SystemExit(main(sys.argv[1:]))
