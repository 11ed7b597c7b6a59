"""Paths a user hands in, checked before anything is opened: no output may overwrite an input.

An output flag pointed at the model (``--csv model.gguf``) used to truncate the model before the
run failed: the check compares device and inode (so a hard link or a symlink is caught too) and
the resolved path (so a missing shard of the set is caught as well), and it runs before any file
is opened for writing. The output's folder must exist and be writable, and the output must not be
a folder or a disk; character devices (``/dev/stdout``, ``/dev/null``) and pipes are allowed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterable
from pathlib import Path

from bmoe.errors import OutputPathError

PathLike = str | os.PathLike[str]


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _stat(out: Path, flag: str, how: Callable[[Path], os.stat_result]) -> os.stat_result | None:
    """``how(out)`` (os.stat or os.lstat), None when nothing is there; any other failure is one
    OutputPathError naming ``flag``."""
    try:
        return how(out)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise OutputPathError(f"{flag} {out}: {e.strerror}") from None


def is_stream(path: PathLike) -> bool:
    """A character device (``/dev/null``, ``/dev/stdout``, a terminal) or a pipe: written as a
    stream, it holds no file to overwrite, so two outputs or an input may share it."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return stat.S_ISCHR(mode) or stat.S_ISFIFO(mode)


def check_output(path: PathLike, flag: str, inputs: Iterable[PathLike] = ()) -> Path:
    """``path`` as given, once it is known to be writable and to be none of ``inputs``.

    Raises ``OutputPathError`` naming ``flag`` and the reason in one line."""
    out = Path(path)
    if is_stream(out):  # nothing there to overwrite (``-f /dev/stdin --csv /dev/stdout`` on one terminal)
        return out
    ins = [Path(p) for p in inputs]
    ident = _identity(out)
    real = out.resolve()
    for p in ins:
        if real == p.resolve() or (ident is not None and ident == _identity(p)):
            raise OutputPathError(f"{flag} {out} is an input of this run ({p}); refusing to overwrite it")
    st = _stat(out, flag, os.stat)
    if st is not None:
        if stat.S_ISDIR(st.st_mode):
            raise OutputPathError(f"{flag} {out} is a folder, not a file")
        if stat.S_ISBLK(st.st_mode) or stat.S_ISSOCK(st.st_mode):  # a disk: as root, written over
            raise OutputPathError(f"{flag} {out} is {_kind(st.st_mode)}, not a file")
        if not os.access(out, os.W_OK):
            raise OutputPathError(f"{flag} {out} is not writable")
        return out
    folder = real.parent
    if not folder.is_dir():
        raise OutputPathError(f"{flag} {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {out}: folder {folder} is not writable")
    return out


def check_output_dir(path: PathLike, flag: str, inputs: Iterable[PathLike] = ()) -> Path:
    """A folder outputs are written into: an existing folder, or one that can be created; never
    one of ``inputs``."""
    out = Path(path)
    for p in inputs:
        if out.resolve() == Path(p).resolve():
            raise OutputPathError(f"{flag} {out} is an input of this run; refusing to write there")
    if out.exists() and not out.is_dir():
        raise OutputPathError(f"{flag} {out} exists and is not a folder")
    probe = out if out.exists() else next((a for a in out.resolve().parents if a.exists()), None)
    if probe is None or not os.access(probe, os.W_OK | os.X_OK):
        raise OutputPathError(f"{flag} {out}: {probe} is not writable")
    return out


def _kind(mode: int) -> str | None:
    """What a path that is not a regular file is, in a user's words (None for a regular file)."""
    for test, name in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a pipe"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return None


def check_new_file(path: PathLike, what: str, *, force: bool = False) -> Path:
    """A file a command writes whole (a model): refused when something is already there, unless
    ``force``; a folder or a device, always. Nothing is changed here: a forced name is replaced by
    ``make_room`` once everything else about the command has been checked (a refused command
    must not have destroyed the file it would have replaced).

    A device is refused because a whole-file writer goes through a temporary file renamed over the
    name and removes what it half wrote: run as root, ``make-tiny /dev/full`` removed the device
    node itself (and a rename over ``/dev/null`` would replace it with a model)."""
    out = Path(path)
    st = _stat(out, what, os.lstat)
    if st is not None:
        try:
            mode = os.stat(out).st_mode  # what a link points at
        except OSError:  # a dangling link: replaced like a file
            mode = st.st_mode
        if stat.S_ISDIR(mode):
            raise OutputPathError(f"{what} {out} is a folder, not a file")
        kind = _kind(mode)
        if kind is not None:
            raise OutputPathError(f"{what} {out} is {kind}, not a file; a model is written to a file")
        if not force:
            kind = "a link to an existing file" if stat.S_ISLNK(st.st_mode) else "an existing file"
            raise OutputPathError(f"{what} {out} is {kind}; refusing to overwrite it (--force replaces it)")
    folder = Path(os.path.abspath(out)).parent  # where the name lives, not where a link points
    if not folder.is_dir():
        raise OutputPathError(f"{what} {out}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputPathError(f"{what} {out}: folder {folder} is not writable")
    return out


def reclaimable_bytes(path: PathLike) -> int:
    """What ``make_room`` frees at ``path``: a regular file's size (a link frees nothing)."""
    try:
        st = os.lstat(path)
    except OSError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0


def make_room(path: PathLike, what: str) -> None:
    """Unlink the name a forced ``check_new_file`` let through, right before the write, so that a
    symbolic or hard link to another file (a downloaded model) is replaced rather than written
    through."""
    try:
        remove_partial(path)
    except OSError as e:
        raise OutputPathError(f"{what} {path}: cannot replace it: {e.strerror}") from None


def check_plot_output(path: PathLike, flag: str) -> Path:
    """A plot's path whose extension matplotlib can write, checked before the work it would plot
    (a bench of many minutes, a sweep) rather than after it."""
    out = Path(path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise OutputPathError(f"{flag} needs matplotlib: pip install 'bmoe[plot]'") from None
    kinds = FigureCanvasBase.get_supported_filetypes()
    kind = out.suffix.lstrip(".").lower()
    if kind not in kinds:
        raise OutputPathError(f"{flag} {out}: matplotlib cannot write {kind or 'a file without an extension'!r}; "
                              f"use one of {', '.join(sorted(kinds))}")
    return out


def replace_with_text(path: Path, text: str) -> None:
    """Write ``text`` to a file beside ``path`` and rename it over: a reader sees the whole old
    file or the whole new one, never a torn one (another process may read it at any moment)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        remove_partial(tmp)
        raise


def fresh_partial(path: Path) -> Path:
    """``path``, made safe to create as this run's temporary file: a link or a file an earlier run
    left under that name is unlinked first, never written through (opening a link named
    ``OUT.partial`` truncated the file it pointed to); anything else there is refused."""
    remove_partial(path)
    if os.path.lexists(path):
        raise OutputPathError(f"{path}: is in the way of the temporary file (not a regular file or a link)")
    return path


def remove_partial(path: PathLike) -> None:
    """Remove a file this run half wrote: only ever a regular file or a link, never a device or a
    folder that took its name meanwhile, and silently when it is already gone."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISREG(mode) or stat.S_ISLNK(mode):
        os.unlink(path)

