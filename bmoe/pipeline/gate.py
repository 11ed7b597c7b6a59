"""The routing gate: where a compute thread hands a layer's routing to the pipeline and waits.

Both compute drivers use it: the eval callback of a live llama.cpp decode, and the modelled
compute of a trace replay. ``route`` runs on the compute thread. If every routed expert of the layer
is resident it returns at once (no event, no hop: the fast path); otherwise it posts a
RoutingEvent to the event loop and blocks on the event's reply until the bytes are in place or an
error says they never will be. ``abort`` (from any thread) fails every waiting event and makes the
gate refuse further work until the next ``arm``, so a decode can stop at its next node.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from bmoe.errors import DecodeAbortedError
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import PHASE_DECODE, RoutingEvent

# Called on the compute thread for every routed layer when set (route traces): step, phase, layer,
# the routed ids (rows x k), and which of the layer's unique experts were resident beforehand.
Tap = Callable[[int, int, int, np.ndarray, np.ndarray, np.ndarray], None]


class RoutingGate:
    def __init__(self) -> None:
        self._resident: list[np.ndarray] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: Channel[RoutingEvent] | None = None
        self._pending: set[RoutingEvent] = set()
        self.error: BaseException | None = None
        self.aborting = False
        self.step = 0
        self.phase = PHASE_DECODE
        # Layers served by the fast path, for the cache writer to account on the loop thread.
        self.fast_hits: deque[tuple[int, np.ndarray]] = deque()
        self.event_layers = 0
        self.blocked_s = 0.0  # compute thread time spent waiting for the pipeline
        self.tap: Tap | None = None

    def set_resident_maps(self, maps: list[np.ndarray]) -> None:
        """Per layer, a bool per expert that the bind stage keeps true while its bytes are in place."""
        self._resident = maps

    def arm(
        self, loop: asyncio.AbstractEventLoop, events: Channel[RoutingEvent] | None, step: int, phase: int
    ) -> None:
        """Prepare for one decode call: where to send events (None: nothing streams), which step."""
        self._loop, self._events = loop, events
        self.step, self.phase = step, phase
        self.error = None
        self.aborting = False

    def disarm(self) -> None:
        self._loop = self._events = None

    def abort(self, error: BaseException) -> None:
        """Stop the running decode and unblock a compute thread waiting on the loop."""
        if self.error is None:
            self.error = error
        self.aborting = True
        for event in list(self._pending):
            if not event.reply.done():
                event.reply.set_exception(error)

    def route(self, layer: int, rows: np.ndarray) -> None:
        """Serve one layer's routing (``rows``: routed ids, one row per token); blocks until ready."""
        experts = np.unique(rows)
        resident = self._resident[layer][experts]
        if self.tap is not None:
            self.tap(self.step, self.phase, layer, rows, experts, resident)
        if resident.all():
            self.fast_hits.append((layer, experts))
            return
        loop, events = self._loop, self._events
        if loop is None or events is None:
            raise DecodeAbortedError("routing event outside an armed decode")
        event = RoutingEvent(layer, tuple(experts.tolist()), self.step, self.phase)
        self._pending.add(event)
        self.event_layers += 1
        try:
            if self.aborting:  # abort() ran before the event was registered: it saw no event
                raise self.error or DecodeAbortedError("decode aborted")
            t0 = time.perf_counter()
            loop.call_soon_threadsafe(events.send_nowait, event)
            try:
                event.reply.result()
            finally:
                self.blocked_s += time.perf_counter() - t0
        finally:
            self._pending.discard(event)
