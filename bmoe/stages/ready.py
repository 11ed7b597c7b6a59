"""Ready: a layer goes back to compute only once every byte it routes to is in place.

For each layer the prefetch stage planned, the ready stage waits for its readiness futures
projection by projection, in the order the graph consumes them, and sets each projection's
``proj_ready`` as it completes (overlap releases a matmul on it); then it marks the layer's experts
resident, in the map the gate's fast path reads, and replies to the waiting compute thread. A
failed read fails the event instead, and the compute thread raises it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from bmoe.errors import ReadError, as_bmoe_error
from bmoe.pipeline.cache import Plan
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import RoutingEvent
from bmoe.stages.bind import Residency, SimResidency


@dataclass(eq=False)
class LayerReads:
    """One planned layer's reads, as the prefetch stage issued them, for the ready stage to wait on."""

    event: RoutingEvent
    plan: Plan
    by_proj: list[list[asyncio.Future[int]]]  # readiness futures, per projection
    issued_at: float  # perf_counter when the layer's reads were issued


class ReadyStage:
    def __init__(self, residency: Residency | SimResidency) -> None:
        self._residency = residency
        # Summed per layer: from issuing its reads to the last one landing. Serial layers never
        # overlap, so bytes over this is the engine's read bandwidth, all lanes together.
        self.read_wall_s = 0.0

    async def run(self, layers: Channel[LayerReads]) -> None:
        async for job in layers:
            event = job.event
            try:
                for p, futures in enumerate(job.by_proj):
                    await asyncio.gather(*futures)
                    if not event.proj_ready[p].done():
                        event.proj_ready[p].set_result(None)
                if job.plan.misses:
                    self.read_wall_s += time.perf_counter() - job.issued_at
            except Exception as exc:  # noqa: BLE001 - delivered to the waiting compute thread
                event.fail(as_bmoe_error(exc, ReadError, "expert read failed"))
                continue
            resident = self._residency.maps[job.plan.layer]
            for e in job.plan.misses + job.plan.hits:
                resident[e] = True
            if not event.reply.done():
                event.reply.set_result(None)
