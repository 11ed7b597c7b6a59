"""Writing a report output (a CSV, a Markdown or JSON report, a plot) so that a link in its place
is replaced, never written through: the text or figure goes to a temporary file beside the name
and is renamed over it. Opened for writing in place, ``--csv out.csv`` where ``out.csv`` was a
symbolic link to a file that is not an output (a model, someone's notes) overwrote that file.

A stream (``/dev/stdout``, ``/dev/null``, a pipe: ``paths.is_stream``) is written in place: it
holds no file, and a rename over ``/dev/stdout`` would replace the device's name itself."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from bmoe.io.paths import fresh_partial, is_stream, remove_partial, replace_with_text


def write_text_output(path: Path, text: str) -> None:
    """``text`` into the file at ``path``: whole, through a temporary renamed over the name."""
    if is_stream(path):
        with open(path, "w") as f:
            f.write(text)
        return
    replace_with_text(path, text)


def save_figure(fig: Any, path: Path, **kw: Any) -> None:
    """A matplotlib figure saved at ``path`` (its format from the name's extension), through a
    temporary renamed over the name."""
    if is_stream(path):
        fig.savefig(path, **kw)
        return
    tmp = fresh_partial(path.with_name(f".{path.name}.{os.getpid()}.tmp"))
    try:
        fig.savefig(tmp, format=path.suffix.lstrip(".").lower() or None, **kw)
        os.replace(tmp, path)
    except BaseException:
        remove_partial(tmp)
        raise
