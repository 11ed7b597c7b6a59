"""Reserved anonymous memory that llama.cpp's expert tensors are rebound to.

One region per expert tensor (or shared slot): virtual address space is reserved up front and
costs nothing until a page is written, so a region the size of a whole tensor holds only the
experts actually read. libc is called through ctypes so that the address is a plain integer that
never moves and the unmap happens exactly when ``close`` says, never at a garbage collector's
whim: llama.cpp may still hold a pointer into it until the original tensor data is restored.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from types import TracebackType

from bmoe.errors import BudgetError
from bmoe.io.direct import DIRECT_ALIGN, align_up

_PAGE = max(mmap.PAGESIZE, DIRECT_ALIGN)
# Python's mmap module exports MAP_NORESERVE only from 3.13; 0x4000 is its value on x86-64 and arm64.
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_FAILED = ctypes.c_void_p(-1).value

_MADV_NOHUGEPAGE = mmap.MADV_NOHUGEPAGE
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.mincore.restype = ctypes.c_int
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _check(rc: int, call: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{call}: {os.strerror(err)}")


def resident_bytes_of(addr: int, nbytes: int) -> int:
    """Bytes of the pages covering [addr, addr + nbytes) that are in RAM (mincore; for a file
    mapping, whether the page is in the page cache). A measurement: allocates."""
    lo = addr // _PAGE * _PAGE
    hi = -(-(addr + nbytes) // _PAGE) * _PAGE
    pages = (hi - lo) // _PAGE
    if pages == 0:
        return 0
    vec = (ctypes.c_ubyte * pages)()
    _check(_libc.mincore(lo, hi - lo, vec), "mincore")
    return (pages - bytes(vec).count(0)) * _PAGE


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
        start: int | None = _libc.mmap(None, self._length, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if start in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise BudgetError(f"cannot reserve {self._length} bytes of address space: {os.strerror(err)}")
        self._start: int | None = start
        self.base: int = start + _PAGE + head
        # With transparent huge pages on, one expert read would fault in 2 MiB pages that an
        # eviction cannot give back piecewise: resident memory would creep up to the whole bank.
        _libc.madvise(start, self._length, _MADV_NOHUGEPAGE)

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
        self._live()
        if not 0 <= start <= end <= self.nbytes:
            raise ValueError(f"release [{start}, {end}) outside region of {self.nbytes} bytes")
        lo = align_up(self.base + start, _PAGE)
        hi = (self.base + end) // _PAGE * _PAGE
        if hi <= lo:
            return 0
        _check(_libc.madvise(lo, hi - lo, mmap.MADV_DONTNEED), "madvise(MADV_DONTNEED)")
        return hi - lo

    def resident_bytes(self) -> int:
        """Bytes of the whole mapping (slack included) in RAM now. A measurement: allocates."""
        return resident_bytes_of(self._live(), self._length)

    def close(self) -> None:
        """Unmap. Idempotent. Restore any tensor pointing here first: its pointer dangles after."""
        if self._start is None:
            return
        start, self._start = self._start, None
        _check(_libc.munmap(start, self._length), "munmap")

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
