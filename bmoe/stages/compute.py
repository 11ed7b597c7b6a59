"""Compute: the decode driver. ``llama_decode`` runs on one dedicated worker thread (never the loop
thread: the eval callback waits on the loop), and each decode call owns the stage tasks that serve
its routing events, so no task outlives the step that needed it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from bmoe.errors import GenerationCancelled
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import GateItem

DecodeFn = Callable[[list[int]], None]


class ComputeStage:
    def __init__(
        self,
        decode: DecodeFn,
        arm: Callable[[asyncio.AbstractEventLoop, Channel[GateItem] | None, int, int], None],
        disarm: Callable[[], None],
        abort: Callable[[BaseException], None],
    ) -> None:
        self._decode = decode
        self._arm, self._disarm, self._abort = arm, disarm, abort
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bmoe-compute")

    async def decode(
        self,
        tokens: list[int],
        step: int,
        phase: int,
        serve: Callable[[Channel[GateItem]], list] | None,
    ) -> None:
        """Decode one batch; ``serve`` starts the stage coroutines that answer its routing events."""
        loop = asyncio.get_running_loop()
        if serve is None:
            self._arm(loop, None, step, phase)
            try:
                await self._run(loop, tokens)
            finally:
                self._disarm()
            return
        events: Channel[GateItem] = Channel()
        self._arm(loop, events, step, phase)
        try:
            async with asyncio.TaskGroup() as tg:
                for coro in serve(events):
                    tg.create_task(coro)
                try:
                    await self._run(loop, tokens)
                finally:
                    events.close()
        finally:
            self._disarm()

    async def _run(self, loop: asyncio.AbstractEventLoop, tokens: list[int]) -> None:
        work = loop.run_in_executor(self._thread, self._decode, tokens)
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            # The thread cannot be cancelled: abort the graph, then wait until it has stopped so the
            # context is never touched by two decodes at once.
            self._abort(GenerationCancelled("generation cancelled"))
            while not work.done():
                try:
                    await asyncio.shield(work)
                except asyncio.CancelledError:
                    continue
                except BaseException:  # noqa: BLE001 - the abort error; the cancel wins
                    break
            if not work.cancelled():
                work.exception()
            raise

    def close(self) -> None:
        self._thread.shutdown(wait=True)
