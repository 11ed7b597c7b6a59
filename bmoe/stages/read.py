"""Read: I/O lanes. Each request is a positioned read of one expert projection straight into its
region slice, on a pool of lane threads (``os.preadv`` releases the GIL); each completion resolves
that key's readiness future on the event loop.

A lane takes its reads in batches, one thread hop per batch rather than per slice: the loop's work
per hop (executor hand-off, future chaining, task switches) is paid on the critical path of every
missed layer (with reads skipped, the serial stall fell from 8.1 to 7.2 ms per token on the
bench/overlap.py model). A batch is the lane's fair share of the queued run of one (layer,
projection) - the unit overlap waits on - or the queued projections of one speculative expert.
That choice, real before speculative included, is ``ReadQueue``'s, a plain class with no threads
(``tests/test_read_queue.py``); ``ReadStage`` runs the lanes around it.

``limit_reads`` holds a reader to a disk rate (``RunConfig.disk_limit_mib_s``, a test aid that
emulates a slower disk): the cgroup's ``io.max`` where this process may write it, else a
``TokenBucket`` that every lane's read draws on before it lands.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import takewhile
from pathlib import Path
from typing import Protocol

from bmoe.errors import ReadCancelled, ReadError
from bmoe.io.iomax import IoMax, find_io_max
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import MAX_PROJ, ExpertKey, ReadItem, ReadJob, ReadRequest
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.readiness import ReadinessBoard

MiB = 1 << 20


class Reader(Protocol):
    """Fills ``dest`` with file bytes; called on a lane thread, blocks, returns bytes transferred."""

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int: ...


class TokenBucket:
    """A disk of ``rate`` bytes per second, as arithmetic: each read is given the time its bytes
    land on such a disk, serving the reads one after another in the order they reserve, each no
    earlier than it started (less ``burst_s``: how far an idle disk may run ahead). A lane that
    read faster waits until then before its read lands: every lane draws on the one bucket, so
    together they land at most ``rate`` bytes per second whatever their number.

    Thread-safe (one lock around the reservation; the wait is outside it). ``clock`` and ``sleep``
    are ``time.monotonic`` and ``time.sleep`` unless a test hands in a fake clock."""

    def __init__(self, rate: float, burst_s: float = 0.0, clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> None:
        if not rate > 0:
            raise ValueError(f"a token bucket needs a rate above 0 bytes/s, got {rate}")
        self.rate = rate
        self.burst_s = burst_s
        self._clock = clock
        self._sleep = sleep
        self._free_at = float("-inf")  # when the emulated disk finishes what it was given so far
        self._lock = threading.Lock()

    def now(self) -> float:
        return self._clock()

    def land_at(self, nbytes: int, started: float) -> float:
        """Reserve ``nbytes`` for a read that started at ``started``: when they land."""
        with self._lock:
            begin = max(self._free_at, started - self.burst_s)
            self._free_at = begin + nbytes / self.rate
            return self._free_at

    def take(self, nbytes: int, started: float) -> float:
        """Reserve, then wait until the bytes land; the seconds waited."""
        wait = self.land_at(nbytes, started) - self._clock()
        if wait > 0:
            self._sleep(wait)
            return wait
        return 0.0


class BucketReader:
    """A reader whose reads land no faster than ``bucket`` allows: the read runs at the device's
    speed, then waits for its bytes' turn (bytes transferred, O_DIRECT's aligned supersets
    included, as a disk would transfer them). Everything else is the wrapped reader's."""

    def __init__(self, inner: Reader, bucket: TokenBucket, how: str) -> None:
        self.inner = inner
        self.bucket = bucket
        self.limit_how = how
        self.waited_s = 0.0  # summed over lanes; read without a lock: a figure, not an invariant

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
        started = self.bucket.now()
        n = self.inner.read_into(shard, offset, nbytes, dest)
        self.waited_s += self.bucket.take(n, started)
        return n

    def __getattr__(self, name: str) -> object:  # mode, fallback_reason, verify, close, ...
        return getattr(self.inner, name)


class IoMaxReader:
    """A reader of files whose disk a cgroup v2 ``io.max`` limits while it is open: restored on
    ``close``. Everything else is the wrapped reader's."""

    def __init__(self, inner: Reader, io_max: IoMax, how: str, mib_s: float) -> None:
        io_max.apply(mib_s)
        self.inner = inner
        self.io_max = io_max
        self.limit_how = how

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int:
        return self.inner.read_into(shard, offset, nbytes, dest)

    def close(self) -> None:
        try:
            self.io_max.restore()
        finally:
            self.inner.close()  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def disk_limit_plan(paths: Sequence[Path | str], mib_s: float) -> tuple[IoMax | None, str]:
    """How reads of ``paths`` are held to ``mib_s`` MiB/s, and that said in a line: the cgroup's
    ``io.max`` where this process may write it, else (None) a token bucket in the read lanes,
    with the reason ``io.max`` is not used."""
    found = find_io_max(paths)
    if isinstance(found, IoMax):
        return found, (f"cgroup v2 io.max ({found.path}: {found.device} rbps={mib_s:g} MiB/s), which limits every "
                       "process of this cgroup while the session is open")
    return None, bucket_how(mib_s, found)


def bucket_how(mib_s: float, why: str) -> str:
    return (f"a token bucket in the read lanes ({mib_s:g} MiB/s over all lanes: the bytes each read transfers "
            f"land no sooner than a disk of that rate would deliver them); not cgroup io.max: {why}")


def limit_reads(reader: Reader, mib_s: float | None, paths: Sequence[Path | str]) -> Reader:
    """``reader`` with its reads held to ``mib_s`` MiB/s (None: ``reader`` itself), as
    ``disk_limit_plan`` says; the wrapper's ``limit_how`` is that line."""
    if mib_s is None:
        return reader
    io_max, how = disk_limit_plan(paths, mib_s)
    if io_max is not None:
        try:
            return IoMaxReader(reader, io_max, how, mib_s)
        except OSError as e:
            how = bucket_how(mib_s, f"writing {io_max.path} failed: {e.strerror}")
    return BucketReader(reader, TokenBucket(mib_s * MiB), how)


@dataclass
class ReadCounters:
    slices: int = 0
    bytes_read: int = 0  # bytes transferred from the file (O_DIRECT reads whole aligned pages)
    slice_bytes: int = 0  # bytes of the slices asked for
    busy_s: float = 0.0  # summed lane time inside reads
    speculative_bytes: int = 0  # of bytes_read, those read ahead of need (prefetch)


class ReadQueue:
    """What the lanes read next: the read stage's scheduling, with no threads and no loop.

    Real reads go before speculative ones, always: a layer waits on a real read, while a
    speculative one only hopes to be needed. A promotion (a key sent alone) moves its queued
    speculative read to the real queue, since a layer now waits for it. A lane takes a batch, one
    thread hop per batch: its fair share (over itself and the lanes idle now) of the queued run of
    one (layer, projection), the unit overlap waits on, or else of the queued speculative experts,
    each with every queued projection (a prompt's read-ahead queues a layer's worth at once)."""

    def __init__(self) -> None:
        self._real: deque[ReadJob] = deque()
        self._spec: dict[ExpertKey, ReadJob] = {}

    def __bool__(self) -> bool:
        return bool(self._real or self._spec)

    def put(self, item: ReadItem) -> ReadJob | None:
        """Queue ``item``; return the queued speculative read it supersedes, for the caller to
        drop: a newer read of the same key means the entry was evicted and admitted again, and the
        old read, run later, would land in a slot whose pages may have moved on."""
        if isinstance(item, ExpertKey):
            queued = self._spec.pop(item, None)
            if queued is not None:
                self._real.append(queued)
            return None
        stale = self._spec.pop(item[0].key, None)
        if item[0].speculative:
            self._spec[item[0].key] = item
        else:
            self._real.append(item)
        return stale

    def take(self, idle: int = 0) -> list[ReadJob]:
        """The next batch for a lane, while ``idle`` other lanes wait for work (empty: none queued)."""
        real = self._real
        if real:
            group = real[0][0].key[:2]  # (layer, projection)
            run = sum(1 for _ in takewhile(lambda item: item[0].key[:2] == group, real))
            return [real.popleft() for _ in range(-(-run // (idle + 1)))]
        if not self._spec:
            return []
        experts = list(dict.fromkeys((key.layer, key.expert) for key in self._spec))
        out: list[ReadJob] = []
        for layer, expert in experts[: -(-len(experts) // (idle + 1))]:
            keys = [ExpertKey(layer, p, expert) for p in range(MAX_PROJ)]
            out.extend(self._spec.pop(k) for k in keys if k in self._spec)
        return out

    def drop_speculative(self) -> list[ReadJob]:
        """Empty the speculative queue (the stream ended: their layers have run) and return it."""
        dropped = list(self._spec.values())
        self._spec.clear()
        return dropped

    def drain(self) -> list[ReadJob]:
        """Empty both queues and return what they held (the stage is stopping)."""
        left = [*self._real, *self._spec.values()]
        self._real.clear()
        self._spec.clear()
        return left


class ReadStage:
    def __init__(
        self, reader: Reader, lanes: ThreadPoolExecutor, n_lanes: int | Callable[[], int], board: ReadinessBoard,
        hooks: Hooks,
    ) -> None:
        """``n_lanes``: lanes per run, or a function asked at the start of each run (the streamer's:
        more while reads land in fresh pages); ``lanes`` must have that many threads."""
        self._reader = reader
        self._lanes = lanes
        self._n_lanes = n_lanes if callable(n_lanes) else (lambda: n_lanes)
        self._board = board
        self._hooks = hooks
        self.counters = ReadCounters()

    def _read(self, request: ReadRequest) -> int:
        hook = self._hooks.before_read
        if hook is not None and not hook(request):
            return 0
        t0 = time.perf_counter()
        try:
            return self._reader.read_into(request.shard, request.offset, request.nbytes, request.dest)
        finally:
            self.counters.busy_s += time.perf_counter() - t0

    def _read_batch(self, requests: list[ReadRequest]) -> list[int | Exception]:
        """On a lane thread: each request's bytes, or the error that request alone ran into."""
        out: list[int | Exception] = []
        for request in requests:
            try:
                out.append(self._read(request))
            except Exception as exc:  # noqa: BLE001 - delivered through that read's future
                out.append(exc)
        return out

    async def run(self, reads: Channel[ReadItem]) -> None:
        """Lanes pull real reads first and speculative ones only when no real read waits. A key
        sent alone promotes its queued speculative read (a real layer now needs it). A newer read
        of a key drops its queued speculative one (the entry was evicted and admitted again): the
        old read would otherwise run later, into a slot whose pages may have moved on. When the
        channel closes, speculative reads still queued are dropped: their layers have run. Every
        read's future is resolved by the time this returns, so none is left counted as in flight."""
        loop = asyncio.get_running_loop()
        queue = ReadQueue()
        wake = asyncio.Event()
        closed = False

        async def feed() -> None:
            nonlocal closed
            async for item in reads:
                stale = queue.put(item)
                if stale is not None:
                    self._drop(stale, "superseded by a newer read of it")
                wake.set()
            closed = True
            for queued in queue.drop_speculative():
                self._drop(queued, "dropped")
            wake.set()

        idle = 0

        async def lane() -> None:
            nonlocal idle
            while True:
                if queue:
                    batch = queue.take(idle)
                elif closed:
                    return
                else:
                    wake.clear()
                    idle += 1
                    try:
                        await wake.wait()
                    finally:
                        idle -= 1
                    continue
                work = loop.run_in_executor(self._lanes, self._read_batch, [r for r, _ in batch])
                try:
                    outcomes = await asyncio.shield(work)
                except asyncio.CancelledError:
                    # The lane thread cannot be stopped mid-read: wait until its bytes have landed,
                    # so no read writes into a slot after the stage (and the slot's owner) moved on.
                    await _settle(work)
                    for request, ready in batch:
                        self._fail(request, ready, ReadCancelled(f"read of {request.key} cancelled"))
                    raise
                except Exception as exc:  # noqa: BLE001 - the hand-off itself failed: every read did
                    outcomes = [exc] * len(batch)
                for (request, ready), outcome in zip(batch, outcomes):
                    if isinstance(outcome, Exception):
                        self._fail(request, ready, outcome)
                    else:
                        self._landed(request, ready, outcome)

        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(feed())
                for _ in range(self._n_lanes()):
                    tg.create_task(lane())
        finally:
            # Whatever this decode's stage still owed (queued, or on a lane when a failure or a
            # cancel stopped it) fails now, so its cache entry is forgotten; the next decode reads
            # it again instead of waiting for a completion that will never come.
            abandoned = ReadError("read abandoned: the decode that needed it stopped")
            for request, ready in queue.drain():
                self._fail(request, ready, abandoned)
            self._board.abandon(abandoned)

    def _drop(self, queued: tuple[ReadRequest, asyncio.Future[int]], why: str) -> None:
        request, ready = queued
        self._board.complete(request.key, ready, None, ReadError(f"speculative read of {request.key} {why}"))

    def _fail(self, request: ReadRequest, ready: asyncio.Future[int], exc: BaseException) -> None:
        if not isinstance(exc, ReadError):
            wrapped = ReadError(f"read of {request.key} failed: {exc}")
            wrapped.__cause__ = exc
            exc = wrapped
        self._board.complete(request.key, ready, None, exc)

    def _landed(self, request: ReadRequest, ready: asyncio.Future[int], n: int) -> None:
        self.counters.slices += n > 0
        self.counters.bytes_read += n
        self.counters.slice_bytes += request.nbytes
        if request.speculative:
            self.counters.speculative_bytes += n
        self._board.complete(request.key, ready, n, None)


async def _settle(work: asyncio.Future) -> None:
    """Wait for ``work`` to finish whatever cancels arrive meanwhile; its outcome is not wanted."""
    while not work.done():
        try:
            await asyncio.shield(work)
        except BaseException:  # noqa: BLE001 - a repeated cancel, or the work's own error
            continue
    if not work.cancelled():
        work.exception()
