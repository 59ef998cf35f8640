"""`qerl results`: the README's GPU results table and the paper's speed and memory claims, from results/*.json.

Prints both tables; ``--readme README.md`` also writes them between the README's ``<!-- headline:start -->`` /
``<!-- headline:end -->`` and ``<!-- speed_claims:start -->`` / ``<!-- speed_claims:end -->`` markers
(`studies.headline`, `studies.speed_claims`), and ``--index results/README.md`` writes results/README.md's file
table (file | what | device | command) between its ``<!-- index:start -->`` / ``<!-- index:end -->`` markers. Every
block is placed before any file is written, so a file missing a marker is left as it was.
"""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("results", help="the README's GPU results table and the paper's speed and memory claims, read "
                                       "from results/*.json")
    p.add_argument("--results-dir", default=None, help="folder of results files (default: the repository's results/)")
    p.add_argument("--readme", default=None, metavar="MD",
                   help="write both tables into this file's headline and speed_claims blocks")
    p.add_argument("--index", default=None, metavar="MD",
                   help="write the results folder's file table into this file's index block")
    p.set_defaults(func=_results)


def _results(args) -> int:
    from pathlib import Path

    from qerl_lib.io import write_text_atomic
    from qerl_lib.paths import RESULTS_DIR
    from qerl_lib.studies.headline import ResultsError, render_headline, results_index, unlisted_entries, update_block
    from qerl_lib.studies.speed_claims import render_speed_claims

    results_dir = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    table, speed = render_headline(results_dir), render_speed_claims(results_dir)
    print(table, speed, sep="\n\n")
    if args.index:
        extra, missing = unlisted_entries(results_dir)
        if extra:
            raise ResultsError(f"{results_dir}: {extra} not described: add them to RESULT_FILES "
                               f"(qerl_lib/studies/result_files.py) or move them to dev/runs/")
        if missing:
            raise ResultsError(f"{results_dir}: {missing} described in RESULT_FILES but absent")
    texts, written = {}, []  # every block is placed before any file is written: a missing marker changes nothing
    for block, target, body in (("headline", args.readme, table), ("speed_claims", args.readme, speed),
                                ("index", args.index, results_index(results_dir) if args.index else None)):
        if target is None:
            continue
        path = Path(target)
        if path not in texts:
            if not path.is_file():
                what = "is a folder" if path.is_dir() else "no such file"
                raise ResultsError(f"{path}: {what}: pass the Markdown file that holds the table's block "
                                   "(e.g. README.md)")
            texts[path] = path.read_text(encoding="utf-8")
        try:
            texts[path] = update_block(texts[path], block, body)
        except ResultsError as exc:
            raise ResultsError(f"{path}: {exc}") from None
        written.append(f"wrote the {block} table into {path}")
    for path, text in texts.items():
        write_text_atomic(path, text)
    print(*written, sep="\n")
    return 0
