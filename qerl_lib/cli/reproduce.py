"""`qerl reproduce`: execute every notebook headlessly, in order (the main job, `make reproduce`)."""

from __future__ import annotations

from pathlib import Path


def register(sub) -> None:
    p = sub.add_parser("reproduce", help="execute notebooks/NN_*.ipynb in order with papermill")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--out", default="artifacts", help="folder for executed notebooks (default artifacts/)")
    p.add_argument("--only", nargs="*", default=None, help="run only these notebooks (prefixes like 00 01)")
    p.set_defaults(func=_reproduce)


def _reproduce(args) -> int:
    import time

    from qerl_lib.cli.notebook_runner import reproduce

    start = time.perf_counter()
    runs = reproduce(device=args.device, out_dir=Path(args.out), only=args.only)
    print(f"\n{'notebook':40s} {'seconds':>8s}")
    for r in runs:
        print(f"{r.notebook:40s} {r.seconds:8.1f}")
    print(f"{'total':40s} {time.perf_counter() - start:8.1f}")
    return 0
