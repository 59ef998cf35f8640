"""`qerl prepare-model` and `qerl env`."""

from __future__ import annotations

import json


def register(sub) -> None:
    p = sub.add_parser("prepare-model", help="convert the embedded SmolLM2-135M-Instruct GGUF into a cached HF folder")
    p.add_argument("--gguf", default=None, help="a GGUF file to convert instead of the embedded one")
    p.add_argument("--out", default=None, help="output folder (default: $QERL_CACHE/models/SmolLM2-135M-Instruct-bf16)")
    p.add_argument("--force", action="store_true",
                   help="rebuild even if the folder is already complete, or replace a non-empty folder that is not one")
    p.set_defaults(func=_prepare_model)

    p = sub.add_parser("env", help="print versions and device as JSON (what every results file records)")
    p.set_defaults(func=_env)


def _prepare_model(args) -> int:
    """A complete folder (its marker written last) is kept as is without --force; any other existing
    non-empty --out is refused unless --force, and never replaced when it is, holds or lies in the GGUF."""
    from pathlib import Path

    from qerl_lib.errors import UserError
    from qerl_lib.io import prepare_output_folder
    from qerl_lib.models.embedded import SOURCE_MARKER, embedded_model_dir, find_embedded_gguf, prepare_embedded_model

    gguf = Path(args.gguf).expanduser() if args.gguf else find_embedded_gguf()
    if not gguf.is_file():
        raise UserError(f"--gguf {gguf} is not a file: pass the path of a .gguf model file")
    target = Path(args.out).expanduser() if args.out else embedded_model_dir()
    if args.force or not (target / SOURCE_MARKER).is_file():
        prepare_output_folder(target, [gguf], force=args.force)
    print(prepare_embedded_model(gguf=gguf if args.gguf else None, out=target, force=args.force, quiet=False))
    return 0


def _env(args) -> int:
    from qerl_lib.io import provenance

    print(json.dumps(provenance(), indent=2))
    return 0
