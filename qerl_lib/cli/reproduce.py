"""`qerl reproduce`: execute every notebook headlessly, in order (the main job, `make reproduce`).

Prints each notebook's wall time and the total at the end (also after a failure); no notebook
to run is an error.
"""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("reproduce", help="execute notebooks/NN_*.ipynb in order with papermill")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default="artifacts", help="folder for executed notebooks (default artifacts/)")
    p.add_argument("--only", nargs="*", default=None, help="run only these notebooks (prefixes like 00 01)")
    p.add_argument("--notebooks", default=None, help="folder holding the NN_*.ipynb notebooks (default the kit's notebooks/)")
    p.set_defaults(func=_reproduce)


def _reproduce(args) -> int:
    from qerl_lib.cli.notebook_runner import NOTEBOOKS_DIR, reproduce

    notebooks = Path(args.notebooks) if args.notebooks else NOTEBOOKS_DIR
    reproduce(device=args.device, out_dir=Path(args.out), only=args.only, notebooks_dir=notebooks)
    return 0
