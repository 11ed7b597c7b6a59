"""Reserved anonymous regions: placement, slack, fill, page-exact release, residency, close."""

from __future__ import annotations

import ctypes
import mmap
import random
from collections import deque
from pathlib import Path

import numpy as np
import pytest

from bmoe.errors import BudgetError
from bmoe.io.regions import Region, map_count, move_pages, release_pages, renew_pages

pytestmark = pytest.mark.pure  # no model, no llama.cpp: `pytest -m pure` runs these in seconds

PAGE = mmap.PAGESIZE
ALIGN = 4096


def read(addr: int, n: int) -> bytes:
    return ctypes.string_at(addr, n)


@pytest.mark.parametrize("file_offset", [0, 1, 4095, 4096 + 123, 7 * 2**30 + 2049])
def test_base_congruent_to_file_offset(file_offset: int) -> None:
    with Region(10_000, file_offset) as r:
        assert r.base % ALIGN == file_offset % ALIGN
        assert r.nbytes == 10_000


@pytest.mark.parametrize("file_offset", [0, 100, 4000])
def test_slack_covers_aligned_superset_and_a_page_each_side(file_offset: int) -> None:
    nbytes = 3 * ALIGN + 17
    with Region(nbytes, file_offset) as r:
        lo = r.base // ALIGN * ALIGN - PAGE
        hi = -(-(r.base + nbytes) // ALIGN) * ALIGN + PAGE
        ctypes.memset(lo, 0x5A, hi - lo)  # would fault if any of it were outside the mapping
        assert read(lo, hi - lo) == b"\x5a" * (hi - lo)


def test_fill_poisons_with_nan() -> None:
    with Region(4 * 1000, 8) as r:
        r.fill(0xFF)
        assert read(r.base, r.nbytes) == b"\xff" * r.nbytes
        floats = np.frombuffer(read(r.base, r.nbytes), np.float32)
        assert np.isnan(floats).all()


def test_untouched_region_costs_nothing() -> None:
    with Region(64 * 2**20, 0) as r:
        assert r.resident_bytes() == 0
        ctypes.memset(r.base + 5 * PAGE, 1, 1)
        assert r.resident_bytes() == PAGE


def test_reserve_beyond_ram_with_noreserve() -> None:
    if Path("/proc/sys/vm/overcommit_memory").read_text().strip() == "2":
        pytest.skip("strict overcommit ignores MAP_NORESERVE")
    meminfo = Path("/proc/meminfo").read_text().splitlines()
    ram = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemTotal:"))
    with Region(2 * ram, 0) as r:
        assert r.resident_bytes() == 0


def test_release_frees_only_whole_pages_inside() -> None:
    stride = 3 * PAGE + 100  # experts straddle pages: releasing one keeps its partial edge pages
    with Region(4 * stride, 1234) as r:
        r.fill(0xAB)
        before = r.resident_bytes()
        start, end = stride, 2 * stride
        lo = -(-(r.base + start) // PAGE) * PAGE
        hi = (r.base + end) // PAGE * PAGE
        assert r.release(start, end) == hi - lo > 0
        assert r.resident_bytes() == before - (hi - lo)
        assert read(lo, hi - lo) == bytes(hi - lo)  # released pages read back as zeros
        assert read(r.base + start, lo - r.base - start) == b"\xab" * (lo - r.base - start)
        assert read(hi, r.base + end - hi) == b"\xab" * (r.base + end - hi)
        assert read(r.base, start) == b"\xab" * start  # neighbours untouched
        assert read(r.base + end, r.nbytes - end) == b"\xab" * (r.nbytes - end)


def test_release_smaller_than_a_page_frees_nothing() -> None:
    with Region(3 * PAGE, 0) as r:
        r.fill(1)
        assert r.release(10, PAGE) == 0 and r.release(5, 5) == 0
        assert read(r.base, 3 * PAGE) == b"\x01" * (3 * PAGE)
        assert r.release(0, 3 * PAGE) == 3 * PAGE  # base page-aligned: every page is whole


def test_release_out_of_range() -> None:
    with Region(PAGE, 0) as r, pytest.raises(ValueError):
        r.release(0, PAGE + 1)


def test_close_is_idempotent_and_final() -> None:
    r = Region(PAGE, 0)
    r.close()
    r.close()
    assert r.closed
    for call in (lambda: r.fill(0), lambda: r.release(0, 0), r.resident_bytes):
        with pytest.raises(ValueError, match="closed"):
            call()


def test_context_manager_closes() -> None:
    with Region(PAGE, 0) as r:
        assert not r.closed
    assert r.closed


def test_reservation_failure_is_a_budget_error() -> None:
    with pytest.raises(BudgetError, match="cannot reserve"):
        Region(1 << 62, 0)  # more address space than x86-64 user space has


def test_an_address_space_limit_is_named_with_its_fix() -> None:
    """Under ``ulimit -v`` the reservation failed as "cannot reserve 113258496 bytes of address
    space", naming neither the cache nor what to change."""
    import subprocess
    import sys

    code = ("import resource\nfrom bmoe.io.regions import Region\n"
            "resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))\n"
            "try:\n    Region(8 << 30, 0)\nexcept Exception as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120).stdout
    assert "cannot reserve 8192 MiB of address space for expert memory" in out and "ulimit -v" in out, out


def test_rejects_empty_region() -> None:
    with pytest.raises(ValueError):
        Region(0, 0)


def test_moved_pages_carry_their_bytes_and_leave_the_source_mapped_and_empty() -> None:
    with Region(8 * PAGE, 0) as src, Region(8 * PAGE, 0) as dst:
        src.fill(0x11)
        dst.fill(0x22)
        lo, hi = src.pages(PAGE, 4 * PAGE)
        to, _ = dst.pages(2 * PAGE, 5 * PAGE)
        src_before, dst_before = src.resident_bytes(), dst.resident_bytes()
        assert move_pages(lo, to, hi - lo)
        assert read(to, hi - lo) == b"\x11" * (hi - lo), "the destination holds the moved pages"
        assert src.resident_bytes() == src_before - (hi - lo), "moved, not copied"
        assert dst.resident_bytes() == dst_before, "the destination's old pages were freed"
        assert read(lo, hi - lo) == bytes(hi - lo), "the source range is still mapped, and empty"
        assert read(dst.base, 2 * PAGE) == b"\x22" * 2 * PAGE  # neighbours untouched


def test_move_refused_is_reported_not_raised() -> None:
    with Region(4 * PAGE, 0) as r:
        assert not move_pages(r.base + 1, r.base + 2 * PAGE, PAGE), "unaligned: the kernel refuses"


def test_a_renewed_range_is_empty_writable_and_merges_back() -> None:
    with Region(8 * PAGE, 0) as src, Region(8 * PAGE, 0) as dst:
        src.fill(0x11)
        dst.fill(0x22)
        before = map_count()
        lo, hi = src.pages(PAGE, 3 * PAGE)
        to, end = dst.pages(3 * PAGE, 5 * PAGE)
        assert move_pages(lo, to, hi - lo)
        assert map_count() == before + 2, "the moved pages are a mapping of their own, splitting dst"
        renew_pages(to, end)
        assert map_count() == before, "mapped afresh, the range merged back into its region"
        assert read(to, end - to) == bytes(end - to)
        ctypes.memset(to, 0x33, end - to)
        assert read(to, end - to) == b"\x33" * (end - to)
        assert read(dst.base, 3 * PAGE) == b"\x22" * 3 * PAGE  # neighbours untouched


@pytest.mark.parametrize("free", [renew_pages, release_pages], ids=["renew", "release"])
def test_slots_split_by_moves_merge_back_when_renewed(free) -> None:  # noqa: ANN001
    """A cache churning over one region's slots, each miss taking the evicted slot's pages: the
    mappings stay bounded by the slots that hold moved pages when evicted slots are mapped afresh.
    Released in place (``release``, what bmoe did), every slot ever written split off for good:
    a long-running server's mappings grew toward ``vm.max_map_count``."""
    n_slots, n_cached, slot = 96, 8, 4 * PAGE
    with Region(n_slots * slot, 0) as r:
        at = [r.pages(e * slot, (e + 1) * slot)[0] for e in range(n_slots)]
        base = map_count()
        cached = deque(range(n_cached))
        for e in cached:
            ctypes.memset(at[e], 1, slot)
        rng, peak = random.Random(0), 0
        for _ in range(600):
            e = rng.randrange(n_slots)
            if e in cached:
                continue
            victim = cached.popleft()
            assert move_pages(at[victim], at[e], slot)
            free(at[victim], at[victim] + slot)
            cached.append(e)
            peak = max(peak, map_count() - base)
    bound = 2 * n_cached + 2
    if free is renew_pages:
        assert peak <= bound, f"{peak} mappings over the region's own with {n_cached} slots cached"
    else:  # the control: the gate above would catch slots left split off
        assert peak > 3 * bound, peak
