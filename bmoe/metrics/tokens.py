"""Per-token measurements: one TokenMetrics per generated token, taken around its decode call.

Wall time is the decode call; ``read_wait_ms`` is the time the compute thread spent blocked on
the pipeline (reads and loop hops); ``compute_ms`` is the residual, wall minus that wait, not a
separate measurement. ``cache_ms`` is the time the cache writer spent planning and evicting (on the
loop, mostly while the compute thread waits, so it overlaps ``read_wait_ms``). CPU time and major
page faults are the whole process's (getrusage) across the call.
"""

from __future__ import annotations

import os
import resource
from dataclasses import asdict, dataclass, fields

_PAGE = os.sysconf("SC_PAGE_SIZE")


@dataclass(frozen=True)
class TokenMetrics:
    index: int  # 0 = the token the prompt produced
    token: int
    phase: str  # "prefill" for the first token (its decode call is the prompt), else "decode"
    wall_ms: float
    read_wait_ms: float | None
    cache_ms: float | None
    compute_ms: float  # residual: wall - read_wait
    bytes_read: int | None
    experts_read: int | None
    hits: int | None
    cum_hit_pct: float | None
    major_faults: int
    cpu_ms: float
    rss_bytes: int
    resident_cache_bytes: int | None
    budget_bytes: int | None = None  # the cache budget after this token (the pressure guard moves it)

    @classmethod
    def columns(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ProcessSample:
    major_faults: int
    cpu_s: float

    @classmethod
    def now(cls) -> ProcessSample:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return cls(ru.ru_majflt, ru.ru_utime + ru.ru_stime)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def peak_rss_bytes() -> int:
    """This process's resident high-water mark (VmHWM). Not ``ru_maxrss``: Linux carries that
    over fork and exec, so a child would report its parent's peak."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise OSError("no VmHWM in /proc/self/status")
