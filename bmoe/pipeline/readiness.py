"""Readiness futures: one per expert projection in flight, so a waiter knows exactly which bytes it
needs. Stock llama.cpp can only wait per layer (or per projection under overlap), but keeping the
futures per expert means a native per-expert hook can plug in without changing the stages.
"""

from __future__ import annotations

import asyncio

from bmoe.pipeline.events import ExpertKey


class ReadinessBoard:
    """Futures of reads in flight, keyed by ExpertKey. Lives on the event loop thread."""

    def __init__(self) -> None:
        self._inflight: dict[ExpertKey, asyncio.Future[int]] = {}

    def expect(self, key: ExpertKey) -> asyncio.Future[int]:
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        return fut

    def complete(
        self, key: ExpertKey, fut: asyncio.Future[int], nbytes: int | None, error: BaseException | None
    ) -> None:
        """Resolve the future of one read; a late completion of an abandoned read never touches
        the future of a newer read of the same key."""
        if self._inflight.get(key) is fut:
            del self._inflight[key]
        if fut.done():
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(nbytes or 0)

    def abandon(self, error: BaseException) -> int:
        """Fail every read still in flight; returns how many. Called when the stage that owed
        them ends (a decode aborted mid-read): a future left pending would be found by the next
        decode as "a hit still being read" and waited on forever."""
        pending = [(k, f) for k, f in self._inflight.items() if not f.done()]
        self._inflight.clear()
        for _, fut in pending:
            fut.set_exception(error)
            fut.exception()  # retrieved: an abandoned read is not an unhandled error
        return len(pending)

    def future(self, key: ExpertKey) -> asyncio.Future[int] | None:
        """The future of the read of ``key`` in flight, if there is one."""
        return self._inflight.get(key)
