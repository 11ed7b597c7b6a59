"""Device probe: how fast this machine's disk serves random direct reads of a given slice size.

Measured once per (device, slice size, lanes) on a scratch file next to where models live, then
cached in the user cache directory, because a replay that models reads needs the figure every
time and measuring it takes seconds. Reads are O_DIRECT where the filesystem allows it (else
buffered on an evicted file, and the result says so), at 4096-aligned random offsets.

The scratch file never outlives the probe and never grows past ``MAX_SCRATCH_BYTES``: it is
created unnamed (``O_TMPFILE``; where the filesystem refuses that, created and unlinked at
once) and read through ``/proc/self/fd``, so the kernel reclaims it however the process ends, a
kill included. Slices larger than ``MAX_PROBE_SLICE`` are measured at that size (bandwidth has
long stopped growing with the slice there), so an absurd expert size from a corrupt trace costs
nothing.
"""

from __future__ import annotations

import json
import math
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from bmoe.errors import ConfigError
from bmoe.io.direct import DIRECT_ALIGN, ShardReader, align_up
from bmoe.io.layout import ModelLayout
from bmoe.io.paths import replace_with_text
from bmoe.io.regions import Region

MiB = 1 << 20
_SCRATCH_BYTES = 256 * MiB
MAX_PROBE_SLICE = 64 * MiB
MAX_SCRATCH_BYTES = 8 * MAX_PROBE_SLICE  # 512 MiB


@dataclass(frozen=True)
class ProbeResult:
    mib_s: float  # aggregate over all lanes
    slice_bytes: int
    lanes: int
    mode: str  # "odirect" or "buffered"
    reads: int
    how: str
    fresh: bool = False  # into pages never touched before (else a reused buffer per lane)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bmoe"


def _unnamed_scratch(directory: Path) -> int:
    """A file in ``directory`` with no name: gone when its last descriptor closes."""
    try:
        return os.open(directory, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (OSError, AttributeError):
        try:
            fd, name = tempfile.mkstemp(prefix=".bmoe-probe-", dir=directory)
        except OSError as e:  # it printed the scratch file's name and the errno's words alone
            raise ConfigError(f"cannot measure the read rate of the disk holding {directory}: a scratch file "
                              f"there failed ({e.strerror}); the probe needs a writable folder on that disk") from None
        os.unlink(name)  # at once: nothing is left behind even if the process is killed now
        return fd


def stored_probe(entry: object) -> ProbeResult | None:
    """A ProbeResult from one entry of the probe store, or None if it is not one (a hand-edited or
    torn store: a missing field, a rate of 0, lanes 0 ended in an internal error)."""
    if not isinstance(entry, dict) or not {"mib_s", "slice_bytes", "lanes", "mode", "reads", "how"} <= entry.keys():
        return None
    ok = (isinstance(entry["mib_s"], int | float) and not isinstance(entry["mib_s"], bool)
          and math.isfinite(entry["mib_s"]) and entry["mib_s"] > 0
          and all(isinstance(entry[k], int) and not isinstance(entry[k], bool) and entry[k] >= 1
                  for k in ("slice_bytes", "lanes", "reads"))
          and isinstance(entry["mode"], str) and isinstance(entry["how"], str)
          and isinstance(entry.get("fresh", False), bool) and entry.keys() <= set(ProbeResult.__dataclass_fields__))
    return ProbeResult(**entry) if ok else None


def read_store() -> dict[str, object]:
    """The probe store (``cache_dir()/probe.json``), or nothing if it is missing or not a JSON object."""
    try:
        known = json.loads((cache_dir() / "probe.json").read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return known if isinstance(known, dict) else {}


def measure(directory: Path, slice_bytes: int, lanes: int, reads: int = 256) -> ProbeResult:
    """Random reads of ``slice_bytes`` (at most ``MAX_PROBE_SLICE``) with ``lanes`` threads over a
    fresh, unnamed scratch file of at most ``MAX_SCRATCH_BYTES``."""
    if slice_bytes < 1 or lanes < 1:
        raise ValueError(f"probe needs slice_bytes >= 1 and lanes >= 1, got {slice_bytes}, {lanes}")
    directory.mkdir(parents=True, exist_ok=True)
    asked = slice_bytes
    slice_bytes = min(slice_bytes, MAX_PROBE_SLICE)
    size = min(max(_SCRATCH_BYTES, 8 * slice_bytes), MAX_SCRATCH_BYTES)
    fd = _unnamed_scratch(directory)
    scratch = Path(f"/proc/self/fd/{fd}")
    try:
        block = os.urandom(MiB)
        for _ in range(-(-size // MiB)):
            os.write(fd, block)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        reader = ShardReader([scratch], direct=True)
        try:
            reader.verify(0, 0, min(slice_bytes, size))
            rng = random.Random(0)
            span = size - slice_bytes
            jobs = [(0, rng.randrange(0, span // 4096) * 4096, slice_bytes) for _ in range(reads)]
            total, elapsed = _timed_reads(reader, jobs, lanes)
            mode = reader.mode
        finally:
            reader.close()
    finally:
        os.close(fd)
    capped = f" (asked {asked}: measured at the {MAX_PROBE_SLICE // MiB} MiB cap)" if asked > slice_bytes else ""
    return ProbeResult(
        total / MiB / elapsed, asked, lanes, mode, reads,
        f"{reads} random {mode} reads of {slice_bytes} bytes{capped}, {lanes} lanes, on a "
        f"{size // MiB} MiB unnamed scratch file in {directory}; bytes transferred over wall time",
    )


def measure_model(layout: ModelLayout, lanes: int, reads: int = 256, *, fresh: bool = False) -> ProbeResult:
    """Random direct reads of the model's own expert slices (one projection of one expert each,
    as the engine reads them), distinct slices drawn at random across every MoE layer.

    Each lane reads into one buffer of its own, reused (as a warm cache's misses land in recycled
    pages); ``fresh``: each read into pages never touched before (as a fresh cache's misses land,
    the kernel faulting them in while the read copies), which costs a machine its first-touch rate
    on top of the transfer.

    What a benchmark's read figures are compared with: a scratch file just written can be served
    from a cache below the guest (a virtual disk's host), which made one probe read 4x faster
    than the device the model's bytes come from; the model's slices are what the engine reads."""
    if lanes < 1:
        raise ValueError(f"probe needs lanes >= 1, got {lanes}")
    slices = [(e.span.shard, e.file_offset(x), e.stride) for e in layout.experts.values() for x in range(e.n_expert)]
    if not slices:
        raise ValueError("the model has no expert slices to probe")
    # Fresh slices each probe: ones read by an earlier probe (or run) could come from a host cache.
    jobs = random.SystemRandom().sample(slices, min(reads, len(slices)))
    reader = ShardReader(layout.shards, direct=True)
    try:
        total, elapsed = _timed_reads(reader, jobs, lanes, fresh=fresh)
        mode = reader.mode
    finally:
        reader.close()
    sizes = sorted({n for _, _, n in jobs})
    size = f"{sizes[0]} bytes" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]} bytes"
    into = "pages never touched before" if fresh else "one reused buffer per lane"
    return ProbeResult(
        total / MiB / elapsed, sizes[-1], lanes, mode, len(jobs),
        f"{len(jobs)} random {mode} reads of distinct expert slices of the model ({size}), {lanes} lanes, into "
        f"{into}; bytes transferred over wall time", fresh,
    )


def _timed_reads(
    reader: ShardReader, jobs: list[tuple[int, int, int]], lanes: int, *, fresh: bool = False,
) -> tuple[int, float]:
    """Run (shard, offset, nbytes) reads on ``lanes`` threads: (bytes read, seconds). ``fresh``:
    read ``i`` lands in slot ``i`` of one region that nothing touched before, else in its lane's
    buffer."""
    room = align_up(max(n for _, _, n in jobs) + DIRECT_ALIGN, DIRECT_ALIGN)
    regions = [Region(room * len(jobs), 0)] if fresh else [Region(room, 0) for _ in range(lanes)]

    def dest(i: int, off: int) -> int:
        base = regions[0].base + i * room if fresh else regions[i % lanes].base
        return base + off % DIRECT_ALIGN

    try:
        with ThreadPoolExecutor(lanes) as pool:
            t0 = time.perf_counter()
            futures = [
                pool.submit(reader.read_into, shard, off, n, dest(i, off))
                for i, (shard, off, n) in enumerate(jobs)
            ]
            total = sum(f.result() for f in futures)
            return total, time.perf_counter() - t0
    finally:
        for r in regions:
            r.close()


def _store_key(directory: Path, slice_bytes: int, lanes: int) -> str:
    return f"{os.stat(directory).st_dev}:{slice_bytes}:{lanes}"


def stored_rate(directory: Path, slice_bytes: int, lanes: int) -> ProbeResult | None:
    """The probe stored for this device, slice size and lane count, if a valid one is (no I/O
    beyond the store)."""
    try:
        key = _store_key(directory, slice_bytes, lanes)
    except OSError:
        return None
    return stored_probe(read_store().get(key))


def cached_probe(directory: Path, slice_bytes: int, lanes: int) -> ProbeResult:
    """The probe for this device, slice size and lane count, measured on first use."""
    stored = stored_rate(directory, slice_bytes, lanes)
    if stored is not None:
        return stored
    result = measure(directory, slice_bytes, lanes)  # none, or not a valid one: measured again
    known = read_store()
    known[_store_key(directory, slice_bytes, lanes)] = asdict(result)
    store = cache_dir() / "probe.json"
    store.parent.mkdir(parents=True, exist_ok=True)
    replace_with_text(store, json.dumps(known, indent=1))  # two runs never tear the store
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
