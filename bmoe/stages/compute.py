"""Compute: the decode driver. ``llama_decode`` runs on one dedicated worker thread (never the loop
thread: the eval callback waits on the loop), and each decode call owns the stage tasks that serve
its routing events, so no task outlives the step that needed it.

That thread is one per process (``compute_thread``), and every llama.cpp decode bmoe makes runs on
it, the open's warm-up decodes included (``on_compute_thread``). llama.cpp's CPU backend computes
with OpenMP, and libgomp keeps a team of worker threads for every thread that ever started a
parallel region, for that thread's life. Once the threads it manages outnumber the CPUs, its
barriers spin about 100 times and then sleep on a futex (GCC's manual, ``GOMP_SPINCOUNT``). One
warm-up decode on the opening thread was enough: a streamed token's threads then slept some 660
times each, and an all-cached decode ran at 0.80x a resident one on 2 cores (``docs/facts.md``).
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from bmoe.errors import ComputeBusyError, GenerationCancelled
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import GateItem

DecodeFn = Callable[[list[int]], None]
T = TypeVar("T")

_shared: tuple[int, ThreadPoolExecutor] | None = None  # (the process it belongs to, the thread)
_shared_lock = threading.Lock()
_here = threading.local()
# Event loops that a decode on the shared compute thread may be waiting on (its eval callback
# waits for reads the loop serves), with how many such decodes are in flight. Touched on the
# loops' own threads only.
_decoding_for: dict[asyncio.AbstractEventLoop, int] = {}


def _mark() -> None:
    _here.compute = True


def compute_thread() -> ThreadPoolExecutor:
    """This process's compute thread (made on first use; a forked child makes its own)."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            _shared = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix="bmoe-compute", initializer=_mark))
        return _shared[1]


def on_compute_thread(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` run on the compute thread, waited for (at once if called there)."""
    if getattr(_here, "compute", False):
        return fn(*args)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        loop = None
    if loop is not None and _decoding_for.get(loop):
        raise ComputeBusyError(
            "a session is generating on this event loop, and a model opened on the loop's thread would "
            "wait for its decode, which waits for the loop: open it with 'await Session.open_async(...)'")
    return compute_thread().submit(fn, *args).result()


class ComputeStage:
    """Runs ``decode`` on ``thread``: by default a thread of its own (a replay's modelled compute,
    which runs no llama.cpp), for sessions the process's ``compute_thread``, which ``close``
    leaves running for the next."""

    def __init__(
        self,
        decode: DecodeFn,
        arm: Callable[[asyncio.AbstractEventLoop, Channel[GateItem] | None, int, int], None],
        disarm: Callable[[], None],
        abort: Callable[[BaseException], None],
        thread: ThreadPoolExecutor | None = None,
    ) -> None:
        self._decode = decode
        self._arm, self._disarm, self._abort = arm, disarm, abort
        self._own = thread is None
        self._thread = thread if thread is not None else ThreadPoolExecutor(1, thread_name_prefix="bmoe-replay")

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
                await self._wait(loop, tokens)  # nothing routed through the loop: it waits on nothing
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
        """A decode whose routing ``loop`` serves: on the shared thread, counted in
        ``_decoding_for`` while in flight, so a blocking wait on that loop is refused, not hung."""
        if self._own:
            await self._wait(loop, tokens)
            return
        _decoding_for[loop] = _decoding_for.get(loop, 0) + 1
        try:
            await self._wait(loop, tokens)
        finally:
            left = _decoding_for.pop(loop) - 1
            if left:
                _decoding_for[loop] = left

    async def _wait(self, loop: asyncio.AbstractEventLoop, tokens: list[int]) -> None:
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
        if self._own:
            self._thread.shutdown(wait=True)
