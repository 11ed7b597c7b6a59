"""Positioned reads of expert slices straight into reserved memory, O_DIRECT where possible.

O_DIRECT keeps streamed experts out of the page cache (which would otherwise double their memory
cost and evict the dense weights) and reads exactly the bytes asked for. It needs buffer address,
file offset and length all 4096-aligned: regions are laid out so the tensor's bytes sit at their
file offset mod 4096, and the read covers the aligned superset of the slice. Filesystems that
refuse O_DIRECT, or return different bytes through it, get buffered reads with a random-access
hint instead, and the reader says why.
"""

from __future__ import annotations

import ctypes
import errno
import os
from collections.abc import Sequence
from pathlib import Path

from bmoe.errors import ReadError
from bmoe.io.watch import Identity, change, identity

DIRECT_ALIGN = 4096  # logical block size O_DIRECT requires of address, offset and length


def align_up(x: int, a: int) -> int:
    return -(-x // a) * a


def _fill(fd: int, pos: int, stop: int, need: int, addr: int) -> int:
    """Read [pos, stop) into addr until at least ``need`` is covered or EOF; returns the end reached."""
    while pos < need:
        n = os.preadv(fd, [(ctypes.c_char * (stop - pos)).from_address(addr)], pos)
        if n == 0:
            break
        pos += n
        addr += n
    return pos


class ShardReader:
    """Positioned reads of expert slices straight into a Region, O_DIRECT where the filesystem allows it.

    Thread-safe: only positioned reads on descriptors that never move, so I/O lanes share it.
    """

    def __init__(self, shards: Sequence[Path], direct: bool = True) -> None:
        self._paths = tuple(Path(p) for p in shards)
        self._fds: list[int] = []
        self._direct: list[int] | None = None
        self.mode = "buffered"
        self.fallback_reason: str | None = None
        self._identity: list[Identity] = []
        try:
            for path in self._paths:
                self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                # Default readahead reads ~3x the slice for scattered expert reads.
                os.posix_fadvise(self._fds[-1], 0, 0, os.POSIX_FADV_RANDOM)
                self._identity.append(identity(os.fstat(self._fds[-1])))
        except OSError as e:
            self.close()
            raise ReadError(f"{e.filename}: cannot open for reading: {e.strerror}") from e
        if direct:
            self._open_direct()
        else:
            self.fallback_reason = "O_DIRECT disabled by the caller"

    def _open_direct(self) -> None:
        fds: list[int] = []
        for path in self._paths:
            try:
                fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT))
            except OSError as e:
                for fd in fds:
                    os.close(fd)
                self.fallback_reason = f"{path}: the filesystem refuses O_DIRECT ({e.strerror})"
                return
        self._direct = fds
        self.mode = "odirect"

    def verify(self, shard: int, offset: int, nbytes: int) -> None:
        """Read one slice both ways and compare; on refusal or any difference, go buffered.

        Meant for open time, before the I/O lanes start: it may switch the mode under them.
        """
        if self._direct is None:
            return
        head = offset % DIRECT_ALIGN
        start, end = offset - head, offset + nbytes
        stop = align_up(end, DIRECT_ALIGN)
        scratch = ctypes.create_string_buffer(stop - start + DIRECT_ALIGN)
        aligned = align_up(ctypes.addressof(scratch), DIRECT_ALIGN)
        try:
            reached = _fill(self._direct[shard], start, stop, end, aligned)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise self._error(shard, offset, nbytes, e.strerror) from e
            self._fall_back(f"{self._paths[shard]}: O_DIRECT read refused ({e.strerror})")
            return
        if reached < end:
            raise self._error(shard, offset, nbytes, f"file ends at {reached}")
        plain = ctypes.create_string_buffer(nbytes)
        self._read(self._fds[shard], shard, offset, nbytes, offset, end, ctypes.addressof(plain))
        if ctypes.string_at(aligned + head, nbytes) != plain.raw:
            self._fall_back(f"{self._paths[shard]}: O_DIRECT read at {offset} differs from a buffered read")

    def _fall_back(self, reason: str) -> None:
        assert self._direct is not None
        for fd in self._direct:
            os.close(fd)
        self._direct = None
        self.mode = "buffered"
        self.fallback_reason = reason

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
        """Fill dest[0:nbytes] with file bytes [offset, offset+nbytes); returns bytes read from the file.

        Under O_DIRECT, dest must be congruent to offset mod 4096: the aligned superset is read in
        place, so bytes just before dest and just after dest+nbytes are written too, with the
        file's own (neighbouring) bytes. Releases the GIL in the read; safe from several threads.

        After the read, the file must still be the one opened (same inode, size and mtime, by
        descriptor and by name): bytes of a file truncated, rewritten or replaced during the run
        are refused rather than computed with the rest of the model as it was.
        """
        if self._direct is None:
            n = self._read(self._fds[shard], shard, offset, nbytes, offset, offset + nbytes, dest)
        else:
            head = offset % DIRECT_ALIGN
            if (dest - head) % DIRECT_ALIGN:
                cause = f"O_DIRECT destination {dest:#x} not congruent to the offset mod {DIRECT_ALIGN}"
                raise self._error(shard, offset, nbytes, cause)
            stop = align_up(offset + nbytes, DIRECT_ALIGN)
            n = self._read(self._direct[shard], shard, offset, nbytes, offset - head, stop, dest - head)
        self.check_unchanged(shard)
        return n

    def check_unchanged(self, shard: int) -> None:
        """Raise ``ReadError`` if the shard's file changed since it was opened (a few µs: two stats)."""
        what = change(self._paths[shard], self._fds[shard], self._identity[shard])
        if what is not None:
            raise ReadError(what)

    def _read(self, fd: int, shard: int, offset: int, nbytes: int, start: int, stop: int, addr: int) -> int:
        """Read [start, stop) of the file to addr; the slice [offset, offset+nbytes) must be covered."""
        end = offset + nbytes
        try:
            reached = _fill(fd, start, stop, end, addr)
        except OSError as e:
            raise self._error(shard, offset, nbytes, e.strerror) from e
        if reached < end:
            self.check_unchanged(shard)  # a file cut during the run says so
            raise self._error(shard, offset, nbytes, f"file ends at {reached}")
        return reached - start

    def _error(self, shard: int, offset: int, nbytes: int, cause: str | None) -> ReadError:
        return ReadError(f"{self._paths[shard]}: read of {nbytes} bytes at offset {offset} failed: {cause}")

    def close(self) -> None:
        """Close every descriptor. Idempotent; no read may be in flight."""
        for fd in self._fds + (self._direct or []):
            os.close(fd)
        self._fds, self._direct = [], None
