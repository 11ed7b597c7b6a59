"""The expert cache: which (layer, expert) entries are resident, under a byte budget.

Pure policy with no native dependencies: it decides hits, misses and evictions; the stages carry
them out. An entry is one expert of one layer with all its projections, because a routed expert
always needs all of them. The budget is a promise between layers; while a layer is being served,
its own routed set is pinned and may push residency over the budget (a prefill batch can route more
experts than a small budget holds), and ``trim`` brings it back once the decode step is over.
A budget of 0 is "cache off": every routed expert is read every time it is used.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence, Set
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from bmoe.errors import BudgetError

Entry = tuple[int, int]  # (layer, expert)


class EvictionPolicy(Protocol):
    """Orders resident entries for eviction; sees every use, never decides sizes.

    ``victims`` yields candidates best-to-evict first, lazily: the cache takes them one at a time
    while it is over its limit, skips the entries pinned by the layer being served, and calls
    ``removed`` for each one it evicts. It never holds the iterator across other calls.

    A policy may also define any of these optional hooks (``ExpertCache`` calls them when present):

    - ``configure(budget_bytes, entry_bytes)``: at construction and whenever the budget changes;
    - ``routed(layer, experts, ranks)``: first thing in every ``plan``, with the layer's routed
      set (a position in the layer cycle, the current layer's pinned set) and, when known, each
      expert's best router rank (0 = the highest weight; None when the caller has none);
    - ``step_end()``: at each ``trim``, i.e. between llama_decode calls;
    - ``served(visits)``: a run of (layer, routed ids) whose every entry is resident, to be taken
      as ``routed`` then ``used`` of each, in order; True when it did, False (nothing changed)
      when it cannot do so exactly (``ExpertCache.serve_resident``).
    """

    name: str

    def used(self, entry: Entry) -> None: ...

    def admitted(self, entry: Entry) -> None: ...

    def removed(self, entry: Entry) -> None: ...

    def victims(self) -> Iterator[Entry]: ...


def _noop(*_args: object) -> None:
    return None


@dataclass(frozen=True)
class Plan:
    layer: int
    hits: tuple[int, ...]
    misses: tuple[int, ...]
    evictions: tuple[Entry, ...]


class ExpertCache:
    """One writer only: the prefetch stage. Other threads may read ``is_resident``."""

    def __init__(
        self, budget_bytes: int, entry_bytes: Mapping[int, int], policy: EvictionPolicy
    ) -> None:
        if budget_bytes < 0:
            raise BudgetError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._entry_bytes = dict(entry_bytes)
        self._policy = policy
        self._routed = getattr(policy, "routed", _noop)
        self._step_end = getattr(policy, "step_end", _noop)
        self._configure = getattr(policy, "configure", _noop)
        self._served = getattr(policy, "served", None)
        self._configure(budget_bytes, self._entry_bytes)
        self._resident: set[Entry] = set()
        # Read ahead of need and not used yet, oldest first, outside the policy. An entry is
        # ahead until its layer is planned without it; then it is stale and the first to go. An
        # entry still ahead is the last to go: it was read for a layer about to run.
        self._ahead: dict[Entry, None] = {}
        self._stale: dict[Entry, None] = {}
        self.resident_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0
        self.speculated = 0
        self.speculation_useful = 0

    @property
    def policy_name(self) -> str:
        return self._policy.name

    @property
    def policy(self) -> EvictionPolicy:
        return self._policy

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._resident

    def plan(self, layer: int, experts: Iterable[int], ranks: Sequence[int] | None = None) -> Plan:
        """Serve one layer's routed set: hits are used, misses admitted, room made by eviction.
        ``ranks``: per expert, its best router rank, passed on to the policy."""
        routed = tuple(experts)
        self._routed(layer, routed, None if ranks is None else tuple(ranks))
        hits = tuple(e for e in routed if (layer, e) in self._resident)
        misses = tuple(e for e in routed if (layer, e) not in self._resident)
        for e in hits:
            if self._unspeculate((layer, e)):  # read ahead, now needed: the policy takes it on
                self.speculation_useful += 1
                self._policy.admitted((layer, e))
            else:
                self._policy.used((layer, e))
        for entry in [a for a in self._ahead if a[0] == layer]:  # guessed wrong: now stale
            del self._ahead[entry]
            self._stale[entry] = None
        need = len(misses) * self._entry_bytes[layer]
        pinned = {(layer, e) for e in routed}
        evicted = self._evict_until(self.budget_bytes - need, pinned)
        for e in misses:
            self._resident.add((layer, e))
            self._policy.admitted((layer, e))
        self.resident_bytes += need
        self.hits += len(hits)
        self.misses += len(misses)
        return Plan(layer, hits, misses, evicted)

    def serve_resident(self, visits: Sequence[tuple[int, np.ndarray]]) -> bool:
        """Plan a run of routings in one pass where that is exactly what one ``plan`` each would
        do: every entry resident, nothing read ahead waiting for its layer, no room to make, and a
        policy that takes the run at once (``served``). ``visits``: (layer, routed ids). Each such
        plan is all hits and evicts nothing, so there is nothing to return. False, with nothing
        done, otherwise: then plan them one by one."""
        served = self._served
        if served is None or self._ahead or self.resident_bytes > self.budget_bytes:
            return False
        resident, stale = self._resident, self._stale
        n = 0
        for layer, ids in visits:
            entries = [(layer, e) for e in ids.tolist()]
            if not resident.issuperset(entries):
                return False
            if stale and any(e in stale for e in entries):
                return False  # a read-ahead used at last: plan() counts it as one, not as a hit
            n += ids.size
        if not served(visits):
            return False
        self.hits += n
        return True

    def count_unseen(self, hits: int) -> None:
        """Hits of routings served while every expert was resident and nobody looked at which
        (``UnseenHits``): counted, nothing planned, the policy not told."""
        self.hits += hits

    def speculate(self, entry: Entry, protect: set[Entry]) -> tuple[bool, tuple[Entry, ...]]:
        """Admit an entry read ahead of need, if room can be made without touching ``protect``
        (the layer being served and the other read-ahead candidates). The budget holds: nothing is
        admitted over it. The entry stays out of the policy until a plan uses it."""
        if entry in self._resident:
            return False, ()
        need = self._entry_bytes[entry[0]]
        if need > self.budget_bytes:
            return False, ()
        evicted = self._evict_until(self.budget_bytes - need, protect)
        if self.resident_bytes + need > self.budget_bytes:
            return False, evicted
        self._resident.add(entry)
        self._ahead[entry] = None
        self.resident_bytes += need
        self.speculated += 1
        return True, evicted

    def fill(self, entry: Entry) -> bool:
        """Admit an entry into free room only, never evicting anything, as read ahead of need (a
        cache profile's guess: it gives way to real routing, stale once its layer is planned
        without it). False when it is resident already or does not fit in what is free."""
        if entry in self._resident or self.resident_bytes + self._entry_bytes[entry[0]] > self.budget_bytes:
            return False
        admitted, evicted = self.speculate(entry, set())
        assert not evicted, "a fill never evicts"
        return admitted

    def discard(self, entry: Entry) -> None:
        """Forget an entry whose read failed or was dropped: it must never count as a hit."""
        if entry in self._resident:
            self._remove(entry)

    def trim(self) -> tuple[Entry, ...]:
        """Evict down to the budget once no layer is pinned (end of a decode step). Read-ahead
        whose layer never ran in the step (an aborted decode) is stale now too."""
        self._step_end()
        self._stale.update(self._ahead)
        self._ahead.clear()
        return self._evict_until(self.budget_bytes, frozenset())

    def set_budget(self, budget_bytes: int) -> tuple[Entry, ...]:
        if budget_bytes < 0:
            raise BudgetError(f"cache budget must be >= 0 bytes, got {budget_bytes}")
        self.budget_bytes = budget_bytes
        self._configure(budget_bytes, self._entry_bytes)
        return self._evict_until(self.budget_bytes, frozenset())

    def _evict_until(self, limit: int, pinned: set[Entry] | frozenset[Entry]) -> tuple[Entry, ...]:
        if self.resident_bytes <= limit:
            return ()
        evicted: list[Entry] = []
        self._evict_from(iter(list(self._stale)), limit, pinned, evicted)
        candidates = self._policy.victims()
        try:
            self._evict_from(candidates, limit, pinned, evicted)
        finally:
            close = getattr(candidates, "close", None)
            if close is not None:
                close()
        self._evict_from(iter(list(self._ahead)), limit, pinned, evicted)
        self.evictions += len(evicted)
        return tuple(evicted)

    def _evict_from(self, candidates: Iterator[Entry], limit: int, pinned: Set[Entry], evicted: list[Entry]) -> None:
        """Ask for the next victim only while over the limit: every candidate handed out is either
        evicted or skipped as pinned, never silently dropped."""
        while self.resident_bytes > limit:
            entry = next(candidates, None)
            if entry is None:
                return
            if entry in pinned or entry not in self._resident:
                continue
            self._remove(entry)
            evicted.append(entry)

    def _remove(self, entry: Entry) -> None:
        self._resident.remove(entry)
        if not self._unspeculate(entry):
            self._policy.removed(entry)
        self.resident_bytes -= self._entry_bytes[entry[0]]

    def _unspeculate(self, entry: Entry) -> bool:
        """Drop ``entry`` from the read-ahead sets; whether it was in one."""
        for group in (self._ahead, self._stale):
            if entry in group:
                del group[entry]
                return True
        return False
