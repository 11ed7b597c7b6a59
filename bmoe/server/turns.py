"""One generation at a time on one context: requests wait their turn in arrival order, in a bounded
wait list. A request that finds the list full is refused at once (503 with Retry-After) instead of
queueing without bound."""

from __future__ import annotations

import asyncio


class QueueFull(Exception):
    """Every place in the wait list is taken."""


class Turns:
    def __init__(self, max_waiting: int) -> None:
        if max_waiting < 0:
            raise ValueError("max_waiting must be >= 0")
        self.max_waiting = max_waiting
        self._lock = asyncio.Lock()  # FIFO: waiters are woken in the order they came
        self._admitted = 0  # waiting or running

    @property
    def waiting(self) -> int:
        """Requests admitted and not yet running (the queue depth)."""
        return self._admitted - (1 if self._lock.locked() else 0)

    @property
    def running(self) -> bool:
        return self._lock.locked()

    def admit(self) -> None:
        """Take a place in the list, or raise QueueFull. Every admit is paired with ``leave``."""
        if self._admitted >= self.max_waiting + 1:
            raise QueueFull
        self._admitted += 1

    async def wait_turn(self) -> None:
        await self._lock.acquire()

    def leave(self, had_turn: bool) -> None:
        self._admitted -= 1
        if had_turn:
            self._lock.release()
