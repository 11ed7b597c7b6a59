"""The memory limit of this process's cgroup: what a container (Docker, Kubernetes) lets it use.

``/proc/meminfo`` and ``/proc/pressure/memory`` describe the host. In a container limited to
1,100 MiB on a 24 GiB host, ``auto`` planned a 20 GiB cache from them, and a first-open child the
limit's OOM killer ended was reported as a file llama.cpp kills. The cgroup's own files say what
is left:

- v2: ``memory.max`` (the OOM killer's limit) and ``memory.high`` (above it the kernel throttles
  and reclaims hard): the lower binds; ``memory.current``; ``memory.stat``'s ``active_file`` and
  ``inactive_file`` (page cache, reclaimed before anything is killed: counted as available, as
  MemAvailable counts the host's); ``memory.events``' ``oom_kill``; ``memory.pressure`` (the
  cgroup's own PSI).
- v1: ``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat``'s
  ``total_active_file`` / ``total_inactive_file``, ``memory.oom_control``'s ``oom_kill``.

A limit may be set on any ancestor of the process's cgroup: every level visible under the mount
is read, and the one with the least room binds. Where the process's path is not under the mount
(a container that mounts its own cgroup as the root without a cgroup namespace), the root is it.

Pure: every reader takes the mount's root and the ``/proc/self/cgroup`` path, so tests fake both
in a temporary directory.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

ROOT = "/sys/fs/cgroup"
SELF = "/proc/self/cgroup"
# v1 writes "no limit" as the largest page count: 9223372036854771712. No machine has 2^60 bytes.
_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class CgroupMemory:
    """The binding level's figures, in bytes."""

    limit: int
    usage: int  # all the cgroup's memory, page cache included
    file_pages: int  # the page cache within ``usage``: reclaimable before an OOM kill
    what: str  # the file the limit came from: "memory.max", "memory.high", "memory.limit_in_bytes"
    oom_kills: int | None  # processes of the cgroup the OOM killer ended so far (cumulative)
    psi_some_us: int | None = None  # the cgroup's memory.pressure "some" total (v2), cumulative

    @property
    def available(self) -> int:
        """What the cgroup may still take before its limit: the free part and its page cache."""
        return max(0, min(self.limit, self.limit - self.usage + self.file_pages))

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.what} {self.limit / mib:.0f} MiB - {self.usage / mib:.0f} MiB used "
                f"+ {self.file_pages / mib:.0f} MiB page cache")


def own_paths(text: str) -> tuple[str | None, str | None]:
    """(v2 path, v1 memory controller path) of a ``/proc/self/cgroup`` text; None where absent."""
    v2 = v1 = None
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = path.strip()
        elif "memory" in controllers.split(","):
            v1 = path.strip()
    return v2, v1


def _read(path: Path | str) -> str | None:
    """A small kernel file's text (os-level: the guard samples every quarter second)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        return os.read(fd, 1 << 16).decode("ascii", errors="replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _int(path: Path) -> int | None:
    text = _read(path)
    if text is None:
        return None
    text = text.strip()
    if text == "max":
        return _UNLIMITED
    try:
        return int(text)
    except ValueError:
        return None


def _fields(text: str | None) -> dict[str, int]:
    """``key value`` lines (memory.stat, memory.events, memory.oom_control) as a dict."""
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].lstrip("-").isdigit():
            out[parts[0]] = int(parts[1])
    return out


def _psi_some(text: str | None) -> int | None:
    for line in (text or "").splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "total" and value.isdigit():
                    return int(value)
    return None


def _levels(mount: Path, rel: str) -> list[Path]:
    """The process's cgroup directory and its ancestors up to the mount, leaf first."""
    leaf = mount / rel.strip("/") if rel.strip("/") else mount
    if not leaf.is_dir():
        return [mount]
    out = [leaf]
    while out[-1] != mount and mount in out[-1].parents:
        out.append(out[-1].parent)
    return out


@lru_cache(maxsize=8)
def _plan(root: str, self_cgroup: str) -> tuple[str, tuple[str, ...]]:
    """("v1" | "v2" | "", the level directories to read, leaf first): found once per process (a
    process does not change cgroups under bmoe); their files are read at every call."""
    text = _read(self_cgroup)
    if text is None:
        return "", ()
    v2, v1 = own_paths(text)
    base = Path(root)
    if v1 is not None and (base / "memory" / "memory.limit_in_bytes").exists():
        return "v1", tuple(str(d) for d in _levels(base / "memory", v1))
    if v2 is not None:
        mount = base if (base / "cgroup.controllers").exists() else base / "unified"
        return "v2", tuple(str(d) for d in _levels(mount, v2))
    return "", ()


def _v2_level(d: Path) -> CgroupMemory | None:
    limits = [(v, name) for name in ("memory.max", "memory.high") if (v := _int(d / name)) is not None]
    limits = [(v, name) for v, name in limits if v < _UNLIMITED]
    usage = _int(d / "memory.current") if limits else None
    if usage is None:
        return None
    limit, what = min(limits)
    stat = _fields(_read(d / "memory.stat"))
    events = _fields(_read(d / "memory.events"))
    return CgroupMemory(limit, usage, stat.get("active_file", 0) + stat.get("inactive_file", 0), what,
                        events.get("oom_kill"), _psi_some(_read(d / "memory.pressure")))


def _v1_level(d: Path) -> CgroupMemory | None:
    limit = _int(d / "memory.limit_in_bytes")
    if limit is None or limit >= _UNLIMITED:
        return None
    usage = _int(d / "memory.usage_in_bytes")
    if usage is None:
        return None
    stat = _fields(_read(d / "memory.stat"))
    files = stat.get("total_active_file", stat.get("active_file", 0)) + stat.get(
        "total_inactive_file", stat.get("inactive_file", 0))
    return CgroupMemory(limit, usage, files, "memory.limit_in_bytes",
                        _fields(_read(d / "memory.oom_control")).get("oom_kill"))


def read_cgroup_memory(root: str | os.PathLike[str] = ROOT, self_cgroup: str | os.PathLike[str] = SELF
                       ) -> CgroupMemory | None:
    """The limit with the least room of this process's cgroup and its ancestors; None when no
    level sets one (or nothing is readable: no cgroup, or none mounted where expected)."""
    version, levels = _plan(os.fspath(root), os.fspath(self_cgroup))
    read = _v1_level if version == "v1" else _v2_level
    found = [m for d in levels if (m := read(Path(d))) is not None]
    return min(found, key=lambda m: m.available, default=None)
