"""Who generates now: up to ``slots`` generations at once on one session (its ``parallel``
sequences, which the engine's step scheduler decodes together), the others waiting in arrival
order in a bounded wait list. A request that finds the list full is refused at once (503 with
Retry-After) instead of queueing without bound. With one slot, one generation at a time."""

from __future__ import annotations

import asyncio


class QueueFull(Exception):
    """Every place in the wait list is taken."""


class Turns:
    def __init__(self, max_waiting: int, slots: int = 1) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        if slots < 1:
            raise ValueError("slots must be >= 1")
        self.max_waiting = max_waiting
        self.slots = slots
        # FIFO: asyncio's semaphore wakes its waiters in the order they came.
        self._free = asyncio.Semaphore(slots)
        self._admitted = 0  # waiting or running
        self._running = 0

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet running (the queue depth)."""
        return self._admitted - self._running

    @property
    def running(self) -> int:
        """Generations running now (at most ``slots``)."""
        return self._running

    def admit(self) -> None:
        """Take a place in the list, or raise QueueFull. Every admit is paired with ``leave``."""
        if self._admitted >= self.max_waiting + self.slots:
            raise QueueFull
        self._admitted += 1

    async def wait_turn(self) -> None:
        await self._free.acquire()
        self._running += 1

    def leave(self, had_turn: bool) -> None:
        self._admitted -= 1
        if had_turn:
            self._running -= 1
            self._free.release()
