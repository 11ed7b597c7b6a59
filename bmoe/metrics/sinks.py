"""Where per-token metrics go, without ever holding up a decode.

The generation hands each TokenMetrics to a sink with ``add`` (no waiting); a writer task owned by
the caller drains the lines to the file through aiofiles, concurrently with the next decode.
``--progress`` writes one JSON line per token; ``--csv`` writes a ``#`` header with the bmoe
version, the llama-cpp-python pin and the whole resolved configuration, a column row, one row per
token and a closing ``# summary`` line.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path

import aiofiles

from bmoe._version import __version__
from bmoe.errors import OutputPathError
from bmoe.metrics.tokens import TokenMetrics
from bmoe.pipeline.channel import Channel

LLAMA_CPP_PIN = "0.3.36"


def _csv_line(values: list[object]) -> str:
    buf = io.StringIO()
    csv.writer(buf, lineterminator="\n").writerow(["" if v is None else v for v in values])
    return buf.getvalue()


class LineSink:
    """Lines queued by ``add_line``, written by ``run`` until ``close``."""

    def __init__(self, path: Path | None) -> None:
        self._path = path  # None: standard error
        self._lines: Channel[str] = Channel()

    def add_line(self, line: str) -> None:
        self._lines.send_nowait(line)

    def close(self) -> None:
        self._lines.close()

    async def run(self) -> None:
        """Write until closed; a write that fails (a full disk, EIO) is one ``OutputPathError``
        naming the file, raised once the generation has ended."""
        try:
            await self._write()
        except OSError as e:
            where = "standard error" if self._path is None else str(self._path)
            raise OutputPathError(f"{where}: could not write: {e.strerror or e}") from e

    async def _write(self) -> None:
        if self._path is None:
            out = aiofiles.stderr
            async for line in self._lines:
                await out.write(line)
                await out.flush()
            return
        async with aiofiles.open(self._path, "w") as f:
            async for line in self._lines:
                await f.write(line)


class ProgressSink(LineSink):
    def add(self, m: TokenMetrics) -> None:
        self.add_line(json.dumps(m.as_dict()) + "\n")


class CsvSink(LineSink):
    def __init__(self, path: Path, config: Mapping[str, object], model: str) -> None:
        super().__init__(path)
        self.add_line(f"# bmoe {__version__} llama-cpp-python {LLAMA_CPP_PIN}\n")
        self.add_line(f"# model {model}\n")
        self.add_line(f"# config {json.dumps(dict(config), sort_keys=True)}\n")
        self.add_line(_csv_line(TokenMetrics.columns()))

    def add(self, m: TokenMetrics) -> None:
        self.add_line(_csv_line([getattr(m, c) for c in TokenMetrics.columns()]))

    def summary(self, summary: Mapping[str, object]) -> None:
        self.add_line(f"# summary {json.dumps(dict(summary), sort_keys=True)}\n")


def read_csv(path: Path) -> tuple[dict[str, str], list[dict[str, str]], dict[str, object] | None]:
    """Parse a metrics CSV back: header entries, rows, summary. For tests and analysis scripts."""
    header: dict[str, str] = {}
    summary = None
    body: list[str] = []
    for line in Path(path).read_text().splitlines():
        if line.startswith("# summary "):
            summary = json.loads(line[len("# summary "):])
        elif line.startswith("# "):
            key, _, value = line[2:].partition(" ")
            header[key] = value
        else:
            body.append(line)
    rows = list(csv.DictReader(body))
    return header, rows, summary
