"""Readiness futures: one per expert projection in flight, so a waiter knows exactly which bytes it
needs. Stock llama.cpp can only wait per layer (or per projection under overlap), but keeping the
futures per expert means a native per-expert hook can plug in without changing the stages.
"""

from __future__ import annotations

import asyncio
from functools import partial

from bmoe.pipeline.events import ExpertKey


class ReadinessBoard:
    """Futures of reads in flight, keyed by ExpertKey. Lives on the event loop thread.

    A key's newest read is the one a layer waits for (``future``); an older read of the same key
    can still be queued or on a lane when a newer one replaces it (a read-ahead evicted, then read
    again for real), and it writes into the slot whenever it runs. ``busy`` counts every read not
    yet resolved, superseded ones included, so no page leaves a slot a read may still land in."""

    def __init__(self) -> None:
        self._inflight: dict[ExpertKey, asyncio.Future[int]] = {}
        self._unresolved: dict[ExpertKey, int] = {}

    def expect(self, key: ExpertKey) -> asyncio.Future[int]:
        fut = asyncio.get_running_loop().create_future()
        self._inflight[key] = fut
        self._unresolved[key] = self._unresolved.get(key, 0) + 1
        fut.add_done_callback(partial(self._resolved, key))
        return fut

    def _resolved(self, key: ExpertKey, _fut: asyncio.Future[int]) -> None:
        left = self._unresolved[key] - 1
        if left:
            self._unresolved[key] = left
        else:
            del self._unresolved[key]

    def busy(self, key: ExpertKey) -> bool:
        """Whether any read of ``key`` issued so far, the newest or one it superseded, is still
        unresolved: its bytes may yet land in the slot. (Resolution is seen one loop step late,
        which only errs on the busy side.)"""
        return key in self._unresolved

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
