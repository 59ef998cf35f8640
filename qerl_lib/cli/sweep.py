"""`qerl calibrate` (the claim task's level and temperature), `qerl sweep` (seeded grids of runs) and
`qerl claims` (the claims table from the sweeps' results)."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="base pass@1 and mixed-reward groups per (level, temperature) of the expr task")
    p.add_argument("--model", default="smollm2")
    p.add_argument("--levels", default="1,2,3,4,5", help="comma-separated expression levels (1-5)")
    p.add_argument("--temperatures", default="0.5,0.7,1.0")
    p.add_argument("--bases", default="bf16,nvfp4", help="comma-separated base formats (bf16, nf4, nvfp4, mxfp4)")
    p.add_argument("--n", type=int, default=128, help="training-split problems per setting")
    p.add_argument("--group", type=int, default=8, help="completions per problem (a GRPO group)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--json", default=None,
                   help="write the calibration record here (with provenance), rewritten after every row; if it exists "
                        "with the same settings (model, --n, --group), the rerun resumes it: rows already there are not "
                        "measured again (a file of other settings is refused)")
    p.add_argument("--force", action="store_true", help="start over: replace an existing --json instead of resuming it")
    p.set_defaults(func=_calibrate)

    p = sub.add_parser("sweep", help="run a grid of (arm x seed) training runs from a spec file, resumable",
                       description="Spec format: see qerl_lib/studies/sweep.py. Finished runs are never rerun; "
                                   "run the same command again to continue a stopped sweep.")
    p.add_argument("spec", help="sweep spec (.toml or .json)")
    p.add_argument("--out", default=None, help="sweep folder (default artifacts/sweeps/NAME)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="override every run's device")
    p.add_argument("--max-minutes", type=float, default=None, help="stop launching new runs after this long")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="set a TrainConfig field in the spec's [common] table (the value read as JSON, else as "
                        "text), e.g. --set steps=2; refused for a field an arm sets itself")
    p.add_argument("--seeds", default=None, help="comma-separated seeds instead of the spec's")
    p.add_argument("--concurrency", default=None,
                   help="runs at once instead of the spec's (a positive integer or \"auto\"), e.g. to share a GPU "
                        "between two sweeps")
    p.add_argument("--check", action="store_true", help="validate the spec and list the runs, run nothing")
    p.set_defaults(func=_sweep)

    p = sub.add_parser("claims", help="the paper's training claims vs the kit's sweeps: table, verdicts, JSON",
                       description="Reads results/claims/block_*.json (or, with --export, first writes them from the "
                                   "sweep folders), writes results/claims.json and prints the table.")
    p.add_argument("--export", action="store_true", help="first export the block JSONs from the sweep folders")
    p.add_argument("--sweeps", default="dev/runs/claims", help="folder holding the sweep folders (base, claims, lr)")
    p.add_argument("--results-dir", default=None, help="where claims/ and claims.json go (default: results/)")
    p.add_argument("--readme", default=None, metavar="MD", help="also write the table into this file's claims block")
    p.set_defaults(func=_claims)


def _csv(text: str, kind=str, flag: str = "") -> tuple:
    """Comma-separated values of one type; a value that does not parse is a one-line error naming ``flag``."""
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        from qerl_lib.errors import UserError

        raise UserError(f"{flag} takes comma-separated {kind.__name__} values, got {text!r}") from None


def _calibrate(args) -> int:
    from qerl_lib.io import prepare_output_file, provenance, write_json_atomic
    from qerl_lib.studies.calibration import (calibrate, calibration_settings, check_calibration_args,
                                              format_calibration, resume_calibration)

    levels, temperatures = _csv(args.levels, int, "--levels"), _csv(args.temperatures, float, "--temperatures")
    bases = _csv(args.bases, str, "--bases")
    check_calibration_args(levels, temperatures, args.n, args.group, bases)  # flag errors before the file's
    done, earlier_runs = [], []
    if args.json:  # an existing record of the same settings is resumed (studies/calibration.py), unless --force
        prepare_output_file(args.json, force=None, flag="--json")  # a folder is refused; a file is read below
        if not args.force:
            done, earlier_runs = resume_calibration(args.json, calibration_settings(args.model, args.n, args.group),
                                                    bases, levels, temperatures)
    prov = provenance()
    if earlier_runs:  # the runs that measured the rows kept, oldest first
        prov["resumed_from"] = earlier_runs
    if done:
        grid = {(b, lv, t) for b in bases for lv in levels for t in temperatures}
        print(f"kept {len(done)} row(s) from {args.json}; measuring {len(grid) - len(done)}", flush=True)
    save = (lambda record: write_json_atomic(args.json, {**record, "provenance": prov})) if args.json else None
    record = calibrate(model=args.model, levels=levels, temperatures=temperatures, n=args.n, group=args.group,
                       bases=bases, device=args.device, done=done, checkpoint=save)
    print(format_calibration(record))
    if args.json:
        write_json_atomic(args.json, {**record, "provenance": prov})
        print(f"wrote {args.json}")
    return 0


def _sweep(args) -> int:
    import dataclasses
    import json
    from pathlib import Path

    from qerl_lib.errors import UserError
    from qerl_lib.paths import ARTIFACTS_DIR
    from qerl_lib.studies.sweep import plan_runs, read_spec, resolve_concurrency, run_sweep

    spec = read_spec(args.spec)
    common = dict(spec.common)
    for item in args.set:
        if "=" not in item:
            raise UserError(f"--set {item!r}: use FIELD=VALUE, e.g. --set steps=2")
        key, value = item.split("=", 1)
        setters = [arm.get("name", "?") for arm in spec.arms if key in arm]
        if setters:
            raise UserError(f"--set {key}=...: arm(s) {setters} set {key!r} themselves, and an arm's value wins over "
                            f"[common]; edit those arms in {args.spec} instead")
        try:
            common[key] = json.loads(value)
        except json.JSONDecodeError:
            common[key] = value
    spec = dataclasses.replace(spec, common=common)
    if args.seeds:
        spec = dataclasses.replace(spec, seeds=_csv(args.seeds, int, "--seeds"))
    if args.concurrency is not None:
        value = args.concurrency if args.concurrency == "auto" else int(args.concurrency) \
            if args.concurrency.isdigit() else args.concurrency
        if value != "auto" and (not isinstance(value, int) or value < 1):
            raise UserError(f"--concurrency {args.concurrency!r}: use a positive integer or auto")
        spec = dataclasses.replace(spec, concurrency=value)
    runs = plan_runs(spec)
    concurrency = resolve_concurrency(spec, len(runs), args.device)
    out = Path(args.out) if args.out else ARTIFACTS_DIR / "sweeps" / spec.name
    if args.check:
        print(f"{len(runs)} runs ({len(spec.arms)} arms x {len(spec.seeds)} seeds), {concurrency} at once, into {out}")
        for run in runs:
            print(f"  {run.run_id:28s} {run.config.arm_label:12s} lr {run.config.learning_rate:g}"
                  f"{'' if run.train else '  (evaluation only)'}")
        return 0
    summary = run_sweep(spec, out, device=args.device, max_minutes=args.max_minutes)
    print(f"{summary['n_runs_finished']}/{summary['n_runs_planned']} runs finished; summary in {out}/summary.json")
    return 0 if summary["n_runs_finished"] == summary["n_runs_planned"] else 1


def _claims(args) -> int:
    from pathlib import Path

    from qerl_lib.errors import UserError
    from qerl_lib.io import write_json_atomic, write_text_atomic
    from qerl_lib.paths import RESULTS_DIR
    from qerl_lib.studies.claims_table import build_table, export_blocks, format_table, read_blocks, render_markdown
    from qerl_lib.studies.headline import update_block

    results = Path(args.results_dir) if args.results_dir else RESULTS_DIR
    blocks = export_blocks(args.sweeps, results / "claims") if args.export else read_blocks(results / "claims")
    table = build_table(blocks)
    readme = None
    if args.readme:  # the block is placed before anything is written: a wrong --readme changes nothing
        path = Path(args.readme)
        if not path.is_file():
            raise UserError(f"--readme {path}: {'is a folder' if path.is_dir() else 'no such file'}: pass the "
                            "Markdown file that holds the claims block (e.g. README.md)")
        try:
            readme = update_block(path.read_text(encoding="utf-8"), "claims", render_markdown(table))
        except UserError as exc:  # no claims markers
            raise UserError(f"{path}: {exc}: add them where the table goes") from None
    write_json_atomic(results / "claims.json", table)
    print(format_table(table))
    print(f"wrote {results / 'claims.json'}")
    if readme is not None:
        write_text_atomic(path, readme)
        print(f"wrote the claims table into {path}")
    return 0
