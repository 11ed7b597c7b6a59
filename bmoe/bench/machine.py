"""The machine a bench runs on, for its report: CPU, memory, kernel, load, and the disk holding
the model (device, model name, rotational, filesystem and mount), as far as /proc and sysfs tell."""

from __future__ import annotations

import os
import platform
from collections.abc import Mapping
from pathlib import Path
from typing import Any


def _read(path: Path | str) -> str | None:
    try:
        return Path(path).read_text().strip()
    except OSError:
        return None


def cpu_model() -> str:
    text = _read("/proc/cpuinfo") or ""
    for key in ("model name", "Model", "Hardware", "cpu model"):
        for line in text.splitlines():
            if line.split(":")[0].strip() == key:
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def disk_of(path: Path) -> dict[str, Any]:
    """The block device (and its mount) holding ``path``, as far as sysfs and mountinfo tell."""
    st = os.stat(path)
    major, minor = os.major(st.st_dev), os.minor(st.st_dev)
    out: dict[str, Any] = {"dev": f"{major}:{minor}", "device": None, "model": None, "rotational": None,
                           "mount": None, "fstype": None, "source": None}
    target = str(path.resolve())
    best = -1
    for line in (_read("/proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) < 5 or len(rparts) < 2:
            continue
        mount = parts[4]
        inside = mount == "/" or target == mount or target.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= best:  # the longest (and, on ties, the last) mount wins
            best = len(mount)
            out.update(mount=mount, fstype=rparts[0], source=rparts[1])
    sysfs = Path(f"/sys/dev/block/{major}:{minor}")
    if sysfs.exists():
        real = sysfs.resolve()
        disk = real.parent if (real / "partition").exists() else real
        out["device"] = real.name
        out["disk"] = disk.name
        out["model"] = _read(disk / "device" / "model")
        rot = _read(disk / "queue" / "rotational")
        out["rotational"] = None if rot is None else rot == "1"
    return out


def machine_info(model: Path, meminfo: Mapping[str, int]) -> dict[str, Any]:
    """The machine a bench ran on, for its report (``meminfo``: /proc/meminfo as read, or a test's)."""
    info = meminfo
    return {
        "cpu_model": cpu_model(), "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0)),
        "mem_total_bytes": info.get("MemTotal"), "mem_available_bytes": info.get("MemAvailable"),
        "swap_total_bytes": info.get("SwapTotal"), "kernel": platform.release(), "arch": platform.machine(),
        "python": platform.python_version(), "loadavg_at_start": os.getloadavg(), "disk": disk_of(model),
    }

