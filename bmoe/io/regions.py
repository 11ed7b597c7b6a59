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
"""

from __future__ import annotations

import ctypes
import mmap
import os
from types import TracebackType

from bmoe.errors import BudgetError, RegionError
from bmoe.io.direct import DIRECT_ALIGN, align_up
from bmoe.io.libc import libc

_PAGE = max(mmap.PAGESIZE, DIRECT_ALIGN)
# Python's mmap module exports MAP_NORESERVE only from 3.13; 0x4000 is its value on x86-64 and arm64.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
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
    """Memory mappings this process holds now (lines of /proc/self/maps; 0 if unreadable)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


def release_pages(lo: int, hi: int) -> None:
    """Give the pages of [lo, hi) (page-aligned) back to the kernel; the range stays mapped."""
    _check(libc().madvise(lo, hi - lo, mmap.MADV_DONTNEED), "madvise(MADV_DONTNEED)")


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
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE
        start: int | None = libc().mmap(None, self._length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if start in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise BudgetError(f"cannot reserve {self._length} bytes of address space: {os.strerror(err)}")
        self._start: int | None = start
        self.base: int = start + _PAGE + head
        # With transparent huge pages on, one expert read would fault in 2 MiB pages that an
        # eviction cannot give back piecewise: resident memory would creep up to the whole bank.
        libc().madvise(start, self._length, _MADV_NOHUGEPAGE)

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
        release_pages(lo, hi)
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
