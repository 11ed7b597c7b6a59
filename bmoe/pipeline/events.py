"""What flows between the stages: routing events, expert keys, read requests.

A RoutingEvent is born on the compute thread (inside the eval callback) and crosses to the event
loop; its ``reply`` is the one object both sides touch, a thread-safe future the callback blocks on
until the layer's bytes are in place (or an error says they never will be).

The channels' item types, named at the end: ``GateItem`` (gate -> prefetch: a layer to serve, or
a prediction to read ahead) and ``ReadItem`` (prefetch -> read: a ``ReadJob`` to queue, or a
``Promotion`` of a queued speculative read a layer now waits for).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass, field
from typing import NamedTuple, TypeAlias

import numpy as np

PHASE_PREFILL = 0
PHASE_DECODE = 1
MAX_PROJ = 3  # expert projections per layer: gate, up, down (or gate_up, down)


class ExpertKey(NamedTuple):
    """One projection of one expert of one layer: the unit of a read and of a readiness future."""

    layer: int
    proj: int
    expert: int


@dataclass(eq=False)
class RoutingEvent:
    """The routed experts of one MoE layer for one ubatch, in need of reads."""

    layer: int
    experts: tuple[int, ...]  # sorted union over the ubatch's rows
    step: int  # index of the decode call within the generation
    phase: int  # PHASE_PREFILL or PHASE_DECODE
    reply: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)
    # Per projection (Residency's index): set when that projection's bytes of every routed expert
    # are in place, so overlap can release one matmul while later projections still read.
    proj_ready: tuple[concurrent.futures.Future[None], ...] = field(
        default_factory=lambda: tuple(concurrent.futures.Future() for _ in range(MAX_PROJ))
    )
    # A prediction made before this layer routed: (later layer, its expected experts), read ahead
    # once this layer's own reads are issued. Riding on the event saves the loop a round trip.
    ahead: tuple[int, tuple[int, ...]] | None = None
    # Per expert of ``experts``, its best router rank over the ubatch (0 = the highest weight):
    # llama.cpp's top-k rows are in descending weight order, so a rank is a column of ``rows``.
    ranks: tuple[int, ...] | None = None

    def fail(self, error: BaseException) -> None:
        for fut in (*self.proj_ready, self.reply):
            if not fut.done():
                fut.set_exception(error)


def routed_set(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The unique experts of a layer's top-k rows (sorted by id) and each one's best rank (its
    smallest column: rows are in descending router weight). One stable sort, as ``np.unique``."""
    n_tok, k = rows.shape
    flat = rows.T.ravel()  # rank-major: every token's rank 0 first
    order = np.argsort(flat, kind="stable")
    ids = flat[order]
    first = np.empty(ids.shape[0], dtype=bool)
    first[:1] = True
    np.not_equal(ids[1:], ids[:-1], out=first[1:])
    return ids[first], order[first] // max(n_tok, 1)


@dataclass(frozen=True, eq=False)
class ReadAhead:
    """Experts a predictor expects ``layer`` to route: read them into the cache if room allows,
    never evicting ``serving`` (the experts of the layer about to compute, all resident).
    ``planned`` is set once admissions and evictions are done (the reads go on in the background):
    the compute thread waits for it, so no page is released while a matmul might be reading it."""

    layer: int
    experts: tuple[int, ...]
    serving: frozenset[tuple[int, int]]
    planned: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


@dataclass(frozen=True, eq=False)
class ReadRequest:
    """Bytes of one ExpertKey to place at ``dest``; ``speculative`` reads yield to real ones."""

    key: ExpertKey
    shard: int
    offset: int
    nbytes: int
    dest: int
    speculative: bool = False


# gate -> prefetch: a routed layer in need of reads, or a prediction to read ahead.
GateItem: TypeAlias = RoutingEvent | ReadAhead
# prefetch -> read: one read with the readiness future its completion resolves ...
ReadJob: TypeAlias = tuple[ReadRequest, asyncio.Future[int]]
# ... or a key alone: its speculative read, if still queued, is needed by a layer now.
Promotion: TypeAlias = ExpertKey
ReadItem: TypeAlias = ReadJob | Promotion
