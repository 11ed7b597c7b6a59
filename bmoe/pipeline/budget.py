"""Sizing the expert cache budget: pure arithmetic over numbers the caller measured.

The cache may have what the machine can spare once everything else the process needs is held
(``Needs``): the dense weights while they live in a file mapping (the page cache counts them as
available, yet they must stay), llama.cpp's KV cache and compute buffers still to be touched (their
address space is allocated when the context is made, the pages come on first use), the
interpreter's growth, the page cache of the code the process runs from, and a margin for the
kernel and other programs. The prefill's transient union (a long prompt routes a layer to nearly
every expert, all pinned at once) is held inside the budget: the cache evicts everything else to
make room for it, so the experts take ``max(budget, union)`` and the union only has to fit too, not
be added. ``resolve_budget`` gives ``auto`` that figure, clamped to the whole
expert bank (a bigger cache is never filled) and to a ceiling; a fixed budget that does not fit
is refused with the figure that would fit, or only warned about when forced. Below one token's
working set a cache that cycles through the layers in order (LRU) hits nothing at all: such a
budget is allowed but earns a warning.

Memory available is the host's MemAvailable, or, in a container whose cgroup limits memory, the
limit less the cgroup's usage plus its page cache when that is less (``read_memory``).

The open-time figure is a forecast; ``bmoe.pipeline.pressure`` corrects it while running, and may
grow an ``auto`` budget into the room set aside for buffers not touched yet (``guard_ceiling``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from bmoe.errors import BudgetError
from bmoe.pipeline.cgroup import CgroupMemory, read_cgroup_memory

MiB = 1 << 20
GiB = 1 << 30
# What the interpreter may still grow by (token lists, numpy temporaries, asyncio bookkeeping).
INTERPRETER_GROWTH = 64 * MiB


@dataclass(frozen=True)
class Budget:
    bytes: int
    how: str  # one line: where the number came from
    warning: str | None = None
    fit_bytes: int | None = None  # what the memory model said would fit (None: not modelled)


def margin_bytes(mem_total: int) -> int:
    """Left to the kernel and to other programs: 3 % of RAM, at least 256 MiB."""
    return max(256 * MiB, mem_total * 3 // 100)


@dataclass(frozen=True)
class Needs:
    """Memory the process needs besides the expert cache that MemAvailable does not yet account
    as taken, in bytes. Anonymous memory already touched (the interpreter, dense weights copied
    into anonymous memory or filled by the cheap open) is out of MemAvailable already: not here."""

    dense: int  # dense weights held in a file mapping: page cache that must stay
    buffers: int  # llama.cpp's KV and compute buffers (and any other allocation) not touched yet
    code: int  # page cache of the mapped code and libraries the process runs from
    transient: int  # the prefill's union: one layer's routed experts pinned at once
    interpreter: int  # the interpreter's growth while running
    margin: int  # the kernel's and other programs' share

    @property
    def total(self) -> int:
        """Everything but the prefill union, which the cache's budget holds (``room``)."""
        return self.dense + self.buffers + self.code + self.interpreter + self.margin

    def room(self, mem_available: int) -> int:
        """The most the expert cache may take: what the other needs leave, if the prefill union
        fits in it too (a layer's union is pinned while the cache evicts everything else, so the
        experts take the larger of the two), else nothing."""
        left = mem_available - self.total
        return left if left >= self.transient else 0

    @property
    def kept_pages(self) -> int:
        """File pages the process needs to stay cached: counted in MemAvailable, yet ours."""
        return self.dense + self.code

    def describe(self) -> str:
        parts = (("dense in the file mapping", self.dense), ("KV + compute buffers untouched", self.buffers),
                 ("code", self.code), ("interpreter", self.interpreter), ("margin", self.margin))
        return (" - ".join(f"{mib_text(n)} MiB {what}" for what, n in parts)
                + f" (the {mib_text(self.transient)} MiB prefill union is held inside the cache)")


def transient_bytes(n_expert: int, n_expert_used: int, n_batch: int, max_entry_bytes: int) -> int:
    """The most one prefill layer pins beyond the budget: its union of routed experts."""
    return min(n_expert, n_batch * n_expert_used) * max_entry_bytes


def needs_from(
    *, smaps: SmapsTotals, dense_bytes: int, dense_in_file: bool, transient: int, mem_total: int
) -> Needs:
    return Needs(
        dense=dense_bytes if dense_in_file else 0,
        buffers=smaps.untouched_anon,
        code=smaps.code_file,
        transient=transient,
        interpreter=INTERPRETER_GROWTH,
        margin=margin_bytes(mem_total),
    )


def mib_text(nbytes: int | float, grouped: bool = False) -> str:
    """MiB as a reader needs them: whole where exact or from 100 MiB up, else with a decimal (two
    significant digits below 0.1), so that a small model's 0.4 MiB bank does not read as 0.
    ``grouped``: thousands separated (a table's column)."""
    v = nbytes / MiB
    if v >= 100 or v == round(v):
        return f"{v:,.0f}" if grouped else f"{v:.0f}"
    return f"{v:.1f}" if v >= 0.1 else f"{v:.2g}"


def resolve_budget(
    requested: int | None,
    *,
    ceiling: int | None,
    mem_available: int,
    needs: Needs,
    expert_bank_bytes: int,
    working_set_bytes: int,
    force: bool = False,
    source: str = "available",
) -> Budget:
    """``requested`` None means auto; an explicit number (0 = cache off) must fit, unless forced.
    ``source`` names where ``mem_available`` came from (``Memory.how``)."""
    fit = needs.room(mem_available)
    left = mem_available - needs.total
    model = f"{mib_text(mem_available)} MiB {source} - {needs.describe()} = {mib_text(max(left, 0))} MiB"
    if left > 0 and fit == 0:  # what is left is real; it just cannot hold a prompt layer's union
        model += f", less than the {mib_text(needs.transient)} MiB prefill union: 0 MiB"
    warning = None
    if requested is not None:
        if requested < 0:
            raise BudgetError(f"cache budget must be >= 0, got {requested}")
        budget, how = requested, f"{mib_text(requested)} MiB as requested"
        if requested > expert_bank_bytes > 0:  # more than the bank can never be filled: say what runs
            budget = expert_bank_bytes
            how = f"{mib_text(budget)} MiB, the whole expert bank ({mib_text(requested)} MiB asked)"
        if min(requested, expert_bank_bytes) > fit:
            text = f"a {mib_text(requested)} MiB cache does not fit in memory: {mib_text(fit)} MiB would ({model})"
            if not force:
                raise BudgetError(text + "; force it (--force) to run it anyway")
            warning = text + "; running it anyway (forced): expect the kernel to reclaim the dense weights"
    else:
        budget = min(fit, expert_bank_bytes)
        how = f"auto: {model}, at most the {mib_text(expert_bank_bytes)} MiB expert bank"
    if ceiling is not None and budget > ceiling:
        budget, how = ceiling, how + f", capped at {mib_text(ceiling)} MiB"
    if 0 < budget < working_set_bytes:
        below = (
            f"cache budget {mib_text(budget)} MiB is below one token's working set "
            f"({mib_text(working_set_bytes)} MiB = MoE layers x experts used x expert bytes): "
            "an LRU cache then hits almost nothing"
        )
        warning = below if warning is None else f"{warning}; {below}"
    return Budget(budget, how, warning, fit)


def guard_ceiling(budget_bytes: int, *, requested: int | None, needs: Needs, expert_bank_bytes: int,
                  ceiling: int | None) -> int:
    """How far the pressure guard may grow the budget while running. A fixed budget stays what was
    asked. ``auto`` may grow into the room it set aside for KV and compute buffers not touched yet:
    MemAvailable counts them as free until they are, the guard grows only while its high watermark
    stays free, and gives the room back when they are touched (its MemAvailable reading falls).
    Sized at open alone, auto left that room idle: on a 48-layer model under 8 GiB it decoded at
    0.78-0.82x a 6 GiB fixed budget that ran within the limit."""
    if requested is not None:
        return budget_bytes
    top = max(budget_bytes, min(expert_bank_bytes, budget_bytes + needs.buffers))
    return top if ceiling is None else max(budget_bytes, min(top, ceiling))


@dataclass(frozen=True)
class SmapsTotals:
    untouched_anon: int  # writable private anonymous address space not yet in RAM
    code_file: int  # file-backed pages in RAM, the excluded files' aside


def parse_smaps(
    text: str, exclude_paths: Iterable[str] = (), exclude_ranges: Iterable[tuple[int, int]] = ()
) -> SmapsTotals:
    """Totals of ``/proc/<pid>/smaps`` text. ``exclude_paths``: files whose mappings are counted
    elsewhere (the model's shards); ``exclude_ranges``: [start, end) address ranges whose mappings
    are not needs (where the open put the expert tensors' bytes, never touched once they are
    rebound to bmoe's own regions): their bytes are taken off the untouched part of the mappings
    they overlap (the kernel merges neighbouring anonymous mappings, so a range may share one with
    buffers that are needs). Thread stacks count as untouched anonymous memory too: a few MiB per
    thread of overestimate, on the safe side."""
    # smaps names a file by its absolute, symlink-free path: a path as typed ("model.gguf", a link)
    # never matched, and the model's own mapped pages counted as code (the whole file, mmap'd).
    excluded = {os.path.realpath(p) for p in exclude_paths}
    ranges = list(exclude_ranges)
    untouched = code = 0
    kind: str | None = None  # "anon", "file" or None (not counted)
    size = rss = anon = 0
    start = end = 0

    def flush() -> None:
        nonlocal untouched, code
        if kind == "anon":
            skip = sum(max(0, min(end, hi) - max(start, lo)) for lo, hi in ranges)
            untouched += max(0, size - rss - skip)
        elif kind == "file":
            code += max(0, rss - anon)

    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and not head[0].endswith(":"):
            flush()
            size = rss = anon = 0
            perms = head[1] if len(head) > 1 else ""
            path = head[5].strip() if len(head) > 5 else ""
            lo, _, hi = head[0].partition("-")
            start, end = int(lo, 16), int(hi, 16)
            if path.startswith("/"):
                kind = None if path in excluded else "file"
            elif path in ("", "[heap]") and perms[:2] == "rw" and perms[3:4] == "p":
                kind = "anon"
            else:
                kind = None
            continue
        if len(head) >= 2 and head[0] in ("Size:", "Rss:", "Anonymous:"):
            value = int(head[1]) * 1024
            if head[0] == "Size:":
                size = value
            elif head[0] == "Rss:":
                rss = value
            else:
                anon = value
    flush()
    return SmapsTotals(untouched, code)


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


@dataclass(frozen=True)
class Memory:
    """What the process may use, in bytes: the host's figures, or the container's where lower."""

    total: int  # MemTotal, or the cgroup's limit
    available: int  # MemAvailable, or the cgroup's room (limit - usage + page cache)
    how: str  # where ``available`` came from, for the budget's one line
    cgroup: CgroupMemory | None = None


def read_memory(meminfo_path: str = "/proc/meminfo",
                cgroup: Callable[[], CgroupMemory | None] | None = None) -> Memory:
    """min(host, container) of total and available memory. A container's limit is invisible in
    /proc/meminfo: under a 1,100 MiB limit on a 24 GiB host, ``auto`` planned a 20 GiB cache."""
    info = read_meminfo(meminfo_path)
    total, avail = info.get("MemTotal", 0), info.get("MemAvailable", 0)
    limits = (cgroup or read_cgroup_memory)()
    if limits is None:
        return Memory(total, avail, "MemAvailable")
    total = min(total, limits.limit) if total else limits.limit
    if limits.available < avail:
        return Memory(total, limits.available, f"available in the container ({limits.describe()})", limits)
    return Memory(total, avail, "MemAvailable (below the container's room)", limits)
