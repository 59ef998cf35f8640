"""Provenance: the device, date, package versions and command behind every number the kit writes.

Every results/ JSON and every metrics JSON embeds `provenance()`, so a reader can tell where
a number came from and whether it is comparable with another.
"""

from __future__ import annotations

import datetime as _dt
import importlib.metadata as _md
import platform
import sys

PACKAGES = ("torch", "triton", "transformers", "trl", "peft", "compressed-tensors", "llmcompressor",
            "bitsandbytes", "datasets", "accelerate", "math-verify", "papermill")


def versions(packages: tuple[str, ...] = PACKAGES) -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in packages:
        try:
            out[name] = _md.version(name)
        except _md.PackageNotFoundError:
            out[name] = None
    return out


def device_info() -> dict:
    """Name of the accelerator (or CPU), with the facts that change timings."""
    info: dict = {"cpu": platform.processor() or platform.machine(), "cpu_count": _cpu_count()}
    try:
        import torch
    except ImportError:
        return {"name": "cpu", **info}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(name=p.name, cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}",
                    sm_count=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1),
                    gpu_count=torch.cuda.device_count())
    else:
        info.update(name="cpu", threads=torch.get_num_threads())
    return info


def provenance(command: str | None = None) -> dict:
    """The block every results JSON carries: device, date (UTC), versions and command."""
    return {
        "device": device_info(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions(),
        "command": command if command is not None else " ".join([sys.argv[0].split("/")[-1], *sys.argv[1:]]),
    }


def _cpu_count() -> int:
    import os
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1
