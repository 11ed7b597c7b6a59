"""Prefetch: the single writer of cache state. For each routing event it plans hits, misses and
evictions, releases what is evicted, issues the misses as read requests (projection by projection,
in the order the graph consumes them) and hands the layer's readiness futures to the ready stage;
with read-ahead on, it also admits and reads experts a later layer is expected to route. It only
evicts while the compute thread waits on it, so no page is released under a running matmul.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

from bmoe.pipeline.boundary import SERIAL, ComputeModes, FastHit, UnseenHits
from bmoe.pipeline.cache import ExpertCache, Plan
from bmoe.pipeline.channel import Channel
from bmoe.pipeline.events import (
    PHASE_DECODE,
    ExpertKey,
    GateItem,
    ReadAhead,
    ReadItem,
    ReadRequest,
    RoutingEvent,
)
from bmoe.pipeline.hooks import Hooks
from bmoe.pipeline.readiness import ReadinessBoard
from bmoe.stages.bind import Residency
from bmoe.stages.ready import LayerReads


class PrefetchStage:
    def __init__(
        self,
        cache: ExpertCache,
        residency: Residency,
        board: ReadinessBoard,
        fast_hits: deque[FastHit | UnseenHits],
        hooks: Hooks,
        modes: ComputeModes = SERIAL,
        between_layers: Callable[[], None] | None = None,
    ) -> None:
        self._cache = cache
        self._residency = residency
        self._board = board
        self._fast_hits = fast_hits
        self._hooks = hooks
        self.cache_s = 0.0  # time spent planning and evicting: the cache writer's own cost
        # Per layer, projections in the order the graph consumes them (found at open); default:
        # the residency's order.
        self._consumption = modes.overlap.consumption if modes.overlap is not None else {}
        # Temporal read-ahead: while a layer is served, read what the previous token routed at
        # the next ``lookahead`` MoE layers into the cache, on idle lanes, within the budget.
        self._lookahead = modes.lookahead
        self._last: dict[int, tuple[int, ...]] = {}  # layer -> experts it routed last time
        self._moe_layers: list[int] = []
        self._predictor = modes.predictor  # scored here against the real routing
        # Admissions per entry: a failed read undoes only the admission it was issued for, never
        # a later one of the same expert read since.
        self._admissions: dict[tuple[int, int], int] = {}
        # Called at each routing event once earlier fast-path layers are accounted and before the
        # layer is planned (the pressure guard): no layer is pinned, the compute thread waits.
        self._between_layers = between_layers
        # Prewarm (``prewarm``): entries still to read into free room, best first, a few at a time.
        self._prewarm: deque[tuple[int, int]] = deque()
        self._prewarm_flight = 0  # entries whose reads are not all resolved yet
        self._prewarm_tries: dict[tuple[int, int], int] = {}
        self._reads: Channel[ReadItem] | None = None  # the running call's read channel

    PREWARM_IN_FLIGHT = 4  # entries read at once: enough to keep lanes busy, few to drop at a call's end

    def prewarm(self, entries: Sequence[tuple[int, int]]) -> None:
        """Read ``entries`` (a cache profile's most used experts, best first) into the cache's free
        room in the background, from the next decode call on: a few at a time as speculative reads,
        so real reads always go first, each landing making way for the next. Nothing is evicted for
        them. A read dropped at the end of a call (its call ended before a lane took it) is offered
        again at the next; the first entry that no longer fits ends the prewarm. Lossless: an
        entry is marked resident for the compute thread only once a plan uses it and its bytes have
        landed, like any read-ahead."""
        self._prewarm = deque(entries)

    def _offer_prewarm(self) -> None:
        reads = self._reads
        while reads is not None and self._prewarm and self._prewarm_flight < self.PREWARM_IN_FLIGHT:
            entry = self._prewarm.popleft()
            if self._cache.is_resident(*entry):
                continue
            if not self._cache.fill(entry):
                self._prewarm.clear()  # no room left: the cache is full of what the run uses
                return
            self.evict((), [entry])
            reads_of_entry = [self._issue(replace(request, speculative=True), entry[1], reads)
                              for request in self._residency.requests(*entry)]
            self._prewarm_flight += 1
            landed = asyncio.gather(*reads_of_entry, return_exceptions=True)
            landed.add_done_callback(lambda outcome, entry=entry: self._prewarm_landed(entry, outcome))

    def _prewarm_landed(self, entry: tuple[int, int], outcome: asyncio.Future[list]) -> None:
        self._prewarm_flight -= 1
        if any(isinstance(r, BaseException) for r in outcome.result()):
            # dropped at a call's end, or failed (the cache forgot it): offered again, twice at most
            tries = self._prewarm_tries[entry] = self._prewarm_tries.get(entry, 0) + 1
            if tries <= 2:
                self._prewarm.appendleft(entry)
        self._offer_prewarm()

    def account_fast_hits(self) -> None:
        """Plan the layers the routing gate served alone because all were resident, in order: the
        cache sees one plan per routed layer, exactly as a replay of the same routing does. A run
        of distinct layers goes to the cache in one pass where it can take it so (a token's
        worth of all-hit layers at a step's end), else one plan each."""
        fast = self._fast_hits
        while fast:
            item = fast.popleft()
            if isinstance(item, UnseenHits):
                self._cache.count_unseen(item.count)
                continue
            run, layers = [item], {item[0]}
            while fast and not isinstance(fast[0], UnseenHits) and fast[0][0] not in layers:
                run.append(fast.popleft())
                layers.add(run[-1][0])
            if self._cache.serve_resident([(layer, experts) for layer, experts, _ in run]):
                for layer, experts, _ in run:
                    self._remember(layer, tuple(experts.tolist()))
                continue
            for layer, experts, ranks in run:
                plan = self._plan(layer, tuple(experts.tolist()), tuple(ranks.tolist()))
                for e in plan.misses:
                    # The gate found it resident and the layer has computed on it, but the cache
                    # has evicted it since: no read follows a replayed plan, so it must not stay
                    # admitted (a later plan would take its slot, pages and all, for a hit).
                    self._cache.discard((layer, e))
                    self._residency.release(layer, e)

    def _plan(self, layer: int, routed: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> Plan:
        """Plan one routed layer, release what it evicts, and remember what it routed."""
        plan = self._cache.plan(layer, routed, ranks)
        self.evict(plan.evictions, [(layer, e) for e in plan.misses])
        self._remember(layer, routed)
        return plan

    def _remember(self, layer: int, routed: tuple[int, ...]) -> None:
        """What the layer routed, for read-ahead of its next visit and the predictor's score."""
        self._last[layer] = routed
        if self._predictor is not None:
            self._predictor.score(layer, routed)

    def evict(self, entries: tuple[tuple[int, int], ...], admitted: Sequence[tuple[int, int]] = ()) -> None:
        """Evict ``entries`` and make way for ``admitted``, the entries about to be read: evicted
        pages go to their slots, unless a read into them may still land (a speculative one, or an
        older read of the entry that a newer one superseded: ``ReadinessBoard.busy``): those are
        only released, since a page moved away under a read would receive its bytes in the other
        slot. Each admission is counted, so a failed read undoes only its own."""
        for entry in admitted:
            self._admissions[entry] = self._admissions.get(entry, 0) + 1
        quiet = []
        for layer, expert in entries:
            keys = (ExpertKey(layer, p, expert) for p in range(self._residency.n_proj(layer)))
            if any(self._board.busy(key) for key in keys):
                self._residency.release(layer, expert)
            else:
                quiet.append((layer, expert))
        self._residency.reuse(quiet, admitted)

    async def run(
        self,
        events: Channel[GateItem],
        reads: Channel[ReadItem],
        layers: Channel[LayerReads],
    ) -> None:
        self._reads = reads
        self._offer_prewarm()
        try:
            async for event in events:
                # Whatever the item, the layers the gate served alone are planned first: until
                # then the cache has not seen their use, and anything this item evicts could be
                # their experts (a late plan then admitted them with no read behind them).
                t0 = time.perf_counter()
                self.account_fast_hits()
                if isinstance(event, ReadAhead):
                    self.cache_s += time.perf_counter() - t0
                    try:
                        self._speculate([(event.layer, event.experts)], set(event.serving), reads)
                    finally:
                        event.planned.set_result(None)
                    continue
                if self._between_layers is not None:
                    self._between_layers()
                plan = self._plan(event.layer, event.experts, event.ranks)
                self.cache_s += time.perf_counter() - t0
                if self._hooks.on_plan:
                    self._hooks.on_plan(event, plan)
                if self._hooks.before_layer_reads:
                    self._hooks.before_layer_reads(event.layer, self._residency.layer_spans(event.layer))
                n_proj = self._residency.n_proj(event.layer)
                by_proj: list[list[asyncio.Future[int]]] = [[] for _ in range(n_proj)]
                issued_at = time.perf_counter()
                # Projection by projection, in the order the graph consumes them, so that under
                # overlap the first matmul's bytes land first.
                requests = [self._residency.requests(event.layer, e) for e in plan.misses]
                for p in self._order(event.layer, n_proj):
                    for expert, per_expert in zip(plan.misses, requests):
                        by_proj[p].append(self._issue(per_expert[p], expert, reads))
                    for e in plan.hits:  # a hit still being read ahead
                        key = ExpertKey(event.layer, p, e)
                        fut = self._board.future(key)
                        if fut is not None:
                            by_proj[p].append(fut)
                            reads.send_nowait(key)  # promote it: a layer waits for it now
                layers.send_nowait(LayerReads(event, plan, by_proj, issued_at))
                if event.ahead is not None:
                    self._speculate([event.ahead], {(event.layer, e) for e in event.experts}, reads)
                if self._lookahead and event.phase == PHASE_DECODE:
                    self._read_ahead(event, reads)
                self._planned(event, plan, by_proj)  # only now: read-ahead may have evicted
        finally:
            self._reads = None
            reads.close()
            layers.close()

    def _read_ahead(self, event: RoutingEvent, reads: Channel[ReadItem]) -> None:
        if not self._moe_layers:
            self._moe_layers = sorted(self._residency.entry_bytes())
        i = self._moe_layers.index(event.layer)
        ahead = [(il, self._last.get(il, ())) for il in self._moe_layers[i + 1 : i + 1 + self._lookahead]]
        self._speculate(ahead, {(event.layer, e) for e in event.experts}, reads)

    def _speculate(self, ahead: list[tuple[int, tuple[int, ...]]], protect: set, reads: Channel[ReadItem]) -> None:
        """Admit and read the candidates the budget has room for, never evicting ``protect``
        (the layer being served) or each other."""
        protect = protect | {(il, e) for il, experts in ahead for e in experts}
        for il, experts in ahead:
            for e in experts:
                admitted, evicted = self._cache.speculate((il, e), protect)
                self.evict(evicted, [(il, e)] if admitted else ())
                if not admitted:
                    continue
                for request in self._residency.requests(il, e):
                    self._issue(replace(request, speculative=True), e, reads)

    def _issue(self, request: ReadRequest, expert: int, reads: Channel[ReadItem]) -> asyncio.Future[int]:
        """Send one read with its readiness future; a failed read leaves no trace in the cache."""
        fut = self._board.expect(request.key)
        entry = (request.key.layer, expert)
        fut.add_done_callback(self._forget_on_failure(entry, self._admissions[entry]))
        reads.send_nowait((request, fut))
        return fut

    def _planned(self, event: RoutingEvent, plan: Plan, by_proj: list[list[asyncio.Future[int]]]) -> None:
        """A layer's reads and read-ahead are issued (a replay's per-expert overlap publishes its
        slices here; a live run has nothing more to do)."""

    def _order(self, layer: int, n_proj: int) -> tuple[int, ...]:
        return self._consumption.get(layer) or tuple(range(n_proj))

    def _forget_on_failure(self, entry: tuple[int, int], admission: int):  # noqa: ANN202
        def done(fut) -> None:  # noqa: ANN001
            failed = fut.cancelled() or fut.exception() is not None
            if failed and self._admissions[entry] == admission:
                self._cache.discard(entry)
                self._residency.release(*entry)

        return done

