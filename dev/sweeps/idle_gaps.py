"""Where the GPU waits in a profiled window: idle gaps between kernels and the CPU work that ran before each (#18).

    python3 dev/sweeps/idle_gaps.py dev/runs/NAME/trace_qerl.json.gz [--min-ms 0.05] [--json OUT.json]

Reads a Chrome trace written by `torch.profiler` (`trainer_step_profile.py --trace`). The device's busy time is the
union of its kernel, memcpy and memset intervals; an idle gap is a stretch between two of them at least ``--min-ms``
long. Each gap is charged to the kernel that ends it: that kernel's launch (matched by correlation id) and the CPU
operators open on the launching thread at that moment. A gap means the CPU had not yet asked for the next kernel, so
the innermost open operator names the work the GPU waited for, the outermost one the phase (forward, an autograd
node of the backward, the optimizer). A gap that follows a synchronizing call (``cudaStreamSynchronize``,
``cudaMemcpy``...) is marked: there the CPU waited for the GPU first and then had to get ahead again.
"""
from __future__ import annotations

import argparse
import bisect
import gzip
import json
from collections import defaultdict

DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
CPU_CATS = {"cpu_op", "user_annotation", "python_function"}
SYNC_NAMES = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize")


def load_events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", trace) if e.get("ph") == "X"]


def busy_intervals(events: list[dict]) -> list[tuple[float, float, dict]]:
    """The device events in start order (µs): (start, end, event)."""
    dev = [(e["ts"], e["ts"] + e.get("dur", 0), e) for e in events if e.get("cat") in DEVICE_CATS]
    return sorted(dev, key=lambda t: t[0])


def idle_gaps(events: list[dict], min_us: float) -> tuple[list[dict], dict]:
    """The idle gaps between device events (each with the kernel ending it), and the window's totals."""
    dev = busy_intervals(events)
    if not dev:
        raise SystemExit("the trace holds no device events (a CPU run?)")
    gaps, busy, end = [], 0.0, dev[0][0]
    cur_start = dev[0][0]
    for start, stop, ev in dev:
        if start > end:
            busy += end - cur_start
            if start - end >= min_us:
                gaps.append({"start": end, "us": start - end, "next": ev})
            cur_start = start
        end = max(end, stop)
    busy += end - cur_start
    return gaps, {"first_us": dev[0][0], "last_us": end, "busy_us": busy}


def launch_context(events: list[dict]):
    """A function (kernel event) -> (launch event or None, open CPU operators outermost first, sync before?)."""
    launches = {}
    for e in events:
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {}):
            launches[e["args"]["correlation"]] = e
    by_thread = defaultdict(list)
    for e in events:
        if e.get("cat") in CPU_CATS or e.get("cat") == "cuda_runtime":
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    starts = {}
    for key, evs in by_thread.items():
        evs.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        starts[key] = [e["ts"] for e in evs]

    def context(kernel: dict):
        launch = launches.get(kernel.get("args", {}).get("correlation"))
        if launch is None:
            return None, [], False
        key = (launch.get("pid"), launch.get("tid"))
        evs, ts = by_thread[key], starts[key]
        t = launch["ts"]
        i = bisect.bisect_right(ts, t)
        open_ops = [e for e in evs[max(0, i - 4000):i]
                    if e.get("cat") in CPU_CATS and e["ts"] <= t <= e["ts"] + e.get("dur", 0)]
        runtime_before = [e for e in evs[max(0, i - 50):i - 1] if e.get("cat") == "cuda_runtime"]
        synced = any(e["name"].startswith(SYNC_NAMES) for e in runtime_before[-3:])
        return launch, sorted(open_ops, key=lambda e: (e["ts"], -e.get("dur", 0))), synced

    return context


def summarize_gaps(path: str, min_ms: float, top: int) -> dict:
    events = load_events(path)
    gaps, window = idle_gaps(events, min_ms * 1000)
    context = launch_context(events)
    by_inner, by_outer = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    largest, synced_us = [], 0.0
    for g in gaps:
        launch, ops, synced = context(g["next"])
        inner = ops[-1]["name"] if ops else "(no CPU operator open)"
        outer = ops[0]["name"] if ops else "(no CPU operator open)"
        for table, name in ((by_inner, inner), (by_outer, outer)):
            table[name][0] += 1
            table[name][1] += g["us"]
        synced_us += g["us"] if synced else 0.0
        largest.append({"ms": g["us"] / 1000, "next_kernel": g["next"]["name"][:80], "synced_before": synced,
                        "cpu_ops": [o["name"][:80] for o in ops][-6:]})
    span = window["last_us"] - window["first_us"]
    rank = lambda table: [{"op": k[:100], "gaps": v[0], "ms": v[1] / 1000}  # noqa: E731
                          for k, v in sorted(table.items(), key=lambda kv: -kv[1][1])[:top]]
    return {"trace": path, "min_gap_ms": min_ms, "span_ms": span / 1000, "busy_ms": window["busy_us"] / 1000,
            "idle_ms": (span - window["busy_us"]) / 1000, "counted_gaps": len(gaps),
            "counted_gap_ms": sum(g["us"] for g in gaps) / 1000, "after_sync_ms": synced_us / 1000,
            "by_innermost_op": rank(by_inner), "by_outermost_op": rank(by_outer),
            "largest": sorted(largest, key=lambda r: -r["ms"])[:top]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--min-ms", type=float, default=0.05)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--json")
    args = p.parse_args()
    r = summarize_gaps(args.trace, args.min_ms, args.top)
    print(f"{r['trace']}: device span {r['span_ms']:.1f} ms, busy {r['busy_ms']:.1f} ms, idle {r['idle_ms']:.1f} ms; "
          f"{r['counted_gaps']} gaps >= {r['min_gap_ms']} ms hold {r['counted_gap_ms']:.1f} ms "
          f"({r['after_sync_ms']:.1f} ms right after a synchronizing call)")
    for title, key in (("by the innermost CPU operator open at the next launch", "by_innermost_op"),
                       ("by the outermost one", "by_outermost_op")):
        print(title + ":")
        for row in r[key]:
            print(f"  {row['op'][:78]:<80}{row['gaps']:>6}{row['ms']:>9.2f} ms")
    print("largest gaps:")
    for row in r["largest"]:
        print(f"  {row['ms']:>8.2f} ms  {'sync ' if row['synced_before'] else '     '}{' > '.join(row['cpu_ops'])[-150:]}")
    if args.json:
        from qerl_lib.io import write_json_atomic
        write_json_atomic(args.json, r)


if __name__ == "__main__":
    main()
