"""A blocking front over the async Session, for scripts and the sync half of the API.

It runs the session's coroutines on an event loop in a portal thread (anyio's blocking portal), so
sync and async callers share one code path. Like the portal, it refuses to be used from an event
loop thread: blocking there would deadlock the very loop the eval callback waits on.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from anyio.from_thread import start_blocking_portal

from bmoe.engine.aio import loop_backend_options
from bmoe.engine.config import RunConfig
from bmoe.engine.session import Generation, Piece, Session
from bmoe.errors import BmoeError
from bmoe.pipeline.hooks import Hooks


def _refuse_on_loop_thread() -> None:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return
    raise BmoeError("SyncSession blocks: from async code, use Session and await it instead")


async def _next_piece(agen: AsyncIterator[Piece]) -> Piece:
    return await agen.__anext__()


class SyncSession:
    def __init__(self, session: Session) -> None:
        self.session = session
        self._portal_cm = start_blocking_portal("asyncio", loop_backend_options())
        self._portal = self._portal_cm.__enter__()

    @classmethod
    def open(cls, path: str | Path, config: RunConfig | None = None, *, hooks: Hooks | None = None) -> SyncSession:
        return cls(Session.open(path, config, hooks=hooks))

    def stream(self, prompt: str, max_tokens: int = 64, *, stop_at_end: bool = True) -> Iterator[Piece]:
        _refuse_on_loop_thread()
        agen = self.session.stream(prompt, max_tokens, stop_at_end=stop_at_end)
        try:
            while True:
                try:
                    piece = self._portal.call(_next_piece, agen)
                except StopAsyncIteration:
                    return
                yield piece
        finally:
            self._portal.call(agen.aclose)

    def generate(self, prompt: str, max_tokens: int = 64, *, stop_at_end: bool = True) -> Generation:
        _refuse_on_loop_thread()
        return self._portal.call(lambda: self.session.generate(prompt, max_tokens, stop_at_end=stop_at_end))

    def set_cache_budget(self, budget_bytes: int) -> None:
        self.session.set_cache_budget(budget_bytes)

    def close(self) -> None:
        if self._portal_cm is not None:
            self._portal_cm.__exit__(None, None, None)
            self._portal_cm = None
        self.session.close()

    def __enter__(self) -> SyncSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
