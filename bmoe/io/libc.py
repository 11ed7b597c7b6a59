"""The one ctypes binding of libc that bmoe's memory code calls (mmap, munmap, madvise, mincore,
mremap).

Bound lazily on first use, never at import: importing bmoe must not touch native code. The calls
go through ctypes rather than Python's ``mmap`` module so that an address is a plain integer that
never moves and a region is unmapped exactly when its owner says so.
"""

from __future__ import annotations

import ctypes
from functools import cache


@cache
def libc() -> ctypes.CDLL:
    lib = ctypes.CDLL(None, use_errno=True)
    # void *mmap(void *addr, size_t length, int prot, int flags, int fd, off_t offset);
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    # int munmap(void *addr, size_t length);
    lib.munmap.restype = ctypes.c_int
    lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    # int madvise(void *addr, size_t length, int advice);
    lib.madvise.restype = ctypes.c_int
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    # int mincore(void *addr, size_t length, unsigned char *vec);
    lib.mincore.restype = ctypes.c_int
    lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    # void *mremap(void *old_address, size_t old_size, size_t new_size, int flags, void *new_address);
    lib.mremap.restype = ctypes.c_void_p
    lib.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
    return lib
