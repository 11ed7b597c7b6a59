"""Read: I/O lanes. Each request is a positioned read of one expert projection straight into its
region slice, on a pool of lane threads (``os.preadv`` releases the GIL); each completion resolves
that key's readiness future on the event loop.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from bmoe.errors import ReadError
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import ReadRequest
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


class ReadStage:
    def __init__(
        self, reader: Reader, lanes: ThreadPoolExecutor, board: ReadinessBoard, hooks: Hooks
    ) -> None:
        self._reader = reader
        self._lanes = lanes
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

    async def run(self, reads: Channel[tuple[ReadRequest, asyncio.Future[int]]]) -> None:
        loop = asyncio.get_running_loop()
        inflight: set[asyncio.Future[int]] = set()
        async for request, ready in reads:
            lane = loop.run_in_executor(self._lanes, self._read, request)
            lane.add_done_callback(lambda f, r=request, w=ready: self._done(r, w, f))
            inflight.add(lane)
            lane.add_done_callback(inflight.discard)
        if inflight:
            await asyncio.wait(inflight)

    def _done(self, request: ReadRequest, ready: asyncio.Future[int], lane: asyncio.Future[int]) -> None:
        if lane.cancelled():
            self._board.complete(request.key, ready, None, ReadError(f"read of {request.key} cancelled"))
            return
        exc = lane.exception()
        if exc is not None:
            if not isinstance(exc, ReadError):
                wrapped = ReadError(f"read of {request.key} failed: {exc}")
                wrapped.__cause__ = exc
                exc = wrapped
            self._board.complete(request.key, ready, None, exc)
            return
        n = lane.result()
        self.counters.slices += n > 0
        self.counters.bytes_read += n
        self.counters.slice_bytes += request.nbytes
        self._board.complete(request.key, ready, n, None)
