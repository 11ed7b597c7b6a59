"""Reserved anonymous memory that llama.cpp's expert tensors are rebound to.

One region per expert tensor (or shared slot): virtual address space is reserved up front and
costs nothing until a page is written, so a region the size of a whole tensor holds only the
experts actually read. libc is called through ctypes so that the address is a plain integer that
never moves and the unmap happens exactly when ``close`` says, never at a garbage collector's
whim: llama.cpp may still hold a pointer into it until the original tensor data is restored.

Pages are recycled rather than freed where a miss can take them: a read into pages given back by
``MADV_DONTNEED`` faults every 4 KiB page in again and the kernel zeroes each, which under a VM
costs about ten times the CPU of the read itself (2 ms per 2.5 MiB against 0.2 ms, measured in
``docs/facts.md``). ``move_pages`` hands an evicted expert's pages to a missing one with
``mremap(MREMAP_DONTUNMAP)``: the page tables move, the evicted slot stays mapped and empty.
A slot that received moved pages is a mapping of its own until it is mapped afresh
(``renew_pages``, what an eviction ends with), so the process's mappings stay bounded by what the
cache holds rather than growing with every slot the run ever filled.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import resource
import threading
from collections.abc import Callable
from types import TracebackType

from bmoe.errors import BudgetError, RegionError
from bmoe.io.direct import DIRECT_ALIGN, align_up
from bmoe.io.libc import libc

_PAGE = max(mmap.PAGESIZE, DIRECT_ALIGN)
# Python's mmap module exports MAP_NORESERVE only from 3.13; 0x4000 is its value on x86-64 and arm64.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FIXED = 0x10  # linux/mman.h on x86-64 and arm64; Python's mmap module does not export it
_MAP_FAILED = ctypes.c_void_p(-1).value

_MADV_NOHUGEPAGE = mmap.MADV_NOHUGEPAGE
_MREMAP_MAYMOVE, _MREMAP_FIXED, _MREMAP_DONTUNMAP = 1, 2, 4  # linux/mman.h; DONTUNMAP since 5.7


def _check(rc: int, call: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise RegionError(f"{call} on expert memory failed: {os.strerror(err)}", err)


def resident_bytes_of(addr: int, nbytes: int) -> int:
    """Bytes of the pages covering [addr, addr + nbytes) that are in RAM (mincore; for a file
    mapping, whether the page is in the page cache). A measurement: allocates."""
    lo = addr // _PAGE * _PAGE
    hi = align_up(addr + nbytes, _PAGE)
    pages = (hi - lo) // _PAGE
    if pages == 0:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    _check(libc().mincore(lo, hi - lo, vec), "mincore")
    return (pages - bytes(vec).count(0)) * _PAGE


def map_count_limit() -> int:
    """The most memory mappings this process may hold (vm.max_map_count; the kernel's default if
    unreadable)."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530


def map_count() -> int:
    """Memory mappings this process holds now (lines of /proc/self/maps; 0 if unreadable). Read in
    chunks under malloc's mmap threshold (128 KiB), so that counting adds no mapping of its own."""
    try:
        with open("/proc/self/maps", "rb", buffering=0) as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 16), b""))
    except OSError:
        return 0


def release_pages(lo: int, hi: int) -> None:
    """Give the pages of [lo, hi) (page-aligned) back to the kernel; the range stays mapped."""
    _check(libc().madvise(lo, hi - lo, mmap.MADV_DONTNEED), "madvise(MADV_DONTNEED)")


def renew_pages(lo: int, hi: int) -> None:
    """Give the pages of [lo, hi) (page-aligned, inside a ``Region``) back to the kernel and map the
    range afresh, as the region was reserved, so that it merges back into the region's own mapping.

    A range that received pages from ``move_pages`` is a mapping of its own for as long as it stays
    mapped (it keeps its source's page offset), and ``MADV_DONTNEED`` leaves it so: over a long run
    of evictions nearly every expert slot ends up split off, and the process's mappings grow toward
    ``vm.max_map_count``. Mapped afresh, a slot is split off only while it holds moved pages, so
    the count stays bounded by what the cache holds. If the kernel refuses the new mapping (map
    count exhausted: it refuses before unmapping anything), the pages are released in place."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
    if libc().mmap(lo, hi - lo, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0) != lo:
        release_pages(lo, hi)  # raises if the range was lost (the kernel ran out of memory mid-call)
        return
    libc().madvise(lo, hi - lo, _MADV_NOHUGEPAGE)  # as reserved: only equal flags merge


def map_zeros(nbytes: int) -> int:
    """Address of ``nbytes`` that read as zeros: private read-only anonymous pages all map the
    kernel's zero page, so they cost no memory and (read-only) no commit charge, whatever the
    size. Release with ``unmap``."""
    start = libc().mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
    if start in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        raise BudgetError(f"cannot map {nbytes} bytes of zeros: {os.strerror(err)}")
    return start


def unmap(addr: int, nbytes: int) -> None:
    _check(libc().munmap(addr, nbytes), "munmap")


def move_pages(src: int, dst: int, nbytes: int) -> bool:
    """Move the pages of [src, src + nbytes) to dst (all page-aligned, private anonymous memory):
    dst's old pages are freed, src stays mapped and empty. False when the kernel refuses (no
    MREMAP_DONTUNMAP, or the process's map count is exhausted): the caller faults pages in instead."""
    moved = libc().mremap(src, nbytes, nbytes, _MREMAP_MAYMOVE | _MREMAP_FIXED | _MREMAP_DONTUNMAP, dst)
    return moved == dst


def _reserve(nbytes: int) -> int:
    """Address of ``nbytes`` of private anonymous read-write memory, no commit charge, on 4 KiB
    pages: with transparent huge pages, one expert's read would fault in 2 MiB that an eviction
    cannot give back piecewise, and resident memory would creep up to the whole bank."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
    start: int | None = libc().mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
    if start in (None, _MAP_FAILED):
        err = ctypes.get_errno()
        limit = resource.getrlimit(resource.RLIMIT_AS)[0]
        why = (f"; the process's address space is limited to {limit >> 20} MiB (ulimit -v): a smaller cache "
               "(--cache-mb) or a higher limit" if limit != resource.RLIM_INFINITY else "")
        raise BudgetError(f"cannot reserve {nbytes >> 20} MiB of address space for expert memory: "
                          f"{os.strerror(err)}{why}")
    libc().madvise(start, nbytes, _MADV_NOHUGEPAGE)
    return start


class Region:
    """Anonymous reserved memory (mmap MAP_PRIVATE|MAP_ANONYMOUS|MAP_NORESERVE) for one expert tensor.

    ``base`` is congruent to the tensor's file offset mod 4096, so an O_DIRECT read of any slice
    lands in place; the mapping has a page of slack before ``base`` and reaches past the
    4096-aligned end of the tensor, so the aligned superset of any slice stays inside it.
    """

    def __init__(self, nbytes: int, file_offset: int) -> None:
        if nbytes <= 0 or file_offset < 0:
            raise ValueError(f"region of {nbytes} bytes at file offset {file_offset}")
        head = file_offset % DIRECT_ALIGN
        self.nbytes = nbytes
        self._length = align_up(_PAGE + head + nbytes, _PAGE) + _PAGE
        start = _reserve(self._length)
        self._start: int | None = start
        self.base: int = start + _PAGE + head

    @property
    def closed(self) -> bool:
        return self._start is None

    def fill(self, byte: int) -> None:
        """Write ``byte`` over the tensor's bytes; 0xFF makes every float a NaN (the poison test)."""
        self._live()
        ctypes.memset(self.base, byte, self.nbytes)

    def release(self, start: int, end: int) -> int:
        """Give back the pages wholly inside [start, end) (relative to base); returns bytes released.

        Partial pages at either end are kept: they hold the neighbouring experts' bytes.
        """
        lo, hi = self.pages(start, end)
        if hi <= lo:
            return 0
        renew_pages(lo, hi)
        return hi - lo

    def pages(self, start: int, end: int) -> tuple[int, int]:
        """The page-aligned addresses [lo, hi) of the pages wholly inside [start, end) (relative to
        base); hi <= lo when there are none. Partial pages hold the neighbouring experts' bytes."""
        self._live()
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"pages [{start}, {end}) outside region of {self.nbytes} bytes")
        return align_up(self.base + start, _PAGE), (self.base + end) // _PAGE * _PAGE

    def resident_bytes(self) -> int:
        """Bytes of the whole mapping (slack included) in RAM now. A measurement: allocates."""
        return resident_bytes_of(self._live(), self._length)

    def close(self) -> None:
        """Unmap. Idempotent. Restore any tensor pointing here first: its pointer dangles after."""
        if self._start is None:
            return
        start, self._start = self._start, None
        _check(libc().munmap(start, self._length), "munmap")

    def _live(self) -> int:
        if self._start is None:
            raise ValueError("region is closed")
        return self._start

    def __enter__(self) -> Region:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class WarmPool:
    """Pages faulted in ahead of need by a background thread, for a fresh cache's first misses.

    A new session's cache has no evicted pages to recycle, so each expert its first prompt reads
    lands in pages the kernel faults in and zeroes as the read copies. Under a VM that hands freed
    memory back to its host that costs about 2 ms/MiB, more than the read (``docs/facts.md``), and
    it sits on the first prompt's critical path. The pool faults pages in from the open on, while
    the dense weights load and the prompt is typed or tokenized, and ``take`` hands them to expert
    slots (``move_pages``, as an eviction's pages are handed on). It works only while the session
    is idle (``pause`` while a generation runs): faulting beside a running prompt takes a core from
    its compute and the memory locks from its reads, which measured slower than letting the reads
    fault their own pages. So the head start is what the idle time before a request bought: none
    for a prompt given at open, the whole budget for a chat's or a server's first request.

    The pool is only ever a head start, never a condition of correctness: a slot given no pages,
    or pages the pool has meanwhile released, faults its own in when the read lands. Its spare
    pages plus what the cache holds (``used``) stay within the cache's budget (``budget``), both
    read before every chunk; once the cache has filled (evictions supply pages from then on) or
    the budget has shrunk below where it started (memory pressure), the spare is given back and
    the thread ends.
    """

    CHUNK = 1 << 20  # faulted in per call: ~2 ms at worst, so close() never waits long
    IDLE_S = 0.05  # between looks at the budget while the spare already fills it

    def __init__(self, nbytes: int, budget: Callable[[], int], used: Callable[[], int]) -> None:
        self.nbytes = align_up(max(nbytes, 0), _PAGE)
        self._budget, self._used = budget, used
        self._start = 0
        self._taken = 0  # written by the taker only
        self._ready = 0  # written by the pool's thread only: [taken, ready) is faulted in
        self._done = self.nbytes == 0
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._idle.set()
        self._thread: threading.Thread | None = None
        if self._done:
            return
        try:
            self._start = _reserve(self.nbytes)
        except BudgetError:
            self._done = True  # no head start; the slots fault their own pages in
            return
        self._thread = threading.Thread(target=self._fill, args=(budget(),), name="bmoe-warm-pool", daemon=True)
        self._thread.start()

    @property
    def spare_bytes(self) -> int:
        """Bytes faulted in and not taken yet (a reading; the thread may move it)."""
        return 0 if self._done else max(0, self._ready - self._taken)

    def pause(self) -> None:
        """Fault nothing more in until ``resume`` (the chunk under way finishes, ~2 ms)."""
        self._idle.clear()

    def resume(self) -> None:
        self._idle.set()

    def take(self, nbytes: int) -> tuple[int, int]:
        """(address, length) of up to ``nbytes`` of faulted-in pages, page-aligned; length 0 when
        none are ready. The caller moves them away (``move_pages``) before the next take."""
        if self._done:
            return 0, 0
        n = min(nbytes, self._ready - self._taken) // _PAGE * _PAGE
        if n <= 0:
            return 0, 0
        addr = self._start + self._taken
        self._taken += n
        return addr, n

    def _fill(self, start_budget: int) -> None:
        while not self._stop.is_set() and self._taken < self.nbytes:
            if not self._idle.wait(self.IDLE_S):
                continue
            budget, used = self._budget(), self._used()
            if used >= budget or budget < start_budget:
                break
            if self._ready >= self.nbytes or self._ready - self._taken + used + self.CHUNK > budget:
                self._stop.wait(self.IDLE_S)
                continue
            n = min(self.CHUNK, self.nbytes - self._ready)
            # Written rather than MADV_POPULATE_WRITE: a write fault takes only its mapping's
            # lock, where the madvise holds the process's mmap lock, which every page move and
            # every O_DIRECT read of the cache's own misses then queue behind.
            ctypes.memset(self._start + self._ready, 0, n)
            self._ready += n
        self._done = True
        lo, hi = self._start + min(self._taken, self._ready), self._start + self._ready
        if hi > lo:
            libc().madvise(lo, hi - lo, mmap.MADV_DONTNEED)

    def close(self) -> None:
        """Stop the thread and unmap. Idempotent. Pages already moved away are their slots' own."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._start:
            start, self._start = self._start, 0
            self._done = True
            _check(libc().munmap(start, self.nbytes), "munmap")
