"""Paired step-by-step comparison of two `qerl bench train` rows (dev/LOG.md 89-90).

    python3 dev/sweeps/paired_steps.py dev/runs/.../bench.json [--a 0 --b 1] [--from-step 11]

The two rows (by index; default the first two) ran the same draws, so their measured steps pair up. For
``train_s_steps`` and ``rollout_s_steps``: both means, the mean paired difference (b - a), its 95% interval from
10,000 paired bootstrap resamples (seed 0), and the difference relative to a's mean; with ``--from-step N`` also from
the N-th measured step on. Prints a fixed-width table.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics


def paired(a: list[float], b: list[float], resamples: int = 10_000, seed: int = 0) -> dict:
    """Means, the mean difference b - a, and its percentile bootstrap 95% interval over paired resamples."""
    if len(a) != len(b) or not a:
        raise SystemExit(f"paired_steps: the rows measured {len(a)} and {len(b)} steps; they must pair up")
    diff = [y - x for x, y in zip(a, b)]
    rng = random.Random(seed)
    means = sorted(statistics.mean(rng.choices(diff, k=len(diff))) for _ in range(resamples))
    return {"n": len(diff), "mean_a": statistics.mean(a), "mean_b": statistics.mean(b), "diff": statistics.mean(diff),
            "low": means[int(0.025 * resamples)], "high": means[int(0.975 * resamples) - 1],
            "rel": statistics.mean(diff) / statistics.mean(a)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("json")
    p.add_argument("--a", type=int, default=0)
    p.add_argument("--b", type=int, default=1)
    p.add_argument("--from-step", type=int, default=None, help="also from this measured step on (1-based)")
    args = p.parse_args()
    rows = json.load(open(args.json))["rows"]
    a, b = rows[args.a], rows[args.b]
    print(f"a: {a['mode']} pad {a.get('pad_to_multiple_of')}   b: {b['mode']} pad {b.get('pad_to_multiple_of')}")
    print(f"{'series':<18}{'from':>5}{'n':>4}{'mean a':>9}{'mean b':>9}{'b - a':>9}{'95% low':>9}{'95% high':>9}"
          f"{'rel':>8}")
    for key in ("train_s_steps", "rollout_s_steps"):
        for start in [1] + ([args.from_step] if args.from_step else []):
            r = paired(a[key][start - 1:], b[key][start - 1:])
            print(f"{key:<18}{start:>5}{r['n']:>4}{r['mean_a']:>9.3f}{r['mean_b']:>9.3f}{r['diff']:>9.3f}"
                  f"{r['low']:>9.3f}{r['high']:>9.3f}{r['rel']:>8.1%}")


if __name__ == "__main__":
    main()
