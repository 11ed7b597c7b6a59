"""Expert cache policies: the eviction orders ``ExpertCache`` can run with.

Policies (``POLICIES``, ``make_policy(name)``; ``ExpertCache`` gets one by name):

    lru       least recently used first (``LruPolicy``)
    adaptive  the default (alias ``default``): a next-use model each layer learns online (recency
              vs popularity, mixed by online EM), eviction by expected hit density over the
              cache's own memory, and a recency guard decided by two shadow caches
              (``AdaptiveReusePolicy``)
    reuse     the previous default: expected next use from multi-horizon decayed rates (max over
              horizons) and the layer cycle, a just-routed entry protected for one cycle
              (``ExpectedReusePolicy``); kept for comparison
    opt       Belady's offline optimum, the ceiling: needs the replayed sequence of plan calls
              (``make_policy("opt", future=[(layer, experts), ...])``); replay only

``bmoe.pipeline.simulate.simulate(trace, policy, budget_bytes)`` replays a ``RouteTrace`` through
``ExpertCache`` as the engine drives it: one ``plan`` per layer event (``RouteTrace.layer_events``:
a prefill call is one event per layer with the union of its tokens' experts, sorted as the eval
callback hands them over), a ``trim`` after every llama_decode call. Hit % = hits / (hits +
misses) over the unique experts of each event; ``decode_hit_pct`` counts decode events only; MiB
= 2^20 bytes; an entry's bytes are the trace header's ``expert_bytes`` of its layer.

Why LRU is the wrong baseline to stop at: below one token's working set (layers x top-k experts)
it evicts every entry just before its layer comes round again and hits nothing, and above it, it
keeps whatever was routed last whether or not the model's routing rewards recency. Why a policy
must learn: how much recency and popularity predict the next use differs by model and by layer
(the previous token predicts 38 % of Qwen3's routing, 18 % of gpt-oss's). The measured tables
(the shared Qwen3 trace at 250 MiB .. the whole bank, the synthetic grid, the replay's agreement
with the recording run and with BigMoeOnEdge's own replay, planning costs) are in
``docs/facts.md``: they are measurements and drift with the code; this docstring keeps the why.
"""

from __future__ import annotations

import heapq
import math
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence

import numpy as np

from bmoe.errors import BudgetError, ConfigError
from bmoe.pipeline.cache import Entry, EvictionPolicy

Future = Sequence[tuple[int, Sequence[int]]]  # (layer, routed experts) per plan call, in order


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

    def routed(self, layer: int, experts: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
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

    __slots__ = ("row", "rates", "resident", "last_step")

    def __init__(self, row: int, n_rates: int, n: int) -> None:
        self.row = row  # this layer's row in the policy's eviction table
        self.rates = np.zeros((n_rates, n))  # decayed use rates, one row per horizon
        self.resident = np.zeros(n, dtype=bool)
        self.last_step = np.full(n, -1, dtype=np.int64)  # step of the last use, -1 never

    def grow(self, n: int) -> None:
        pad = n - self.resident.shape[0]
        if pad > 0:
            self.rates = np.pad(self.rates, ((0, 0), (0, pad)))
            self.resident = np.pad(self.resident, (0, pad))
            self.last_step = np.pad(self.last_step, (0, pad), constant_values=-1)


_ABSENT = -np.inf  # eviction order of an entry that is not resident
_PROTECT = 1e12  # subtracted from a protected key: after every unprotected one (keys stay < 1e12)


class ExpectedReusePolicy:
    """Evict the entry whose next use is expected furthest away ("reuse", the default).

    Three facts about MoE routing drive it, all visible in the shared trace.

    1. Layers are visited in a fixed cycle, so an entry can only be used when its layer comes round
       again. With ``p`` the chance that its layer routes it on a visit, its expected next use is
       ``last visit of its layer + cycle / p`` plan calls. Evicting by that (largest first) is
       Belady's rule with the future replaced by its expectation; among equals it takes the layers
       visited last (furthest from their next visit), where LRU takes the soonest.
    2. ``p`` is bursty on top of a skewed, slowly drifting popularity: an expert just routed is
       about 2.5 times likelier to be routed again next token than one routed two tokens ago, and a
       popular one is likelier than a rare one at any age. So ``p`` is the largest of a ladder of
       decayed use rates (per layer visit, EWMAs with horizons half an octave apart): whichever
       horizon sees the entry as most active speaks for it.
    3. The burst is strongest at the very next visit. So an entry routed at its layer's latest
       visit is protected until that layer comes round again (evicted only when nothing else is
       left): one cycle to prove itself. Not when the cache cannot hold one token's working set:
       protecting a whole cycle is exactly what makes LRU hit nothing there; the cache then keeps a
       stable hot set instead.

    No constant is fitted to a trace. The one scale is the fastest horizon consulted,
    ``alpha = 1 / (1 + T)`` (an EWMA whose mean age is ``T``), where ``T`` is the cache's own
    memory in tokens, measured online: how many recent steps' distinct routed entries fill the
    budget (the characteristic time of an LRU cache of that size, as in Che's approximation). A
    small cache remembers a token or two, so recency dominates; a large one remembers tens of
    tokens, and long-run popularity does. Below one token (``T < 1``) the horizon is ``1/T``: the
    smaller the cache, the hotter (and slower to learn) the set it can keep. A routed set larger
    than the smallest one seen is a union over several tokens (a prefill ubatch) and counts as a
    fractional use, ``k / |set|``.

    Cost per plan call: a handful of numpy operations over the layer's experts; each victim is an
    argmax over a (layers x experts) table of eviction keys.
    """

    name = "reuse"
    # Decay rates per layer visit, half an octave apart, horizons 2 .. 1024 visits: a fixed grid
    # that spans every horizon a run can use (not tuned: octave or quarter-octave steps score the
    # same). The budget only picks the fastest row consulted.
    RATES = 2.0 ** (-np.arange(2, 22) / 2.0)
    MAX_MEMORY_STEPS = 4096  # bound on the walk that measures T (a compute bound only)

    def __init__(self) -> None:
        self._KEEP = (1.0 - self.RATES)[:, None]
        self._GAIN = self.RATES[:, None]
        self._budget: int | None = None
        self._entry_bytes: dict[int, int] = {}
        self._cycle = 0.0  # plan calls per token: the MoE layer count
        self._layers: dict[int, _Layer] = {}
        self._row_layer: list[int] = []  # eviction-table row -> layer
        self._order = np.full((0, 64), _ABSENT)  # eviction keys, largest evicted first
        self._held: list[tuple[int, int, float]] = []  # (row, expert, key) handed out by victims()
        self._pos = -1  # plan calls seen
        self._step = 0  # trims seen (llama_decode calls)
        # Bytes of the entries whose last use was at each step, for the steps from _bytes_base on:
        # only the last MAX_MEMORY_STEPS are ever walked, so older ones are dropped (step_end).
        self._bytes_at: list[int] = [0]
        self._bytes_base = 0  # the step _bytes_at[0] stands for
        self._seen_bytes = 0
        self._min_routed = 1 << 30
        self._first_row = 0
        self._protect = False
        self.memory_steps: float | None = None  # the measured T, for reports

    @property
    def steps(self) -> int:
        """Decode calls seen (trims)."""
        return self._step

    @property
    def alpha(self) -> float:
        """The fastest decay rate consulted, about ``1 / (1 + T)``."""
        return float(self.RATES[self._first_row])

    def _set_alpha(self, alpha: float) -> None:
        slow_enough = np.flatnonzero(self.RATES <= alpha * (1.0 + 1e-9))
        self._first_row = int(slow_enough[0]) if slow_enough.size else len(self.RATES) - 1

    # -- optional hooks (called by ExpertCache) -------------------------------------------------

    def configure(self, budget_bytes: int, entry_bytes: Mapping[int, int]) -> None:
        self._budget = budget_bytes
        self._entry_bytes = dict(entry_bytes)
        self._cycle = float(len(entry_bytes))
        self._measure_memory()

    def _admit(self, layer: int, e: int) -> _Layer:
        """Mark ``e`` resident in its layer's state; one admitted without a plan this step (read
        ahead, or a replay's direct admission) counts as a use now."""
        st = self._layers.get(layer)
        if st is None or e >= st.resident.shape[0] or not st.last_step[e] == self._step:
            self.routed(layer, (e,))
            st = self._layers[layer]
        st.resident[e] = True
        return st

    def _arrive(self, layer: int, experts: tuple[int, ...]) -> tuple[_Layer, np.ndarray]:
        """What every routing event starts with: settle the previous one, advance the clock, and
        return the layer's state and the routed ids (the tables grown to hold them)."""
        self._flush()
        self._pos += 1
        st = self._layer(layer)
        ids = np.fromiter(experts, dtype=np.intp, count=len(experts))
        if ids.size:
            self._fit(int(ids.max()) + 1)
            self._min_routed = min(self._min_routed, ids.size)
        return st, ids

    def routed(self, layer: int, experts: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
        st, ids = self._arrive(layer, experts)
        st.rates *= self._KEEP
        if ids.size:
            st.rates[:, ids] += self._GAIN * min(1.0, self._min_routed / ids.size)
        self._note_use(layer, st, ids)
        idx = np.flatnonzero(st.resident)
        p = st.rates[self._first_row :, idx].max(axis=0)
        with np.errstate(divide="ignore"):
            keys = self._pos + self._cycle / p
        if self._protect and ids.size:
            routed_now = np.zeros(st.resident.shape[0], dtype=bool)
            routed_now[ids] = True
            keys[routed_now[idx]] -= _PROTECT  # the hits; misses are keyed when admitted
        order = self._order[st.row]
        order[:] = _ABSENT
        order[idx] = keys

    def step_end(self) -> None:
        self._step += 1
        self._bytes_at.append(0)
        keep = self.MAX_MEMORY_STEPS + 1  # the step just opened and the completed ones walked
        if len(self._bytes_at) >= 2 * keep:  # one slice per MAX_MEMORY_STEPS steps: amortised O(1)
            drop = len(self._bytes_at) - keep
            del self._bytes_at[:drop]
            self._bytes_base += drop
        self._measure_memory()

    # -- the protocol ---------------------------------------------------------------------------

    def used(self, entry: Entry) -> None:
        pass  # routed() has keyed the whole layer

    def admitted(self, entry: Entry) -> None:
        layer, e = entry
        st = self._admit(layer, e)
        p = float(st.rates[self._first_row :, e].max())
        key = self._pos + self._cycle / p if p > 0 else np.inf
        self._order[st.row, e] = key - _PROTECT if self._protect else key

    def removed(self, entry: Entry) -> None:
        st = self._layers[entry[0]]
        st.resident[entry[1]] = False
        self._order[st.row, entry[1]] = _ABSENT

    def victims(self) -> Iterator[Entry]:
        self._flush()
        order = self._order
        flat = order.reshape(-1)
        n = order.shape[1]
        while flat.size:
            i = int(flat.argmax())
            key = float(flat[i])
            if key == _ABSENT:
                return
            row, e = divmod(i, n)
            flat[i] = _ABSENT  # not offered twice; restored by _flush if the cache keeps it
            self._held.append((row, e, key))
            yield (self._row_layer[row], e)

    # -- internals ------------------------------------------------------------------------------

    def _layer(self, layer: int) -> _Layer:
        st = self._layers.get(layer)
        if st is None:
            row = len(self._row_layer)
            self._row_layer.append(layer)
            self._order = np.vstack([self._order, np.full((1, self._order.shape[1]), _ABSENT)])
            st = self._layers[layer] = _Layer(row, len(self.RATES), self._order.shape[1])
            if layer not in self._entry_bytes:  # not configured for it: learn the cycle
                self._cycle = max(self._cycle, float(len(self._layers)))
        return st

    def _fit(self, n: int) -> None:
        width = self._order.shape[1]
        if n <= width:
            return
        width = max(n, 2 * width)
        self._order = np.pad(self._order, ((0, 0), (0, width - self._order.shape[1])),
                             constant_values=_ABSENT)
        for st in self._layers.values():
            st.grow(width)

    def _flush(self) -> None:
        if not self._held:
            return
        for row, e, key in self._held:
            if self._layers[self._row_layer[row]].resident[e]:
                self._order[row, e] = key
        self._held = []

    def _note_use(self, layer: int, st: _Layer, ids: np.ndarray) -> None:
        """Move the routed entries' bytes to the current step (for the cache memory T)."""
        nbytes = self._entry_bytes.get(layer, 0)
        if not ids.size:
            return
        if nbytes:
            at = self._bytes_at
            base = self._bytes_base
            step = self._step - base
            for old in st.last_step[ids].tolist():
                if old < 0:
                    self._seen_bytes += nbytes
                elif old >= base:  # a step dropped from the table is never walked again
                    at[old - base] -= nbytes
                at[step] += nbytes
        st.last_step[ids] = self._step

    def _measure_memory(self) -> None:
        """T: how many recent steps' distinct routed entries the budget holds (fractional)."""
        budget = self._budget
        if budget is None:
            return
        at = self._bytes_at
        n = self._step  # completed steps; at[-1] is the step just opened (empty)
        if self._seen_bytes <= budget:
            t = float(max(n, 1))  # everything routed so far fits: the cache forgets nothing
        else:
            acc = 0
            t = float(min(n, self.MAX_MEMORY_STEPS))
            last = n - 1 - self._bytes_base  # index of the last completed step
            for back in range(min(n, self.MAX_MEMORY_STEPS)):
                b = at[last - back]
                if b <= 0:  # a step that routed nothing new (or was cancelled) holds no memory
                    continue
                if acc + b >= budget:
                    t = back + (budget - acc) / b
                    break
                acc += b
        self.memory_steps = t
        self._protect = t >= 1.0
        # Below one token the cache keeps a hot set; the smaller it is, the longer that takes.
        horizon = t if t >= 1.0 else 1.0 / max(t, 1e-9)
        self._set_alpha(1.0 / (1.0 + horizon))


class AdaptiveReusePolicy(ExpectedReusePolicy):
    """Evict the entry with the lowest expected hit density, from a next-use model each layer
    learns online ("adaptive", the default).

    How much recency and how much popularity predict an expert's next use differs by model (the
    previous token's experts predict 38 % of Qwen3's routing, 18 % of gpt-oss's, where a fixed hot
    list predicts 27 %) and by layer (Qwen's layer 0 is near-uniform, its deep layers
    concentrated). So nothing is assumed about the mix; each layer learns it from its own routing.

    1. **Next-use model.** Per layer, decayed use rates at horizons of 1, 2, 4, ... 1024 visits
       (horizon 1 is "routed at the last visit": pure recency; the long ones are popularity), each
       normalised to a distribution over the experts, plus a uniform one (the prior for an expert
       never seen). The layer's prediction for its next routing is their mixture; the mixture
       weights are fitted by online EM to the layer's actual routing (each visit moves them toward
       the share of the routed experts each component explained), so a layer whose routing is
       bursty puts its weight on the short horizons and one with a stable hot set on the long ones.
       The chance that expert ``e`` is routed ``j`` visits from now, if not routed before, is then
       ``k * sum_h w_h d_h(e) (1 - a_h)^j + k w_u / n``: each component decays as its rate would.
    2. **Hit density** (Beckmann et al., "LHD", NSDI 2018): what an entry is worth is the hits it
       is expected to give per unit of cache space-time it holds, over the time the cache can keep
       it. That time is the cache's own memory ``T`` in tokens, measured online as for ``reuse``
       (how many recent steps' distinct routed entries fill the budget; below one token, ``1/T``:
       a cache that cannot hold a token keeps a stable hot set). Density = P(used within T visits)
       / E[visits held until used or T]. An expert just routed in a bursty layer scores high for a
       small cache and gives way to steadily popular ones in a large cache, without any switch.
    3. **Eviction order across layers** as for ``reuse``: the key is the layer's last visit plus
       ``cycle / density`` plan calls (an expected next use), largest first, so layers that come
       round soonest keep their entries.

    4. **Recency guard, decided by a duel** (set dueling, Qureshi et al., ISCA 2007, with two
       shadow caches instead of sampled sets). At a budget near one token's working set LRU is
       hard to beat on flat routing: it keeps exactly each layer's last set, and a model that
       trades some of those for noisily "popular" experts loses up to 2 points. Two shadow caches
       that only count hits follow the same keys, one as is, one protecting each layer's last set
       for a cycle (the ``reuse`` policy's rule, which is what LRU does there); the real cache
       protects while the protecting shadow has had more recent hits. The model is shared (it
       depends on the routing only).

    No constant is fitted to a trace. The horizons are an octave ladder spanning one visit to more
    than any run's decode; the lookahead grid (half an octave, up to 2048 visits) is a numerical
    integration step; the EM step is ``max(1/visits, 1/64)`` (plain averaging first, then a
    64-visit memory so the weights follow a drift), and the duel's hit counts decay on the same
    64-token memory: 1/16 and 1/256 give the same hits within 0.3 point (docs/facts.md).

    **Lazy, batched bookkeeping.** A plan call runs while the compute thread waits, and with every
    expert cached it is the whole cost of streaming (48 plans of 0.56 ms were 27 ms a token, 0.80x
    resident). But nothing needs a layer's keys until something is evicted, and a layer's model
    changes only at its own visits. So a visit only records what it routed (and the shadows count
    their hits); the model updates are applied when keys are needed (an eviction, an admission, a
    shadow over budget) or once a token, in waves that update every waiting layer with one set of
    numpy operations; and a layer's keys are computed from the clock, ``T`` and ``k`` its last
    visit saw, so the order is the one an eager update gives. All cached, a token costs one wave.
    """

    name = "adaptive"
    ALPHAS = np.concatenate([[1.0], 2.0 ** (-np.arange(1, 11))])  # per-visit decay: horizons 1 .. 1024
    GRID = np.concatenate([[0.0], np.unique(np.round(2.0 ** np.arange(0, 11.5, 0.5)))])  # visits ahead
    EM_MIN_STEP = 1.0 / 64

    def __init__(self) -> None:
        super().__init__()
        n_h = len(self.ALPHAS)
        self._w0 = np.full(n_h + 1, 1.0 / (n_h + 1))  # the horizons and the uniform prior
        self._decay = (1.0 - self.ALPHAS)[:, None] ** self.GRID[None, :]  # horizons x grid
        self._gaps = np.diff(self.GRID)
        self._keep3 = (1.0 - self.ALPHAS)[None, :, None]
        self._gain3 = self.ALPHAS[None, :, None]
        # The per-layer model, one row per layer (the eviction table's rows):
        self._rates = np.zeros((0, n_h, 64))  # decayed use rates per horizon
        self._weights = np.zeros((0, n_h + 1))  # the mixture, fitted by online EM
        self._visits = np.zeros(0, dtype=np.int64)
        self._seed_mass = np.zeros(0)  # per row: the slowest rate's weight a profile's seed gave it
        self._seeds: dict[int, tuple[np.ndarray, float]] = {}  # layer -> (chances, visits), until routed
        self._keys = np.full((0, 64), np.inf)  # every entry's key, resident or not (for the duel)
        self._recent = np.zeros((0, 64), dtype=bool)  # routed at its layer's latest visit
        self._row_bytes = np.zeros(0)
        # Visits not yet applied to the model: (row, routed ids, weight of the use).
        self._pending: list[tuple[int, np.ndarray, float]] = []
        # Rows whose keys are stale, with what their latest visit saw.
        self._stale: dict[int, _StaleRow] = {}
        self._free, self._guarded = _Shadow(False), _Shadow(True)
        self._guard = False  # protect the recent entries now (the guarded shadow is ahead)

    def configure(self, budget_bytes: int, entry_bytes: Mapping[int, int]) -> None:
        super().configure(budget_bytes, entry_bytes)
        self._protect = False

    def step_end(self) -> None:
        super().step_end()
        self._protect = False
        if len(self._pending) >= self._rates.shape[0]:  # a token's worth: one wave, bounded memory
            self._apply_pending()
        if self._budget is not None:
            for shadow in (self._free, self._guarded):
                shadow.trim(self, self._budget, self.memory_steps)
        self._guard = (self.memory_steps or 0.0) >= 1.0 and self._guarded.score > self._free.score

    def routed(self, layer: int, experts: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
        st, ids = self._arrive(layer, experts)
        self._fit_tables()
        row = st.row
        if self._seeds and layer in self._seeds:
            self._take_seed(layer, row)
        # A prefill union counts as a fractional use, as for ``reuse``.
        self._pending.append((row, ids, min(1.0, self._min_routed / ids.size) if ids.size else 0.0))
        self._note_use(layer, st, ids)
        k = float(self._min_routed if self._min_routed < (1 << 30) else max(ids.size, 1))
        self._stale[row] = _StaleRow(self._pos, self.memory_steps, k, self._guard, ids)
        self._recent[row] = False
        self._recent[row, ids] = True
        if self._budget is not None and ids.size:
            for shadow in (self._free, self._guarded):
                shadow.plan(row, ids, self, self._budget, self.memory_steps)

    def served(self, visits: Sequence[tuple[int, np.ndarray]]) -> bool:
        """A run of routings whose every entry the cache held (the fast path's hits, accounted at
        a step's end), taken in one pass: the same state as ``routed`` then ``used`` of each, in
        order (``used`` does nothing here). With every expert cached this is the whole per-token
        cost of streaming, and one-by-one calls spent 0.6 ms a token of the 100 in Python.

        False, with nothing changed, where the pass could differ from the one-by-one calls: a
        layer not seen yet or twice in the run, an expert beyond the tables, an empty set, or a
        shadow that would have to evict (its victims depend on the keys as of that visit)."""
        if not visits or self._held:
            return False
        layers = self._layers
        if self._keys.shape != self._order.shape:
            return False
        rows: list[int] = []
        for layer, _ in visits:
            st = layers.get(layer)
            if st is None:
                return False
            rows.append(st.row)
        sizes = [int(ids.size) for _, ids in visits]
        if len(set(rows)) != len(rows) or 0 in sizes:
            return False
        cat = np.concatenate([ids for _, ids in visits]).astype(np.intp, copy=False)
        if int(cat.max()) >= self._order.shape[1]:
            return False
        at_rows = np.repeat(np.asarray(rows, dtype=np.intp), sizes)
        budget = self._budget
        shadow_hits: list[list[int]] = []
        if budget is not None:
            starts = np.cumsum([0, *sizes[:-1]])
            for shadow in (self._free, self._guarded):
                if shadow.resident.shape != self._keys.shape:
                    return False
                hits = np.add.reduceat(shadow.resident[at_rows, cat], starts, dtype=np.int64).tolist()
                grown = sum((n - h) * float(self._row_bytes[r]) for n, h, r in zip(sizes, hits, rows))
                if shadow.bytes + grown > budget:
                    return False
                shadow_hits.append(hits)
        # Committed: the one-by-one calls' effects, in their order where order matters.
        pos, minr = self._pos, self._min_routed
        memory, guard = self.memory_steps, self._guard
        for (layer, ids), row, n in zip(visits, rows, sizes):
            ids = ids.astype(np.intp, copy=False)
            pos += 1
            minr = min(minr, n)
            self._pending.append((row, ids, min(1.0, minr / n)))
            self._note_use(layer, layers[layer], ids)
            self._stale[row] = _StaleRow(pos, memory, float(minr), guard, ids)
        self._pos, self._min_routed = pos, minr
        self._recent[rows] = False
        self._recent[at_rows, cat] = True
        if budget is not None:
            for shadow, hits in zip((self._free, self._guarded), shadow_hits):
                for n, h, r in zip(sizes, hits, rows):  # one add per visit: the score is a float
                    shadow.score += h
                    shadow.bytes += (n - h) * self._row_bytes[r]
                shadow.resident[at_rows, cat] = True
        return True

    def admitted(self, entry: Entry) -> None:
        layer, e = entry
        row = self._admit(layer, e).row
        stale = self._stale.get(row)
        if stale is not None:  # keyed with its row, as of now
            stale.admitted.append((e, self._guard))
        else:
            self._order[row, e] = self._keys[row, e] - (_PROTECT if self._guard else 0.0)

    def victims(self) -> Iterator[Entry]:
        self._flush()  # the entries offered last time and kept get their keys back, then rekey
        self.keys()
        return super().victims()

    def keys(self) -> np.ndarray:
        """Every entry's key (rows x experts), brought up to date: the model updates waiting are
        applied and the stale rows keyed, their resident entries placed in the eviction order."""
        if self._pending:
            self._apply_pending()
        if self._stale:
            self._key_stale()
        return self._keys

    def _mass(self) -> np.ndarray:
        """Per row, the weight the slowest rate has gathered: ``1 - (1 - a)^visits`` from a cold
        start, more from a seeded one. A rate divided by it is an unbiased per-visit estimate (the
        bias correction of an exponential average started at zero, as in Adam)."""
        keep = 1.0 - float(self.ALPHAS[-1])
        return 1.0 - (1.0 - self._seed_mass) * keep ** self._visits.astype(float)

    def usage(self) -> dict[int, np.ndarray]:
        """Per layer, each expert's chance of being routed on a token, from the slowest rate,
        bias-corrected (what a cache profile saves; a layer seeded and never routed keeps its
        seed). After 100 visits the raw rate is a tenth of the chance: uncorrected, a profile
        would make every short run's popularity look faint."""
        if self._pending:
            self._apply_pending()
        mass = self._mass()
        out = {layer: chance.copy() for layer, (chance, _) in self._seeds.items()}
        for layer in self._row_layer:
            row = self._layers[layer].row
            raw = self._rates[row, -1]
            out[layer] = np.minimum(raw / mass[row], 1.0) if mass[row] > 0 else np.zeros_like(raw)
        return out

    def evidence(self) -> float:
        """How many visits of routing ``usage`` rests on (the median layer's): the visits a cold
        start needs to gather the slowest rate's present weight. What a profile saves as ``visits``."""
        if self._pending:
            self._apply_pending()
        keep = 1.0 - float(self.ALPHAS[-1])
        left = np.maximum(1.0 - self._mass(), 1e-12)
        visits = [*(np.log(left) / np.log(keep)), *(v for _, v in self._seeds.values())]
        return float(min(np.median(visits), 1e6)) if visits else 0.0

    def seed(self, usage: Mapping[int, np.ndarray], visits: float | None = None) -> None:
        """Start from a profile's usage as if its ``visits`` (None: a run long enough to fill
        every horizon) had been routed here at those chances: each horizon's rate is the chance
        times the weight that horizon gathers over that many visits, so a short profile sways the
        slow horizons little and the new run's own routing takes over at the pace it would have.
        The last-visit horizon starts empty (a new run has no last visit). A layer takes its seed
        at its first routing, so until then the policy is the cold one, row for row."""
        if visits is not None and not (math.isfinite(visits) and visits >= 0):
            raise ValueError(f"visits must be a finite number >= 0, got {visits}")
        for layer, chance in usage.items():
            self._seeds[layer] = (np.asarray(chance, dtype=np.float64), math.inf if visits is None else visits)

    def _take_seed(self, layer: int, row: int) -> None:
        """A seeded layer's first routing: its rates start from the profile (see ``seed``)."""
        chance, visits = self._seeds.pop(layer)
        self._fit(chance.shape[0])
        self._fit_tables()
        gathered = 1.0 - (1.0 - self.ALPHAS[1:]) ** visits
        self._rates[row, 1:, : chance.shape[0]] = gathered[:, None] * chance[None, :]
        self._seed_mass[row] = gathered[-1]

    # -- internals ------------------------------------------------------------------------------

    def _fit_tables(self) -> None:
        """Grow the model and key tables to the eviction table's rows and width."""
        rows, width = self._order.shape
        if self._keys.shape == (rows, width):
            return
        r0, w0 = self._keys.shape
        rates = np.zeros((rows, len(self.ALPHAS), width))
        rates[:r0, :, :w0] = self._rates
        weights = np.vstack([self._weights, np.tile(self._w0, (rows - r0, 1))])
        keys = np.full((rows, width), np.inf)
        keys[:r0, :w0] = self._keys
        recent = np.zeros((rows, width), dtype=bool)
        recent[:r0, :w0] = self._recent
        self._rates, self._weights, self._keys, self._recent = rates, weights, keys, recent
        self._visits = np.concatenate([self._visits, np.zeros(rows - r0, dtype=np.int64)])
        self._seed_mass = np.concatenate([self._seed_mass, np.zeros(rows - r0)])
        self._row_bytes = np.array([self._entry_bytes.get(il, 1) for il in self._row_layer], dtype=float)

    def _apply_pending(self) -> None:
        """Apply the waiting visits in order, a wave at a time: each wave takes every row's
        earliest waiting visit, so a row's visits keep their order."""
        pending, self._pending = self._pending, []
        while pending:
            wave: list[tuple[int, np.ndarray, float]] = []
            later: list[tuple[int, np.ndarray, float]] = []
            taken: set[int] = set()
            for item in pending:
                if item[0] in taken:
                    later.append(item)
                else:
                    taken.add(item[0])
                    wave.append(item)
            self._update(wave)
            pending = later

    def _update(self, wave: list[tuple[int, np.ndarray, float]]) -> None:
        """One visit for each of distinct rows: an online-EM step toward the components that
        explain what it routed, then the rates decay and take the use."""
        rows = np.fromiter((r for r, _, _ in wave), dtype=np.intp, count=len(wave))
        width = self._rates.shape[2]
        sizes = [ids.size for _, ids, _ in wave]
        at_rows = np.repeat(np.arange(rows.size), sizes)
        cat = np.concatenate([ids for _, ids, _ in wave]) if at_rows.size else np.zeros(0, np.intp)
        routed = np.zeros((rows.size, width))
        routed[at_rows, cat] = 1.0
        count = routed.sum(axis=1)
        # A token's wave visits every row in order: update the tables in place (no gather, no scatter).
        whole = rows.size == self._rates.shape[0] and bool((rows == np.arange(rows.size)).all())
        rates = self._rates if whole else self._rates[rows]
        dist = _normalise(rates)
        learn = (count > 0) & (self._visits[rows] > 0)
        if learn.any():
            w = self._weights[rows]
            wh, wu = w[:, :-1], w[:, -1]
            q = np.einsum("mh,mhn->mn", wh, dist) + (wu / width)[:, None]
            ratio = np.divide(routed, q, out=np.zeros_like(q), where=routed > 0)
            resp = np.empty_like(w)
            resp[:, :-1] = wh * np.einsum("mhn,mn->mh", dist, ratio)
            resp[:, -1] = wu * ratio.sum(axis=1) / width
            resp /= np.maximum(count, 1.0)[:, None]
            step = np.maximum(1.0 / (self._visits[rows] + 1.0), self.EM_MIN_STEP)[:, None]
            self._weights[rows] = np.where(learn[:, None], (1.0 - step) * w + step * resp, w)
        self._visits[rows] += 1
        gain = np.fromiter((g for _, _, g in wave), dtype=float, count=len(wave))
        rates *= self._keep3
        # Only the routed entries take a use (the rest would add 0.0): the same values, a tenth the work.
        rates[at_rows, :, cat] += gain[at_rows][:, None] * self.ALPHAS[None, :]
        if not whole:
            self._rates[rows] = rates

    def _key_stale(self) -> None:
        """Key the stale rows as of their latest visits, and place their resident entries in the
        eviction order (protecting what that visit routed while the guard was on)."""
        stale, self._stale = self._stale, {}
        groups: dict[tuple[float | None, float], list[int]] = {}
        for row, visit in stale.items():
            groups.setdefault((visit.memory, visit.k), []).append(row)
        for (t, k), rows in groups.items():
            idx = np.array(rows, dtype=np.intp)
            clock = np.array([stale[r].clock for r in rows], dtype=float)
            density = self._density(self._rates[idx], self._weights[idx], k, t)
            self._keys[idx] = clock[:, None] + self._cycle / density
        for row, visit in stale.items():
            resident = self._layers[self._row_layer[row]].resident
            order = self._order[row]
            keys = self._keys[row]
            order[:] = _ABSENT
            np.copyto(order, keys, where=resident)
            ids = visit.ids
            if visit.guard and ids.size:
                order[ids[resident[ids]]] -= _PROTECT  # what the visit routed and found
            for e, guarded in visit.admitted:  # what it admitted since, as admitted() would have
                if resident[e]:
                    order[e] = keys[e] - (_PROTECT if guarded else 0.0)

    def _density(self, rates: np.ndarray, weights: np.ndarray, k: float, t: float | None) -> np.ndarray:
        """Per row and expert: P(routed within T visits) / E[visits held until then]."""
        dist = _normalise(rates)
        n = dist.shape[2]
        t = t if t is not None else 1.0
        horizon = min(max(t if t >= 1.0 else 1.0 / max(t, 1e-9), 1.0), float(self.GRID[-1]))
        i = min(int(np.searchsorted(self.GRID, horizon, side="right")) - 1, len(self.GRID) - 2)
        # Only the grid up to the horizon matters: p is (rows x experts x grid points 0 .. i).
        p = np.matmul((weights[:, :-1, None] * dist).transpose(0, 2, 1), self._decay[:, : i + 1])
        p += (weights[:, -1] / n)[:, None, None]
        p *= k
        np.clip(p, 1e-12, 1.0 - 1e-12, out=p)
        # Survival (not routed yet) is geometric between grid points at that point's rate.
        log_miss = np.log1p(-p)
        gaps = self._gaps[:i]
        log_s = np.zeros(p.shape)
        np.cumsum(log_miss[..., :i] * gaps, axis=2, out=log_s[..., 1:])
        s = np.exp(log_s)
        held = s[..., :i] * -np.expm1(log_miss[..., :i] * gaps) / p[..., :i]  # visits held per interval
        part = horizon - self.GRID[i]
        life = held.sum(axis=2) + s[..., i] * -np.expm1(log_miss[..., i] * part) / p[..., i]
        used = 1.0 - s[..., i] * np.exp(log_miss[..., i] * part)
        return np.maximum(used / np.maximum(life, 1e-12), 1e-12)


class _StaleRow:
    """What a row's latest visit saw, for keying it later as it would have been keyed then: the
    clock, the cache memory ``T``, ``k``, whether the guard was on and the routed ids; and the
    entries admitted since, each with the guard it was admitted under."""

    __slots__ = ("clock", "memory", "k", "guard", "ids", "admitted")

    def __init__(self, clock: int, memory: float | None, k: float, guard: bool, ids: np.ndarray) -> None:
        self.clock, self.memory, self.k, self.guard, self.ids = clock, memory, k, guard, ids
        self.admitted: list[tuple[int, bool]] = []


def _normalise(rates: np.ndarray) -> np.ndarray:
    """Each horizon's rates as a distribution over the experts (uniform before any use)."""
    total = rates.sum(axis=-1, keepdims=True)
    if total.all():
        return rates / total
    return np.where(total > 0, rates / np.maximum(total, 1e-300), 1.0 / rates.shape[-1])


class _Shadow:
    """A cache that only counts: the entries it would hold evicting by the shared keys, with or
    without one-cycle protection of the recent entries, and its recent hits (a count decayed by
    1/64 per token, the EM step's memory). Counting a hit needs no key; an eviction asks the
    policy for its keys (bringing them up to date) and takes victims by argmax."""

    def __init__(self, guarded: bool) -> None:
        self.guarded = guarded
        self.resident = np.zeros((0, 64), dtype=bool)
        self.bytes = 0.0
        self.score = 0.0

    def plan(self, row: int, ids: np.ndarray, policy: AdaptiveReusePolicy, budget: int,
             memory: float | None) -> None:
        shape = policy._keys.shape
        if self.resident.shape != shape:
            r0, w0 = self.resident.shape
            resident = np.zeros(shape, dtype=bool)
            resident[:r0, :w0] = self.resident
            self.resident = resident
        hit = self.resident[row, ids]
        n_hit = int(np.count_nonzero(hit))
        self.score += n_hit
        self.bytes += (ids.size - n_hit) * policy._row_bytes[row]
        self.resident[row, ids] = True
        if self.bytes > budget:
            self._evict(policy, budget, memory, pinned=(row, ids))  # the layer being served stays

    def trim(self, policy: AdaptiveReusePolicy, budget: int, memory: float | None) -> None:
        self.score *= 1.0 - AdaptiveReusePolicy.EM_MIN_STEP
        if self.bytes > budget and self.resident.shape == policy._keys.shape:
            self._evict(policy, budget, memory)

    def _evict(self, policy: AdaptiveReusePolicy, budget: int, memory: float | None,
               pinned: tuple[int, np.ndarray] | None = None) -> None:
        cand = np.where(self.resident, policy.keys(), -np.inf)
        if self.guarded and (memory or 0.0) >= 1.0:
            cand[policy._recent & self.resident] -= _PROTECT
        if pinned is not None:
            cand[pinned[0], pinned[1]] = -np.inf
        flat = cand.reshape(-1)
        width = cand.shape[1]
        row_bytes = policy._row_bytes
        while self.bytes > budget:
            i = int(flat.argmax())
            if flat[i] == -np.inf:
                return
            flat[i] = -np.inf
            r, e = divmod(i, width)
            self.resident[r, e] = False
            self.bytes -= row_bytes[r]


POLICIES: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LruPolicy,
    "opt": OptPolicy,
    "reuse": ExpectedReusePolicy,
    "adaptive": AdaptiveReusePolicy,
    "default": AdaptiveReusePolicy,
}


def make_policy(name: str, *, future: Future | None = None) -> EvictionPolicy:
    """A fresh policy. ``future`` (the replayed plan calls) is needed by offline policies only."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown cache policy {name!r} (known: {', '.join(POLICIES)})") from None
    if getattr(factory, "offline", False):
        if future is None:
            raise ConfigError(f"cache policy {name!r} is offline (it reads the future): replay only")
        return factory(future)
    return factory()
