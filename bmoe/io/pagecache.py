"""Page-cache and /proc helpers: what this process has read, dropping a file's pages, and giving
back the RAM of file-mapped tensor bytes that bmoe reads itself.

After a plain (mmap) load llama.cpp maps the whole file; once the expert tensors are rebound to
bmoe's regions, their file pages are dead weight that the kernel would only reclaim under pressure.
``release_file_pages`` drops them at once, after checking that each range really is a read-only
mapping of that very file range (dropping anything else would destroy data).
"""

from __future__ import annotations

import ctypes
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from bmoe.errors import SeamError
from bmoe.io.ggml import GgmlTensor
from bmoe.io.layout import ModelLayout, TensorSpan
from bmoe.io.libc import libc

_PAGE = mmap.PAGESIZE


def read_io_bytes() -> int | None:
    """This process's storage reads so far (/proc/self/io read_bytes), None if unreadable."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def evict_file_cache(paths: Iterable[str | os.PathLike[str]]) -> None:
    """Drop the files' pages from the page cache, so the next open reads from the device.

    Written-back first (fsync): dirty pages survive FADV_DONTNEED. Pages some process still maps
    stay too. For measurements and tests."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def madvise_range(lo: int, hi: int, advice: int, what: str) -> None:
    if libc().madvise(lo, hi - lo, advice) != 0:
        err = ctypes.get_errno()
        raise SeamError(f"madvise({what}) on [{lo:#x}, {hi:#x}): {os.strerror(err)}")


def interior_pages(addr: int, nbytes: int) -> tuple[int, int]:
    """The pages wholly inside [addr, addr + nbytes)."""
    lo = -(-addr // _PAGE) * _PAGE
    hi = (addr + nbytes) // _PAGE * _PAGE
    return lo, max(lo, hi)


def _file_mappings(path: Path) -> list[tuple[int, int, int, bool]]:
    """This process's mappings of ``path``: (start, end, file offset, writable). Matched by
    device and inode, or by path (overlay filesystems show the underlying device in maps)."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    real = str(Path(path).resolve())
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            if len(parts) < 6:
                continue
            if not ((parts[4] == str(st.st_ino) and parts[3] == dev) or parts[5] == real):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            out.append((lo, hi, int(parts[2], 16), "w" in parts[1]))
    return sorted(out)


def _check_mapped(mappings: list[tuple[int, int, int, bool]], span: TensorSpan, addr: int, path: Path) -> None:
    """[addr, addr + nbytes) must be read-only mappings of exactly the span's file range: dropping
    pages anywhere else (anonymous memory, a rebound region) would destroy data."""
    pos, end = addr, addr + span.nbytes
    for lo, hi, off, writable in mappings:
        if lo <= pos < hi:
            if writable or off + (pos - lo) != span.offset + (pos - addr):
                break
            pos = hi
            if pos >= end:
                return
    raise SeamError(
        f"{span.name}: [{addr:#x}, {end:#x}) is not llama.cpp's read-only mapping of "
        f"{path} at offset {span.offset}; refusing to drop its pages"
    )


def file_mapped(layout: ModelLayout, spans: Sequence[tuple[TensorSpan, int]]) -> list[bool]:
    """Per (span, address): whether the address range is a read-only mapping of that very file
    range (what ``release_file_pages`` insists on)."""
    cache: dict[int, list[tuple[int, int, int, bool]]] = {}
    out = []
    for span, addr in spans:
        path = layout.shards[span.shard]
        if span.shard not in cache:
            cache[span.shard] = _file_mappings(path)
        try:
            _check_mapped(cache[span.shard], span, addr, path)
        except SeamError:
            out.append(False)
        else:
            out.append(True)
    return out


def release_file_pages(layout: ModelLayout, spans: Sequence[tuple[TensorSpan, int]]) -> int:
    """Give back the RAM of file-mapped tensor bytes: for each (span, address of the span's bytes
    in llama.cpp's mapping), MADV_DONTNEED on the pages wholly inside the mapped range (unmaps
    them from this process) and POSIX_FADV_DONTNEED on the file range (drops them from the page
    cache, which it cannot do while they are mapped). A later access just refaults from the file.
    Each range is checked to be a read-only mapping of that very file range first. Returns the
    bytes advised (pages a dirty or otherwise-mapped file keeps are still counted)."""
    by_shard: dict[int, list[tuple[TensorSpan, int]]] = {}
    for span, addr in spans:
        by_shard.setdefault(span.shard, []).append((span, addr))
    released = 0
    for shard, items in by_shard.items():
        path = layout.shards[shard]
        mappings = _file_mappings(path)
        for span, addr in items:
            _check_mapped(mappings, span, addr, path)
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for span, addr in items:
                lo, hi = interior_pages(addr, span.nbytes)
                if hi > lo:
                    madvise_range(lo, hi, mmap.MADV_DONTNEED, "MADV_DONTNEED")
                    released += hi - lo
                os.posix_fadvise(fd, span.offset, span.nbytes, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return released


def mapping_spans(layout: ModelLayout, tensors: Mapping[tuple[int, str], int]) -> list[tuple[TensorSpan, int]]:
    """(span, ->data) of each captured expert tensor, for ``release_file_pages``. Call it before
    the tensors are rebound: it reads their current ``->data``."""
    out = []
    for key, addr in tensors.items():
        et = layout.experts[key]
        out.append((et.span, GgmlTensor.from_address(addr).data))
    return out
