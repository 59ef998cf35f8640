"""`qerl prepare-model` and `qerl env`."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("prepare-model", help="convert the embedded SmolLM2-135M-Instruct GGUF into a cached HF folder")
    p.add_argument("--gguf", default=None, help="a GGUF file to convert instead of the embedded one")
    p.add_argument("--out", default=None, help="output folder (default: $QERL_CACHE/models/SmolLM2-135M-Instruct-bf16)")
    p.add_argument("--force", action="store_true", help="rebuild even if the folder is already complete")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("env", help="print versions and device as JSON (what every results file records)")
    p.set_defaults(func=_env)


def _prepare_model(args) -> int:
    from qerl_lib.models.embedded import prepare_embedded_model

    print(prepare_embedded_model(gguf=args.gguf, out=args.out, force=args.force, quiet=False))
    return 0


def _env(args) -> int:
    from qerl_lib.io import provenance

    print(json.dumps(provenance(), indent=2))
    return 0
