"""cgroup v2 ``io.max``: a real limit on a block device's read bytes per second, for the test aid
that emulates a slower disk (``RunConfig.disk_limit_mib_s``, ``bmoe bench --disk-limit``).

Used only where it is there and this process may write it: cgroup v2 mounted, this process's
cgroup not the root (which has no ``io.max``), the ``io`` controller enabled for it (the file
exists), the file writable, and the model's files all on one block device the file can name (a
whole disk: a partition is named by its disk). Anything else is a reason, and the caller falls
back to a token bucket in the read lanes (``bmoe.stages.read``). The limit holds for every process
in the cgroup, not only the engine: said in ``how``. ``IoMax.restore`` puts the old line back.

Every path is read under ``root`` (``/`` unless a test hands in a fake tree)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

MiB = 1 << 20


@dataclass(frozen=True)
class IoMax:
    """An ``io.max`` this process may write, and the device line it limits."""

    path: Path
    device: str  # "MAJ:MIN" of the whole disk
    old: str  # that device's line before (or "MAJ:MIN rbps=max")

    def apply(self, mib_s: float) -> None:
        self.path.write_text(f"{self.device} rbps={max(1, int(mib_s * MiB))}\n")

    def restore(self) -> None:
        """Put the device's old read limit back (only the read limit: the other keys were never
        changed)."""
        rbps = next((kv.split("=", 1)[1] for kv in self.old.split()[1:] if kv.startswith("rbps=")), "max")
        self.path.write_text(f"{self.device} rbps={rbps}\n")


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cgroup2_dir(root: Path = Path("/")) -> Path | str:
    """This process's cgroup v2 folder, or why there is none to limit."""
    own = next((line[3:].strip() for line in (_read(root / "proc/self/cgroup") or "").splitlines()
                if line.startswith("0::")), None)
    if own is None:
        return "no cgroup v2 hierarchy for this process"
    mount = None
    for line in (_read(root / "proc/self/mountinfo") or "").splitlines():
        left, _, right = line.partition(" - ")
        if right.split()[:1] == ["cgroup2"] and len(left.split()) >= 5:
            mount = left.split()[4]
    if mount is None:
        return "cgroup v2 is not mounted"
    if own in ("/", ""):
        return "this process is in the root cgroup, which has no io.max"
    return root / mount.lstrip("/") / own.lstrip("/")


def whole_disk(st_dev: int, root: Path = Path("/")) -> str | None:
    """"MAJ:MIN" of the disk holding a device number (its own, or a partition's disk); None when
    the number names no block device (overlay, tmpfs, a network filesystem)."""
    sysfs = root / f"sys/dev/block/{os.major(st_dev)}:{os.minor(st_dev)}"
    if not sysfs.exists():
        return None
    real = sysfs.resolve()
    disk = real.parent if (real / "partition").exists() else real
    dev = _read(disk / "dev")
    return dev.strip() if dev else None


def find_io_max(paths: Sequence[Path | str], root: Path = Path("/")) -> IoMax | str:
    """The ``io.max`` that can limit reads of ``paths``, or the reason none can."""
    folder = cgroup2_dir(root)
    if isinstance(folder, str):
        return folder
    path = folder / "io.max"
    if not path.exists():
        return "the io controller is not enabled for this process's cgroup (no io.max)"
    if not os.access(path, os.W_OK):
        return f"{path} is not writable by this process"
    devices = set()
    for p in paths:
        try:
            devices.add(whole_disk(os.stat(p).st_dev, root))
        except OSError as e:
            return f"{p}: {e.strerror}"
    if None in devices:
        return "the model's filesystem is not on a block device io.max can name"
    if len(devices) != 1:
        return "the model's files are on more than one disk"
    device = devices.pop()
    assert device is not None
    old = next((line for line in (_read(path) or "").splitlines() if line.split()[:1] == [device]),
               f"{device} rbps=max")
    return IoMax(path, device, old)
