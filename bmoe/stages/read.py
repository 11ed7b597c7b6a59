"""Read: I/O lanes. Each request is a positioned read of one expert projection straight into its
region slice, on a pool of lane threads (``os.preadv`` releases the GIL); each completion resolves
that key's readiness future on the event loop.

A lane takes its reads in batches, one thread hop per batch rather than per slice: the loop's work
per hop (executor hand-off, future chaining, task switches) is paid on the critical path of every
missed layer (with reads skipped, the serial stall fell from 8.1 to 7.2 ms per token on the
bench/overlap.py model). A batch is the lane's fair share of the queued run of one (layer,
projection) - the unit overlap waits on - or the queued projections of one speculative expert.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import takewhile
from typing import Protocol

from bmoe.errors import ReadError
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import MAX_PROJ, ExpertKey, ReadRequest
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.readiness import ReadinessBoard


class Reader(Protocol):
    """Fills ``dest`` with file bytes; called on a lane thread, blocks, returns bytes transferred."""

    def read_into(self, shard: int, offset: int, nbytes: int, dest: int) -> int: ...


@dataclass
class ReadCounters:
    slices: int = 0
    bytes_read: int = 0  # bytes transferred from the file (O_DIRECT reads whole aligned pages)
    slice_bytes: int = 0  # bytes of the slices asked for
    busy_s: float = 0.0  # summed lane time inside reads
    speculative_bytes: int = 0  # of bytes_read, those read ahead of need (prefetch)


class ReadStage:
    def __init__(
        self, reader: Reader, lanes: ThreadPoolExecutor, n_lanes: int, board: ReadinessBoard, hooks: Hooks
    ) -> None:
        self._reader = reader
        self._lanes = lanes
        self._n_lanes = n_lanes
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

    async def run(self, reads: Channel[tuple[ReadRequest, asyncio.Future[int]] | ExpertKey]) -> None:
        """Lanes pull real reads first and speculative ones only when no real read waits. A key
        sent alone promotes its queued speculative read (a real layer now needs it). A newer read
        of a key drops its queued speculative one (the entry was evicted and admitted again): the
        old read would otherwise run later, into a slot whose pages may have moved on. When the
        channel closes, speculative reads still queued are dropped: their layers have run. Every
        read's future is resolved by the time this returns, so none is left counted as in flight."""
        loop = asyncio.get_running_loop()
        real: deque[tuple[ReadRequest, asyncio.Future[int]]] = deque()
        spec: dict[ExpertKey, tuple[ReadRequest, asyncio.Future[int]]] = {}
        wake = asyncio.Event()
        closed = False

        async def feed() -> None:
            nonlocal closed
            async for item in reads:
                if isinstance(item, ExpertKey):
                    queued = spec.pop(item, None)
                    if queued is not None:
                        real.append(queued)
                else:
                    stale = spec.pop(item[0].key, None)
                    if stale is not None:
                        self._drop(stale, "superseded by a newer read of it")
                    if item[0].speculative:
                        spec[item[0].key] = item
                    else:
                        real.append(item)
                wake.set()
            closed = True
            for queued in spec.values():
                self._drop(queued, "dropped")
            spec.clear()
            wake.set()

        idle = 0

        def take() -> list[tuple[ReadRequest, asyncio.Future[int]]]:
            if real:
                group = real[0][0].key[:2]  # (layer, projection)
                run = sum(1 for _ in takewhile(lambda item: item[0].key[:2] == group, real))
                return [real.popleft() for _ in range(-(-run // (idle + 1)))]
            layer, _, expert = next(iter(spec))
            keys = [ExpertKey(layer, p, expert) for p in range(MAX_PROJ)]
            return [spec.pop(k) for k in keys if k in spec]

        async def lane() -> None:
            nonlocal idle
            while True:
                if real or spec:
                    batch = take()
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
                        self._fail(request, ready, ReadError(f"read of {request.key} cancelled"))
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
                for _ in range(self._n_lanes):
                    tg.create_task(lane())
        finally:
            # Whatever this decode's stage still owed (queued, or on a lane when a failure or a
            # cancel stopped it) fails now, so its cache entry is forgotten; the next decode reads
            # it again instead of waiting for a completion that will never come.
            abandoned = ReadError("read abandoned: the decode that needed it stopped")
            for request, ready in [*real, *spec.values()]:
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
