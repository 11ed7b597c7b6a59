"""The routing gate: where a compute thread hands a layer's routing to the pipeline and waits.

Both compute drivers use it: the eval callback of a live llama.cpp decode, and the modelled
compute of a trace replay. ``route`` runs on the compute thread. If every routed expert of the layer
is resident it returns at once (no event, no hop: the fast path); otherwise it posts a
RoutingEvent to the event loop and blocks on the event's reply until the bytes are in place or an
error says they never will be. ``abort`` (from any thread) fails every waiting event and makes the
gate refuse further work until the next ``arm``, so a decode stops at its next routing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Protocol

import numpy as np

from bmoe.errors import DecodeAbortedError
from bmoe.pipeline.boundary import SERIAL, ComputeModes, FastHit, FastPath, UnseenHits
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import (
    PHASE_DECODE,
    GateItem,
    ReadAhead,
    RoutingEvent,
    routed_set,
)


class NativeRouting(Protocol):
    """A routing fast path in native code in front of the gate (the C node filter): it serves a
    routing of resident experts itself and logs it; the gate drains the log into its fast-path
    hits before any routing of its own, so the cache sees every routing in order."""

    def drain(self) -> list[FastHit | UnseenHits]: ...

    def set_fast(self, on: bool) -> None: ...


class RoutingGate:
    """``modes`` fixes, for the gate's life, where routing waits and what observes it;
    ``fast_path`` is what it shares with the loop (none: a gate that never routes, for warm-up
    and resident runs)."""

    # What a routing that misses posts; a replay's modelled per-expert overlap posts its own.
    event_type: type[RoutingEvent] = RoutingEvent

    def __init__(self, modes: ComputeModes = SERIAL, fast_path: FastPath | None = None,
                 ahead_reads: Callable[[int, float], int | None] | None = None) -> None:
        self.fast_path = fast_path if fast_path is not None else FastPath.over([])
        self._resident = self.fast_path.resident
        self._fast_hits = self.fast_path.hits  # accounted by the cache writer on the loop thread
        self._loop: asyncio.AbstractEventLoop | None = None
        self._events: Channel[GateItem] | None = None
        self._pending: set[RoutingEvent] = set()
        self.error: BaseException | None = None
        self.aborting = False
        self.step = 0
        self.phase = PHASE_DECODE
        self.blocked_s = 0.0  # compute thread time spent waiting for the pipeline
        self.modes = modes
        # Copied out of ``modes``: ``route`` reads plain attributes, one lookup each.
        self._tap = modes.tap
        # Overlap: per layer, the projection to wait for at routing (the first one consumed); the
        # rest are waited for by ``wait_proj`` at the matmul nodes. None: serial, wait for all.
        self._first_proj = modes.overlap.first_proj() if modes.overlap is not None else None
        self._last_proj = modes.overlap.last_proj() if modes.overlap is not None else {}
        self._open: dict[int, RoutingEvent] = {}
        # Predictive read-ahead: a prediction waiting for the next routing event to carry it.
        self._ahead: tuple[int, tuple[int, ...]] | None = None
        # How many of a layer's experts reads land in a given time (layer, seconds -> count; None
        # before any read is measured), from the streamer. A batch's read-ahead is cut to what
        # lands while the layer computes (see ``predict``).
        self.ahead_reads = ahead_reads
        self._resumed: float | None = None  # when compute last resumed after a routing
        self._blocked_at_resume = 0.0
        self.native: NativeRouting | None = None  # set by the eval callback when C serves routings

    def arm(
        self, loop: asyncio.AbstractEventLoop, events: Channel[GateItem] | None, step: int, phase: int
    ) -> None:
        """Prepare for one decode call: where to send events (None: nothing streams), which step."""
        self._loop, self._events = loop, events
        self.step, self.phase = step, phase
        self.error = None
        self.aborting = False
        self._open.clear()
        self._pending.clear()
        self._ahead = None
        self._resumed = None

    def disarm(self) -> None:
        self._loop = self._events = None

    def abort(self, error: BaseException) -> None:
        """Stop the running decode and unblock a compute thread waiting on the loop."""
        if self.error is None:
            self.error = error
        self.aborting = True
        if self.native is not None:
            self.native.set_fast(False)  # the next routing reaches Python, which stops the graph
        for event in list(self._pending):
            event.fail(error)

    def route(self, layer: int, rows: np.ndarray, ranks: np.ndarray | None = None) -> None:
        """Serve one layer's routing (``rows``: routed ids, one row per token, in the router's
        order); blocks until ready. ``ranks`` (replay) overrides the ranks the rows' order gives."""
        if self.native is not None:
            self.drain_native()
        experts, row_ranks = routed_set(rows)
        if ranks is None:
            ranks = row_ranks
        resident = self._resident[layer][experts]
        ahead, self._ahead = self._ahead, None
        if resident.all():
            self._fast_hits.append((layer, experts, ranks))
            if self._tap is not None:
                self._tap(self.step, self.phase, layer, rows, experts, resident, 0.0)
            if ahead is not None:
                self._read_ahead(*ahead, frozenset((layer, e) for e in experts.tolist()))
            self._resume()
            return
        loop, events = self._loop, self._events
        if loop is None or events is None:
            raise DecodeAbortedError("routing event outside an armed decode")
        event = self.event_type(layer, tuple(experts.tolist()), self.step, self.phase, ahead=ahead,
                                ranks=tuple(ranks.tolist()))
        self._pending.add(event)
        t0 = time.perf_counter()
        gate_on, keep_open = self._wait_point(event, layer)
        done = False
        try:
            if self.aborting:  # abort() ran before the event was registered: it saw no event
                raise self.error or DecodeAbortedError("decode aborted")
            loop.call_soon_threadsafe(events.send_nowait, event)
            waited = self._wait(gate_on, t0)
            done = not keep_open
        finally:
            if done or self.aborting:
                self._pending.discard(event)
            else:
                self._open[layer] = event
        if self._tap is not None:
            self._tap(self.step, self.phase, layer, rows, experts, resident, waited)
        self._resume()

    def _resume(self) -> None:
        self._resumed, self._blocked_at_resume = time.perf_counter(), self.blocked_s

    def _wait_point(self, event: RoutingEvent, layer: int) -> tuple[concurrent.futures.Future[None], bool]:
        """What a missed layer's routing waits for, and whether the layer stays open for waits
        later in its compute (overlap: the first projection consumed; serial: every byte)."""
        first = self._first_proj.get(layer) if self._first_proj is not None else None
        if first is None:
            return event.reply, False
        return event.proj_ready[first], True

    def drain_native(self) -> None:
        """Take the routings the native fast path served since last time into the fast-path hits,
        in order (on the compute thread, or while no decode runs)."""
        if self.native is not None:
            self._fast_hits.extend(self.native.drain())

    def wait_proj(self, layer: int, proj: int) -> None:
        """Overlap: block until projection ``proj`` of the layer's routed experts is in place."""
        event = self._open.get(layer)
        if event is None:  # the layer was all resident: nothing to wait for
            return
        try:
            self._wait(event.proj_ready[proj], time.perf_counter())
        finally:
            if proj == self._last_proj.get(layer) or self.aborting:
                del self._open[layer]
                self._pending.discard(event)

    def predict(self, layer: int, experts: np.ndarray, batch: bool = False) -> None:
        """Keep a prediction of a later layer's experts for the next routing to carry: with its
        event if that layer misses, else alone. Experts already resident need nothing, so a warm
        cache costs no round trip.

        A batch's prediction (a prompt's union, surest first) is cut to what the reads can land
        while this layer computes, the compute since the last routing standing for it: the
        read-ahead only gains by overlapping that compute, and a guess beyond it is read no sooner
        than if it were asked for, while a wrong one takes a lane the real misses need. Measured
        on a cold 5-token prompt at full depth: 3.24 s with the whole union read ahead against
        2.42 s without read-ahead (``docs/facts.md``)."""
        missing = experts[~self._resident[layer][experts]]
        if batch and missing.size:
            if self.ahead_reads is not None and self._resumed is not None:
                computed = time.perf_counter() - self._resumed - (self.blocked_s - self._blocked_at_resume)
                fit = self.ahead_reads(layer, computed)
                if fit is not None:
                    missing = missing[:fit]
            # Read in file order (experts lie in id order in the file): in vote order a warm
            # 200-token prompt ran 10-15 % slower.
            missing = np.sort(missing)
        if missing.size:
            self._ahead = (layer, tuple(missing.tolist()))

    def read_ahead(self, layer: int, experts: tuple[int, ...], serving: frozenset[tuple[int, int]]) -> None:
        """Have ``experts`` of ``layer`` read into the cache's room, sparing ``serving`` (what the
        compute thread is about to use); returns once planned, before the bytes land. The
        expert-major prefill reads its next group this way while it computes the current one."""
        self._read_ahead(layer, experts, serving)

    def _read_ahead(self, layer: int, experts: tuple[int, ...], serving: frozenset[tuple[int, int]]) -> None:
        """Hand a prediction to the prefetch stage and wait until it is planned (not read): its
        evictions must happen while this thread computes nothing, and spare the layer served."""
        loop, events = self._loop, self._events
        if loop is None or events is None or self.aborting:
            return
        if self.native is not None:
            self.drain_native()
        ahead = ReadAhead(layer, experts, serving)
        t0 = time.perf_counter()
        loop.call_soon_threadsafe(events.send_nowait, ahead)
        self._wait(ahead.planned, t0)

    def _wait(self, fut: concurrent.futures.Future[None], since: float) -> float:
        """Block on ``fut`` (raising its error), counting the time since ``since`` as blocked."""
        try:
            fut.result()
        finally:
            waited = time.perf_counter() - since
            self.blocked_s += waited
        return waited
