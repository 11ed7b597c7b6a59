"""The expert cache: which (layer, expert) entries are resident, under a byte budget.

Pure policy with no native dependencies: it decides hits, misses and evictions; the stages carry
them out. An entry is one expert of one layer with all its projections, because a routed expert
always needs all of them. The budget is a promise between layers; while a layer is being served,
its own routed set is pinned and may push residency over the budget (a prefill batch can route more
experts than a small budget holds), and ``trim`` brings it back once the decode step is over.
A budget of 0 is "cache off": every routed expert is read every time it is used.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from bmoe.errors import BudgetError

Entry = tuple[int, int]  # (layer, expert)


class EvictionPolicy(Protocol):
    """Orders resident entries for eviction; sees every use, never decides sizes.

    ``victims`` yields candidates best-to-evict first, lazily: the cache takes them one at a time
    while it is over its limit, skips the entries pinned by the layer being served, and calls
    ``removed`` for each one it evicts. It never holds the iterator across other calls.

    A policy may also define any of these optional hooks (``ExpertCache`` calls them when present):

    - ``configure(budget_bytes, entry_bytes)``: at construction and whenever the budget changes;
    - ``routed(layer, experts)``: first thing in every ``plan``/``touch``, with the layer's routed
      set (a position in the layer cycle, the current layer's pinned set);
    - ``step_end()``: at each ``trim``, i.e. between llama_decode calls.
    """

    name: str

    def used(self, entry: Entry) -> None: ...

    def admitted(self, entry: Entry) -> None: ...

    def removed(self, entry: Entry) -> None: ...

    def victims(self) -> Iterator[Entry]: ...


class LruPolicy:
    """Least recently used first."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[Entry, None] = OrderedDict()

    def used(self, entry: Entry) -> None:
        self._order.move_to_end(entry)

    def admitted(self, entry: Entry) -> None:
        self._order[entry] = None

    def removed(self, entry: Entry) -> None:
        del self._order[entry]

    def victims(self) -> Iterator[Entry]:
        return iter(list(self._order))


def make_policy(name: str, **kwargs: object) -> EvictionPolicy:
    """A fresh policy by name (see ``bmoe.pipeline.policies.POLICIES``)."""
    from bmoe.pipeline.policies import make_policy as make

    return make(name, **kwargs)


def __getattr__(name: str) -> object:
    if name == "POLICIES":  # the registry lives with the policies; imported lazily (no cycle)
        from bmoe.pipeline.policies import POLICIES

        return POLICIES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        self._configure(budget_bytes, self._entry_bytes)
        self._resident: set[Entry] = set()
        self.resident_bytes = 0
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    @property
    def policy_name(self) -> str:
        return self._policy.name

    def is_resident(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._resident

    def plan(self, layer: int, experts: Iterable[int]) -> Plan:
        """Serve one layer's routed set: hits are used, misses admitted, room made by eviction."""
        routed = tuple(experts)
        self._routed(layer, routed)
        hits = tuple(e for e in routed if (layer, e) in self._resident)
        misses = tuple(e for e in routed if (layer, e) not in self._resident)
        for e in hits:
            self._policy.used((layer, e))
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

    def touch(self, layer: int, experts: Iterable[int]) -> None:
        """Account hits served without a plan (the eval callback's all-resident fast path)."""
        experts = tuple(experts)
        self._routed(layer, experts)
        for e in experts:
            if (layer, e) in self._resident:
                self._policy.used((layer, e))
                self.hits += 1

    def discard(self, entry: Entry) -> None:
        """Forget an entry whose read failed: it must never count as a hit."""
        if entry in self._resident:
            self._remove(entry)

    def trim(self) -> tuple[Entry, ...]:
        """Evict down to the budget once no layer is pinned (end of a decode step)."""
        self._step_end()
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
        candidates = self._policy.victims()
        try:
            # Ask for the next victim only while over the limit: every candidate handed out is
            # either evicted or skipped as pinned, never silently dropped.
            while self.resident_bytes > limit:
                entry = next(candidates, None)
                if entry is None:
                    break
                if entry in pinned or entry not in self._resident:
                    continue
                self._remove(entry)
                evicted.append(entry)
        finally:
            close = getattr(candidates, "close", None)
            if close is not None:
                close()
        self.evictions += len(evicted)
        return tuple(evicted)

    def _remove(self, entry: Entry) -> None:
        self._resident.remove(entry)
        self._policy.removed(entry)
        self.resident_bytes -= self._entry_bytes[entry[0]]
