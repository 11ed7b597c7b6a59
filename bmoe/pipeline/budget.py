"""Sizing the expert cache budget: pure arithmetic over numbers the caller measured.

``auto`` gives the cache what the machine can spare once, at open: available memory minus the
dense weights minus a safety floor, clamped to a ceiling and to the whole expert bank (a bigger
cache than the bank is never filled). Below one token's working set a cache that cycles through
the layers in order (LRU) hits nothing at all; such a budget is allowed but earns a warning.
"""

from __future__ import annotations

from dataclasses import dataclass

from bmoe.errors import BudgetError

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True)
class Budget:
    bytes: int
    how: str  # one line: where the number came from
    warning: str | None = None


def safety_floor(mem_total: int) -> int:
    """Memory left to the OS, the page cache of the dense weights and the rest of the process."""
    return max(GiB, mem_total // 10)


def resolve_budget(
    requested: int | None,
    *,
    ceiling: int | None,
    mem_available: int,
    mem_total: int,
    dense_bytes: int,
    expert_bank_bytes: int,
    working_set_bytes: int,
) -> Budget:
    """``requested`` None means auto; an explicit number is taken as given (0 = cache off)."""
    if requested is not None:
        if requested < 0:
            raise BudgetError(f"cache budget must be >= 0, got {requested}")
        budget, how = requested, f"{requested / MiB:.0f} MiB as requested"
    else:
        spare = mem_available - dense_bytes - safety_floor(mem_total)
        budget = max(0, min(spare, expert_bank_bytes))
        how = (
            f"auto: {mem_available / MiB:.0f} MiB available - {dense_bytes / MiB:.0f} MiB dense - "
            f"{safety_floor(mem_total) / MiB:.0f} MiB floor, at most the {expert_bank_bytes / MiB:.0f} "
            "MiB expert bank"
        )
    if ceiling is not None and budget > ceiling:
        budget, how = ceiling, how + f", capped at {ceiling / MiB:.0f} MiB"
    warning = None
    if 0 < budget < working_set_bytes:
        warning = (
            f"cache budget {budget / MiB:.0f} MiB is below one token's working set "
            f"({working_set_bytes / MiB:.0f} MiB = MoE layers x experts used x expert bytes): "
            "an LRU cache then hits almost nothing"
        )
    return Budget(budget, how, warning)


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """MemTotal, MemAvailable, ... in bytes."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts:
                out[key] = int(parts[0]) * (1024 if len(parts) > 1 and parts[1] == "kB" else 1)
    return out
