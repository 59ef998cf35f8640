"""`qerl data arith` (generated problems) and `qerl data gsm8k` (hub or local file) -> jsonl."""

from __future__ import annotations


def register(sub) -> None:
    data = sub.add_parser("data", help="make or fetch problem sets in GSM8K schema")
    dsub = data.add_subparsers(dest="data_command", metavar="SOURCE")
    dsub.required = True

    p = dsub.add_parser("arith", help="seeded GSM8K-style arithmetic word problems (train/test never overlap)")
    p.add_argument("--split", choices=("train", "test"), default="train")
    p.add_argument("--n", type=int, default=1000, help="number of problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--level", type=int, choices=(1, 2, 3, 4), default=None,
                   help="number of operations (default: mixed 1-4)")
    p.add_argument("--out", required=True, help="output .jsonl")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=_arith)

    p = dsub.add_parser("gsm8k", help="GSM8K from the hub (online) or a local jsonl, re-written as jsonl")
    p.add_argument("--split", choices=("train", "test"), default="test")
    p.add_argument("--path", default=None, help="local GSM8K-schema jsonl (needed offline)")
    p.add_argument("--n", type=int, default=None, help="the first N problems (default: all)")
    p.add_argument("--out", required=True)
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=_gsm8k)


def _check_n(n: int | None) -> None:
    from qerl_lib.errors import UserError

    if n is not None and n < 1:  # a negative slice would silently drop the last rows; 0 writes an empty set
        raise UserError(f"--n must be >= 1 (the number of problems), got {n}")


def _arith(args) -> int:
    from qerl_lib.io import prepare_output_file
    from qerl_lib.tasks.problems import generate_arith, write_problems

    _check_n(args.n)
    prepare_output_file(args.out, force=args.force)
    records = generate_arith(args.split, args.n, args.seed, args.level)
    print(f"wrote {len(records)} {args.split} problems to {write_problems(records, args.out)}")
    return 0


def _gsm8k(args) -> int:
    from qerl_lib.errors import UserError
    from qerl_lib.io import prepare_output_file
    from qerl_lib.tasks.problems import load_gsm8k, write_problems

    _check_n(args.n)
    prepare_output_file(args.out, [args.path], force=args.force)
    records = load_gsm8k(args.split, args.path)[: args.n]
    if not records:
        raise UserError(f"{args.path or 'the hub split'} holds no GSM8K problems: pass a non-empty GSM8K-schema jsonl")
    print(f"wrote {len(records)} GSM8K {args.split} problems to {write_problems(records, args.out)}")
    return 0
