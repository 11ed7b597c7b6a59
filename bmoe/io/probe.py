"""Device probe: how fast this machine's disk serves random direct reads of a given slice size.

Measured once per (device, slice size, lanes) on a scratch file next to where models live, then
cached in the user cache directory, because a replay that models reads needs the figure every
time and measuring it takes seconds. Reads are O_DIRECT where the filesystem allows it (else
buffered on an evicted file, and the result says so), at 4096-aligned random offsets.
"""

from __future__ import annotations

import json
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bmoe.io.direct import ShardReader
from bmoe.io.regions import Region

MiB = 1 << 20
_SCRATCH_BYTES = 256 * MiB


@dataclass(frozen=True)
class ProbeResult:
    mib_s: float  # aggregate over all lanes
    slice_bytes: int
    lanes: int
    mode: str  # "odirect" or "buffered"
    reads: int
    how: str


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe"


def measure(directory: Path, slice_bytes: int, lanes: int, reads: int = 256) -> ProbeResult:
    """Random reads of ``slice_bytes`` with ``lanes`` threads over a fresh scratch file."""
    directory.mkdir(parents=True, exist_ok=True)
    scratch = directory / f".bmoe-probe-{os.getpid()}.bin"
    size = max(_SCRATCH_BYTES, 8 * slice_bytes)
    try:
        with open(scratch, "wb") as f:
            block = os.urandom(MiB)
            for _ in range(-(-size // MiB)):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        reader = ShardReader([scratch], direct=True)
        reader.verify(0, 0, min(slice_bytes, size))
        rng = random.Random(0)
        span = size - slice_bytes
        offsets = [rng.randrange(0, span // 4096) * 4096 for _ in range(reads)]
        regions = [Region(slice_bytes, 0) for _ in range(lanes)]
        try:
            with ThreadPoolExecutor(lanes) as pool:
                t0 = time.perf_counter()
                futures = [
                    pool.submit(reader.read_into, 0, off, slice_bytes, regions[i % lanes].base)
                    for i, off in enumerate(offsets)
                ]
                total = sum(f.result() for f in futures)
                elapsed = time.perf_counter() - t0
        finally:
            for r in regions:
                r.close()
            mode = reader.mode
            reader.close()
    finally:
        scratch.unlink(missing_ok=True)
    return ProbeResult(
        total / MiB / elapsed, slice_bytes, lanes, mode, reads,
        f"{reads} random {mode} reads of {slice_bytes} bytes, {lanes} lanes, on a {size // MiB} MiB "
        f"scratch file in {directory}; bytes transferred over wall time",
    )


def cached_probe(directory: Path, slice_bytes: int, lanes: int) -> ProbeResult:
    """The probe for this device, slice size and lane count, measured on first use."""
    key = f"{os.stat(directory).st_dev}:{slice_bytes}:{lanes}"
    store = cache_dir() / "probe.json"
    known: dict[str, dict] = {}
    if store.exists():
        try:
            known = json.loads(store.read_text())
        except (OSError, ValueError):
            known = {}
    if key in known:
        return ProbeResult(**known[key])
    result = measure(directory, slice_bytes, lanes)
    known[key] = asdict(result)
    store.parent.mkdir(parents=True, exist_ok=True)
    store.write_text(json.dumps(known, indent=1))
    return result


class SimReader:
    """A reader that takes as long as the probed device would and touches no memory."""

    def __init__(self, probe: ProbeResult) -> None:
        self.probe = probe
        self.mode = f"sim ({probe.mode} probe, {probe.mib_s:.0f} MiB/s over {probe.lanes} lanes)"
        self.fallback_reason = None
        self._lane_bytes_s = probe.mib_s * MiB / probe.lanes

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
        time.sleep(nbytes / self._lane_bytes_s)
        return nbytes

    def close(self) -> None:
        pass
