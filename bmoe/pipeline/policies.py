"""Expert cache policies, and a replay that scores them on a recorded route trace.

PLACEHOLDER
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from bmoe.errors import BudgetError
from bmoe.pipeline.cache import Entry, EvictionPolicy, ExpertCache, LruPolicy
from bmoe.pipeline.trace import LayerEvent, RouteTrace

Future = Sequence[tuple[int, Sequence[int]]]  # (layer, routed experts) per plan call, in order


class OptPolicy:
    """Belady's offline optimum: evict the entry whose next use is furthest away.

    Offline: it is given the whole sequence of ``plan`` calls up front (``future``) and counts its
    position with the ``routed`` hook, so it only works in a replay. The ceiling, not a policy to
    run. (With entries of unequal size furthest-next-use is the classic heuristic rather than a
    proven optimum; on one model's layers the sizes differ by at most 15 %.)
    """

    name = "opt"
    offline = True

    def __init__(self, future: Future) -> None:
        self._future_layers = [layer for layer, _ in future]
        self._never = len(future) + 1
        occ: dict[Entry, list[int]] = {}
        for pos, (layer, experts) in enumerate(future):
            for e in experts:
                occ.setdefault((layer, e), []).append(pos)
        self._occ = occ
        self._ptr: dict[Entry, int] = {}
        self._next: dict[Entry, int] = {}  # resident entry -> position of its next use
        self._heap: list[tuple[int, int, Entry]] = []  # (-next use, tiebreak, entry); lazy
        self._held: list[Entry] = []  # handed out by victims() and maybe not evicted
        self._pos = -1
        self._seq = 0

    def routed(self, layer: int, experts: tuple[int, ...]) -> None:
        self._pos += 1
        if self._pos >= len(self._future_layers) or self._future_layers[self._pos] != layer:
            raise BudgetError(
                f"opt policy out of step with its future at call {self._pos} (layer {layer}):"
                " it needs exactly the replayed sequence of plan calls"
            )

    def _next_use(self, entry: Entry) -> int:
        occ = self._occ.get(entry)
        if occ is None:
            return self._never
        p = self._ptr.get(entry, 0)
        while p < len(occ) and occ[p] <= self._pos:
            p += 1
        self._ptr[entry] = p
        return occ[p] if p < len(occ) else self._never

    def _push(self, entry: Entry) -> None:
        nxt = self._next_use(entry)
        self._next[entry] = nxt
        self._seq += 1
        heapq.heappush(self._heap, (-nxt, self._seq, entry))

    def _flush(self) -> None:
        held, self._held = self._held, []
        for entry in held:
            if entry in self._next:
                self._seq += 1
                heapq.heappush(self._heap, (-self._next[entry], self._seq, entry))

    def used(self, entry: Entry) -> None:
        self._flush()
        self._push(entry)

    def admitted(self, entry: Entry) -> None:
        self._flush()
        self._push(entry)

    def removed(self, entry: Entry) -> None:
        del self._next[entry]

    def victims(self) -> Iterator[Entry]:
        self._flush()
        heap = self._heap
        while heap:
            neg, _, entry = heapq.heappop(heap)
            if self._next.get(entry) != -neg:
                continue  # stale: evicted, or used since
            self._held.append(entry)
            yield entry


class _Layer:
    """One layer's statistics, indexed by expert id (grown on demand)."""

    __slots__ = ("ewma", "resident", "key", "last_step")

    def __init__(self, octaves: int, n: int) -> None:
        self.ewma = np.zeros((octaves, n))  # decayed use rates, one row per horizon
        self.resident = np.zeros(n, dtype=bool)
        self.key = np.full(n, np.nan)  # expected next use (a plan-call position) of resident ones
        self.last_step = np.full(n, -1, dtype=np.int64)  # step of the last use, -1 never

    def grow(self, n: int) -> None:
        old = self.resident.shape[0]
        if n <= old:
            return
        size = max(n, 2 * old)
        pad = size - old
        self.ewma = np.pad(self.ewma, ((0, 0), (0, pad)))
        self.resident = np.pad(self.resident, (0, pad))
        self.key = np.pad(self.key, (0, pad), constant_values=np.nan)
        self.last_step = np.pad(self.last_step, (0, pad), constant_values=-1)


class ExpectedReusePolicy:
    """Evict the entry whose next use is expected furthest away ("reuse", the default).

    Two facts about MoE routing drive it. Layers are visited in a fixed cycle, so an entry can only
    be used when its layer comes round again: its expected next use is the next visit of its layer
    plus whole cycles, ``last visit of its layer + cycle / p``, where ``p`` is the chance that the
    layer routes it on a given visit. And ``p`` is bursty on top of a skewed long-run popularity:
    an expert just routed is several times likelier to be routed again next token than one routed
    a few tokens ago, and a popular one is likelier than a rare one at any age. So ``p`` is the
    largest of a ladder of decayed use rates (per layer visit, EWMAs with rates alpha, alpha/2, ...,
    alpha/32): whichever horizon sees the entry as most active speaks for it. A fresh miss starts at
    ``p = alpha``, so it is kept only if it beats what is resident; otherwise it is the next victim
    (admission control comes for free), and below one token's working set the cache keeps a stable
    hot set instead of cycling through the layers as LRU does.

    No constant is fitted to a trace. The one scale is ``alpha = 1 / (1 + T)``, where ``T`` is the
    cache's own memory in tokens, measured online: the number of recent steps whose distinct routed
    entries fill the budget (the characteristic time of an LRU cache of that size, Che's
    approximation). A small cache remembers a token or two, so recency dominates; a large one
    remembers tens of tokens, and long-run frequency does. Below one token (``T < 1``) alpha is 1/2.

    Cost per layer visit: a few numpy operations over the layer's experts plus one heap push per
    resident entry of that layer; the heap is lazy and compacted when stale items pile up.
    """

    name = "reuse"
    # Decay rates per layer visit, half an octave apart: horizons of 2 to 1024 visits. A fixed
    # grid (not tuned: it spans every horizon a run can use); the budget picks the fastest row.
    RATES = 2.0 ** (-np.arange(2, 22) / 2.0)
    MAX_MEMORY_STEPS = 4096  # cap on the walk that measures T (compute bound only)

    def __init__(self) -> None:
        self._budget: int | None = None
        self._entry_bytes: dict[int, int] = {}
        self._cycle = 0.0
        self._layers: dict[int, _Layer] = {}
        self._pos = -1  # plan calls seen
        self._step = 0  # trims seen (llama_decode calls)
        self._bytes_at: list[int] = [0]  # bytes of entries whose last use was at each step
        self._seen_bytes = 0
        self._rates = self.RATES[:, None]
        self._keep = (1.0 - self.RATES)[:, None]
        self._first_row = 0
        self._heap: list[tuple[float, int, Entry]] = []
        self._held: list[Entry] = []
        self._seq = 0
        self._n_resident = 0
        self.memory_steps: float | None = None  # the measured T (for reports)

    @property
    def alpha(self) -> float:
        """The fastest decay rate consulted: about 1 / (1 + T)."""
        return float(self.RATES[self._first_row])

    def _set_alpha(self, alpha: float) -> None:
        """Consult the rows whose rate is at most ``alpha`` (at least the slowest one)."""
        slow_enough = np.flatnonzero(self.RATES <= alpha * (1.0 + 1e-9))
        self._first_row = int(slow_enough[0]) if slow_enough.size else len(self.RATES) - 1

    # -- hooks ---------------------------------------------------------------------------------

    def configure(self, budget_bytes: int, entry_bytes: Mapping[int, int]) -> None:
        self._budget = budget_bytes
        self._entry_bytes = dict(entry_bytes)
        self._cycle = float(len(entry_bytes))

    def routed(self, layer: int, experts: tuple[int, ...]) -> None:
        self._flush()
        self._pos += 1
        st = self._layers.get(layer)
        if st is None:
            st = self._layers[layer] = _Layer(len(self.RATES), 64)
            if layer not in self._entry_bytes:
                self._cycle = max(self._cycle, float(len(self._layers)))
        ids = np.fromiter(experts, dtype=np.intp, count=len(experts))
        if ids.size and int(ids.max()) >= st.resident.shape[0]:
            st.grow(int(ids.max()) + 1)
        st.ewma *= self._keep
        st.ewma[:, ids] += self._rates
        self._note_use(layer, st, ids)
        mask = st.resident.copy()
        mask[ids] = True
        idx = np.flatnonzero(mask)
        p = st.ewma[self._first_row :, idx].max(axis=0)
        with np.errstate(divide="ignore"):
            keys = self._pos + self._cycle / p
        st.key[idx] = keys
        heap = self._heap
        seq = self._seq
        for e, k in zip(idx.tolist(), keys.tolist()):
            seq += 1
            heapq.heappush(heap, (-k, seq, (layer, e)))
        self._seq = seq
        if len(heap) > 4 * (self._n_resident + 256):
            self._compact()

    def step_end(self) -> None:
        self._step += 1
        self._bytes_at.append(0)
        self._measure_memory()

    # -- protocol ------------------------------------------------------------------------------

    def used(self, entry: Entry) -> None:
        self._flush()

    def admitted(self, entry: Entry) -> None:
        self._flush()
        layer, e = entry
        st = self._layers.get(layer)
        if st is None or e >= st.resident.shape[0] or np.isnan(st.key[e]):
            self.routed(layer, (e,))  # admitted without a plan: count it as a use now
            st = self._layers[layer]
        if not st.resident[e]:
            st.resident[e] = True
            self._n_resident += 1

    def removed(self, entry: Entry) -> None:
        st = self._layers[entry[0]]
        if st.resident[entry[1]]:
            st.resident[entry[1]] = False
            self._n_resident -= 1
        st.key[entry[1]] = np.nan

    def victims(self) -> Iterator[Entry]:
        self._flush()
        heap = self._heap
        layers = self._layers
        while heap:
            neg, _, entry = heapq.heappop(heap)
            st = layers[entry[0]]
            if not st.resident[entry[1]] or st.key[entry[1]] != -neg:
                continue  # stale: evicted, or re-keyed since
            self._held.append(entry)
            yield entry

    # -- internals -----------------------------------------------------------------------------

    def _flush(self) -> None:
        if not self._held:
            return
        held, self._held = self._held, []
        for layer, e in held:
            st = self._layers[layer]
            if st.resident[e]:
                self._seq += 1
                heapq.heappush(self._heap, (-float(st.key[e]), self._seq, (layer, e)))

    def _compact(self) -> None:
        items: list[tuple[float, int, Entry]] = []
        for layer, st in self._layers.items():
            for e in np.flatnonzero(st.resident).tolist():
                self._seq += 1
                items.append((-float(st.key[e]), self._seq, (layer, e)))
        heapq.heapify(items)
        self._heap = items
        self._held = []

    def _note_use(self, layer: int, st: _Layer, ids: np.ndarray) -> None:
        """Move the routed entries' bytes to the current step (for the cache memory T)."""
        nbytes = self._entry_bytes.get(layer, 0)
        if not nbytes:
            return
        at = self._bytes_at
        step = self._step
        for old in st.last_step[ids].tolist():
            if old < 0:
                self._seen_bytes += nbytes
            else:
                at[old] -= nbytes
            at[step] += nbytes
        st.last_step[ids] = step

    def _measure_memory(self) -> None:
        """T: how many recent steps' distinct routed entries the budget holds (fractional)."""
        budget = self._budget
        if budget is None:
            return
        at = self._bytes_at
        n = len(at) - 1  # completed steps; at[-1] is the step just opened (empty)
        if self._seen_bytes <= budget:
            t = float(n)  # everything ever routed fits: the cache forgets nothing
        else:
            acc = 0
            t = float(min(n, self.MAX_MEMORY_STEPS))
            for back in range(min(n, self.MAX_MEMORY_STEPS)):
                b = at[n - 1 - back]
                if acc + b >= budget:
                    t = back + (budget - acc) / b
                    break
                acc += b
        self.memory_steps = t
        self._set_alpha(1.0 / (1.0 + max(t, 1.0)))



POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LruPolicy,
    "opt": OptPolicy,
    "reuse": ExpectedReusePolicy,
    "default": ExpectedReusePolicy,
}


def make_policy(name: str, *, future: Future | None = None) -> EvictionPolicy:
    """A fresh policy. ``future`` (the replayed plan calls) is needed by offline policies only."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise BudgetError(f"unknown cache policy {name!r} (known: {', '.join(POLICIES)})") from None
    if getattr(factory, "offline", False):
        if future is None:
            raise BudgetError(f"cache policy {name!r} is offline (it reads the future): replay only")
        return factory(future)
    return factory()


# ---------------------------------------------------------------------------------------------
# Replay


@dataclass(frozen=True)
class SimResult:
    policy: str
    budget_bytes: int
    decode_hit_pct: float
    hit_pct: float
    bytes_read: int
    hits: int
    misses: int
    decode_hits: int
    decode_misses: int
    max_resident_bytes: int  # highest resident bytes seen after a trim (must be <= the budget)


PolicySpec = str | Callable[[Sequence[LayerEvent]], EvictionPolicy]


def simulate(
    trace: RouteTrace,
    policy: PolicySpec,
    budget_bytes: int,
    *,
    events: Sequence[LayerEvent] | None = None,
) -> SimResult:
    """Replay ``trace`` through an ``ExpertCache`` the way the engine drives it.

    One ``plan`` per layer event (a prefill ubatch is one event per layer with the union of its
    experts), a ``trim`` after every llama_decode call. ``policy`` is a registry name or a factory
    taking the event list. Pass ``events`` (``trace.layer_events(...)``) to reuse or vary them.
    """
    evs = trace.layer_events() if events is None else events
    if isinstance(policy, str):
        name = policy
        pol = make_policy(name, future=[(e.layer, e.experts) for e in evs])
    else:
        pol = policy(evs)
    cache = ExpertCache(budget_bytes, trace.expert_bytes, pol)
    eb = trace.expert_bytes
    hits = [0, 0]
    misses = [0, 0]
    read = 0
    worst = 0
    plan = cache.plan
    for ev in evs:
        p = plan(ev.layer, ev.experts)
        d = 1 if ev.phase == 1 else 0
        hits[d] += len(p.hits)
        n_miss = len(p.misses)
        misses[d] += n_miss
        read += n_miss * eb[ev.layer]
        if ev.ends_call:
            cache.trim()
            if cache.resident_bytes > worst:
                worst = cache.resident_bytes
    h, m = sum(hits), sum(misses)
    return SimResult(
        policy=pol.name,
        budget_bytes=budget_bytes,
        decode_hit_pct=100.0 * hits[1] / (hits[1] + misses[1]) if hits[1] + misses[1] else 0.0,
        hit_pct=100.0 * h / (h + m) if h + m else 0.0,
        bytes_read=read,
        hits=h,
        misses=m,
        decode_hits=hits[1],
        decode_misses=misses[1],
        max_resident_bytes=worst,
    )
