"""The model files as a session opened them, checked once a token.

llama.cpp maps the weights it loads from the file (a resident run, the mmap open modes, the
dense part unless copied): a file rewritten in place under a running session changed those bytes
under the model, and the run went on, exit 0, printing tokens computed from other weights.
Expert reads checked the file only when they ran short or after each read; a run with every
expert cached, or a resident one, never did. A watch keeps a descriptor of each shard (so a
file deleted or renamed over still has its bytes behind the mapping) and compares, a few µs a
token, what the descriptor and the name say now with what they said at open.

A file truncated under a mapping is not caught in time: touching a page past the new end is a
SIGBUS inside llama.cpp, which no Python handler can turn into an error. The default streamed
open copies the dense part and reads experts with ``pread`` (a short read, checked), so only the
mapped modes (``--resident``, ``--open-mode mmap`` / ``mmap-drop``) are exposed, as stock llama.cpp is.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from bmoe.errors import ReadError

Identity = tuple[int, int, int, int]  # device, inode, size, mtime (ns)


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def change(path: Path, fd: int, was: Identity) -> str | None:
    """How the file behind ``fd`` (opened as ``path``) differs from ``was``, as one line; None if
    it does not."""
    try:
        now, named = identity(os.fstat(fd)), identity(os.stat(path))
    except OSError as e:
        return f"{path}: the model file went away during the run ({e.strerror})"
    if named[:2] != was[:2]:
        return f"{path}: the model file was replaced during the run (a new file under its name)"
    if now != was:
        what = "truncated" if now[2] < was[2] else "rewritten"
        return (f"{path}: the model file was {what} during the run (size {was[2]} -> {now[2]} bytes, "
                "mtime changed); its bytes no longer match the model loaded")
    return None


class FileWatch:
    """Every shard of a model, as it was when opened; ``check`` raises ``ReadError`` once one changed."""

    def __init__(self, shards: Sequence[Path]) -> None:
        self._paths = tuple(Path(p) for p in shards)
        self._fds: list[int] = []
        self._was: list[Identity] = []
        try:
            for path in self._paths:
                self._fds.append(os.open(path, os.O_RDONLY | os.O_CLOEXEC))
                self._was.append(identity(os.fstat(self._fds[-1])))
        except OSError as e:
            self.close()
            raise ReadError(f"{e.filename}: cannot open for reading: {e.strerror}") from e

    def changed(self) -> str | None:
        """The first shard's change, as one line; None while every shard is as opened."""
        for path, fd, was in zip(self._paths, self._fds, self._was):
            what = change(path, fd, was)
            if what is not None:
                return what
        return None

    def check(self) -> None:
        what = self.changed()
        if what is not None:
            raise ReadError(what)

    def close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)
