"""The pressure guard: the cache budget follows the memory other programs leave while running.

The budget sized at open is a forecast. When another program takes memory the cache counted on, a
fixed budget makes the kernel reclaim what the process cannot do without (the dense weights in the
page cache, its code) and every token faults it back in: speed falls 4-12x. The guard watches three
signals and shrinks the budget when any appears, then grows it back once they have cleared:

- MemAvailable (in a container whose cgroup limits memory, the limit's room where lower:
  ``bmoe.pipeline.cgroup``), less what the cache will still take to fill its budget (``budget - resident``):
  below ``low`` is pressure; a shrink gives up enough to bring it back to ``high``, and a growth
  never takes it below ``high``. Between the two nothing happens (the hysteresis band).
- ``/proc/pressure/memory`` (PSI; the cgroup's own ``memory.pressure`` where it has one): the
  share of wall time some task stalled on memory since the last sample, at or above ``psi_fraction``.
- the process's major page faults per second, at or above ``fault_rate`` (its dense weights or
  code being read back after reclaim; expert reads are O_DIRECT and fault nothing).

A shrink on PSI or faults alone gives up an eighth of the budget, at most once per
``signal_cooldown_s`` (while another program's memory is being reclaimed, every sample stalls:
without it the budget would halve in six samples). Growth waits ``cooldown_s`` after
any change and goes at most ``grow_step`` at a time, never past the ceiling (the budget at open;
for ``auto``, plus the room of buffers not touched yet: ``bmoe.pipeline.budget.guard_ceiling``).

Pure: ``decide`` is arithmetic over two samples; the readers take their text or path from the
caller, and ``PressureGuard`` takes its sample source and clock, so tests inject both. Applying a
decision (evicting down to the new budget) is the caller's job, between layers.
"""

from __future__ import annotations

import resource
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from bmoe.errors import BudgetError
from bmoe.pipeline.budget import MiB, read_meminfo
from bmoe.pipeline.cgroup import CgroupMemory, read_cgroup_memory


@dataclass(frozen=True)
class PressureSample:
    """One reading; any figure None where this machine does not provide it."""

    t: float  # monotonic seconds
    mem_available: int | None
    psi_some_us: int | None  # /proc/pressure/memory "some" total: microseconds stalled, cumulative
    major_faults: int | None  # this process's, cumulative


Source = Callable[[], PressureSample]


def parse_psi(text: str) -> int | None:
    """The cumulative ``some`` stall (µs) of a /proc/pressure/memory text, None if absent."""
    for line in text.splitlines():
        if line.startswith("some "):
            for field in line.split()[1:]:
                key, _, value = field.partition("=")
                if key == "total":
                    return int(value)
    return None


def read_psi(path: str = "/proc/pressure/memory") -> int | None:
    try:
        with open(path) as f:
            return parse_psi(f.read())
    except (OSError, ValueError):
        return None  # no PSI (kernel built without it, or a container hiding it)


def read_major_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_majflt


def read_mem_available(path: str = "/proc/meminfo") -> int | None:
    try:
        return read_meminfo(path).get("MemAvailable")
    except (OSError, ValueError):
        return None


def live_sample(clock: Callable[[], float] = time.monotonic,
                cgroup: Callable[[], CgroupMemory | None] | None = None) -> PressureSample:
    """This machine and process now (two small /proc reads, the cgroup's few files, getrusage).
    In a container the cgroup's room and stalls are what matter: the host may have plenty of
    both while the container's limit reclaims this process's pages."""
    available, psi = read_mem_available(), None
    limits = (cgroup or read_cgroup_memory)()
    if limits is not None:
        available = limits.available if available is None else min(available, limits.available)
        psi = limits.psi_some_us
    return PressureSample(clock(), available, read_psi() if psi is None else psi, read_major_faults())


@dataclass(frozen=True)
class GuardSettings:
    low: int  # projected MemAvailable below which the cache shrinks
    high: int  # a shrink restores this much; a growth keeps it
    psi_fraction: float = 0.25
    fault_rate: float = 200.0  # major faults per second (800 KiB/s of 4 KiB pages)
    cooldown_s: float = 2.0
    signal_cooldown_s: float = 1.0
    grow_step: int = 512 * MiB
    grow_min: int = 64 * MiB  # smaller growths are not worth a change
    interval_s: float = 0.25  # the least time between two samples

    def __post_init__(self) -> None:
        if not 0 <= self.low < self.high:
            raise BudgetError(f"pressure guard watermarks must satisfy 0 <= low < high, got {self.low}, {self.high}")
        if self.interval_s < 0 or self.cooldown_s < 0 or self.grow_step <= 0:
            raise BudgetError("pressure guard: interval and cooldown must be >= 0, the growth step > 0")

    @classmethod
    def around(cls, low: int, **kw: object) -> GuardSettings:
        """Watermarks from ``low``: ``high`` a band above it (half of it, 128 MiB at least)."""
        return cls(low=low, high=low + max(128 * MiB, low // 2), **kw)  # type: ignore[arg-type]


@dataclass(frozen=True)
class BudgetChange:
    t: float  # monotonic seconds (the sample's)
    old: int
    new: int
    why: str
    step: int | None = None  # the decode call it happened in, when the caller knows

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def decide(
    prev: PressureSample | None, cur: PressureSample, *, budget: int, resident: int, ceiling: int,
    settings: GuardSettings, since_change_s: float, floor: int = 0,
) -> tuple[int, str] | None:
    """The new budget and why, or None to keep it. Pure."""
    s = settings
    signals = []
    free = None
    if cur.mem_available is not None:
        free = cur.mem_available - max(0, budget - resident)
        if free < s.low:
            signals.append(f"MemAvailable {cur.mem_available / MiB:.0f} MiB leaves {free / MiB:.0f} MiB once the "
                           f"cache fills, below {s.low / MiB:.0f} MiB")
    dt = cur.t - prev.t if prev is not None else 0.0
    if prev is not None and dt > 0:
        if cur.psi_some_us is not None and prev.psi_some_us is not None:
            stalled = (cur.psi_some_us - prev.psi_some_us) / 1e6 / dt
            if stalled >= s.psi_fraction:
                signals.append(f"memory stalls {100 * stalled:.0f} % of the time (PSI)")
        if cur.major_faults is not None and prev.major_faults is not None:
            rate = (cur.major_faults - prev.major_faults) / dt
            if rate >= s.fault_rate:
                signals.append(f"{rate:.0f} major faults/s")
    short = free is not None and free < s.low
    if signals and not short and since_change_s < s.signal_cooldown_s:
        return None  # stalls or faults alone, and the budget moved just now: let that take effect
    if signals:
        give = max(budget // 8, s.high - free if free is not None else 0)
        new = max(floor, budget - give)
        return (new, "; ".join(signals)) if new < budget else None
    if free is None or budget >= ceiling or since_change_s < s.cooldown_s:
        return None
    room = min(free - s.high, s.grow_step, ceiling - budget)
    if room < min(s.grow_min, ceiling - budget) or room <= 0:
        return None
    return budget + room, f"pressure cleared: {free / MiB:.0f} MiB would stay available"


class PressureGuard:
    """Samples at most every ``settings.interval_s`` and says when the budget should change.

    Called on the cache writer's thread only (the event loop), between layers; never from the
    eval callback.
    """

    def __init__(
        self, ceiling: int, settings: GuardSettings, source: Source = live_sample,
        clock: Callable[[], float] = time.monotonic, floor: int = 0,
    ) -> None:
        self.ceiling = ceiling
        self.settings = settings
        self.floor = floor
        self.source = source
        self._clock = clock
        self._prev: PressureSample | None = None
        self._next_at = float("-inf")
        self._changed_at = float("-inf")
        self.samples = 0

    def poll(self, budget: int, resident: int) -> BudgetChange | None:
        now = self._clock()
        if now < self._next_at:
            return None
        self._next_at = now + self.settings.interval_s
        cur = self.source()
        self.samples += 1
        prev, self._prev = self._prev, cur
        out = decide(prev, cur, budget=budget, resident=resident, ceiling=self.ceiling, settings=self.settings,
                     since_change_s=cur.t - self._changed_at, floor=self.floor)
        if out is None:
            return None
        self._changed_at = cur.t
        return BudgetChange(cur.t, budget, out[0], out[1])
