"""A/B switches for the batch-8 LoRA adapters in one launch per group (dev/LOG.md section 40, end).

    ONE_LAUNCH_ROWS=8 ONE_LAUNCH_WARPS=2 python3 dev/sweeps/lora_one_launch_ab.py bench rollout ...

Runs the ``qerl`` CLI with the rest of the arguments, with ``kernels/lora.ONE_LAUNCH_UP_TO_ROWS`` and
``ONE_LAUNCH_WARPS`` set from the environment (unset: the library's values). A measurement switch only.
The one-launch path was removed from the library after dev/LOG.md section 41 measured it slower; this script
and ``lora_one_launch_gpu*.sh`` ran at commits 6ef0a72 (run 1) and 937838a (run 2).
"""
from __future__ import annotations

import os
import sys

from qerl_lib.cli import main
from qerl_lib.kernels import lora

for env, name in (("ONE_LAUNCH_ROWS", "ONE_LAUNCH_UP_TO_ROWS"), ("ONE_LAUNCH_WARPS", "ONE_LAUNCH_WARPS")):
    if env in os.environ:
        setattr(lora, name, int(os.environ[env]))
        print(f"lora_one_launch_ab: {name} = {getattr(lora, name)}", file=sys.stderr)

raise SystemExit(main(sys.argv[1:]))
