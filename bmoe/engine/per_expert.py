"""Modelled per-expert overlap, for trace replays only: what a per-expert readiness hook in the
kernel would allow.

Stock llama.cpp lets the compute thread wait per projection at most (overlap); a replay models
what waiting per expert slice would buy. Its routing returns as soon as the layer is planned, and
the modelled compute then waits slice by slice (``PerExpertGate.wait_expert``). The three pieces
subclass the live event, gate and prefetch stage, so none of this state rides on a live run.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from bmoe.errors import ConfigError, ReadError
from bmoe.pipeline.boundary import SERIAL, ComputeModes, FastPath
from bmoe.pipeline.cache import Plan
from bmoe.pipeline.events import ExpertKey, RoutingEvent
from bmoe.pipeline.gate import RoutingGate
from bmoe.stages.prefetch import PrefetchStage


@dataclass(eq=False)
class PerExpertEvent(RoutingEvent):
    """A routing event whose ``planned`` is set once ``expert_ready`` holds a future per
    (projection, expert), each set when that one slice is in place."""

    planned: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    expert_ready: dict[tuple[int, int], concurrent.futures.Future[None]] = field(default_factory=dict)

    def fail(self, error: BaseException) -> None:
        super().fail(error)
        for fut in (self.planned, *self.expert_ready.values()):
            if not fut.done():
                fut.set_exception(error)


class PerExpertGate(RoutingGate):
    """Routing returns once the layer is planned; the compute waits slice by slice, then closes
    the layer."""

    event_type = PerExpertEvent

    def __init__(self, modes: ComputeModes = SERIAL, fast_path: FastPath | None = None,
                 ahead_reads: Callable[[int, float], int | None] | None = None) -> None:
        if modes.overlap is not None:
            raise ConfigError("overlap waits per projection or per expert, not both")
        super().__init__(modes, fast_path, ahead_reads)

    def _wait_point(self, event: RoutingEvent, layer: int) -> tuple[concurrent.futures.Future[None], bool]:
        assert isinstance(event, PerExpertEvent)
        return event.planned, True

    def wait_expert(self, layer: int, proj: int, expert: int) -> None:
        """Block until one slice of the layer is in place."""
        event = self._open.get(layer)
        if event is None:
            return
        assert isinstance(event, PerExpertEvent)
        self._wait(event.expert_ready[proj, expert], time.perf_counter())

    def close_layer(self, layer: int) -> None:
        event = self._open.pop(layer, None)
        if event is not None:
            self._pending.discard(event)


class PerExpertPrefetch(PrefetchStage):
    """Publishes one thread-safe future per slice of each planned layer, then sets ``planned``."""

    def _planned(self, event: RoutingEvent, plan: Plan, by_proj: list[list[asyncio.Future[int]]]) -> None:
        assert isinstance(event, PerExpertEvent)
        for p in range(len(by_proj)):
            for e in plan.hits + plan.misses:
                ready: concurrent.futures.Future[None] = concurrent.futures.Future()
                inflight = self._board.future(ExpertKey(plan.layer, p, e))
                if inflight is not None:
                    inflight.add_done_callback(partial(_mirror, ready))
                else:
                    ready.set_result(None)
                event.expert_ready[p, e] = ready
        event.planned.set_result(None)


def _mirror(ready: concurrent.futures.Future[None], fut: asyncio.Future[int]) -> None:
    if ready.done():
        return
    if fut.cancelled() or fut.exception() is not None:
        ready.set_exception(fut.exception() if not fut.cancelled() else ReadError("read cancelled"))
    else:
        ready.set_result(None)
