"""A typed, bounded, closable queue between two stages, with statistics.

Two ends in one object: the producer ``send``s (or ``send_nowait``s from a callback that must not
block), the consumer iterates with ``async for`` until the channel is closed and drained. The bound
is backpressure; the statistics let a run say where items waited.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class ChannelClosed(Exception):
    """Sending on a channel after it was closed."""


@dataclass(frozen=True)
class ChannelStatistics:
    queued: int
    max_size: int
    sent: int
    max_queued: int


class Channel(Generic[T]):
    def __init__(self, max_size: int = 0) -> None:
        self._items: deque[T] = deque()
        self._max_size = max_size
        self._closed = False
        self._readable = asyncio.Event()
        self._writable = asyncio.Event()
        self._writable.set()
        self._sent = 0
        self._max_queued = 0

    def send_nowait(self, item: T) -> None:
        """Enqueue without waiting; ignores the bound, for producers that must never block."""
        if self._closed:
            raise ChannelClosed("channel is closed")
        self._items.append(item)
        self._sent += 1
        self._max_queued = max(self._max_queued, len(self._items))
        self._readable.set()
        if self._max_size and len(self._items) >= self._max_size:
            self._writable.clear()

    async def send(self, item: T) -> None:
        while self._max_size and len(self._items) >= self._max_size and not self._closed:
            await self._writable.wait()
        self.send_nowait(item)

    def close(self) -> None:
        """End of stream: the consumer drains what is queued, then its iteration stops."""
        self._closed = True
        self._readable.set()
        self._writable.set()

    async def receive(self) -> T:
        while not self._items:
            if self._closed:
                raise StopAsyncIteration
            self._readable.clear()
            await self._readable.wait()
        item = self._items.popleft()
        if not self._max_size or len(self._items) < self._max_size:
            self._writable.set()
        return item

    def __aiter__(self) -> Channel[T]:
        return self

    async def __anext__(self) -> T:
        return await self.receive()

    def statistics(self) -> ChannelStatistics:
        return ChannelStatistics(len(self._items), self._max_size, self._sent, self._max_queued)
