"""Cache policies over a grid of synthetic routing: each policy's share of the LRU -> Belady gap.

A policy designed on one real trace is judged here on the space real models occupy (expert count,
top-k, depth, popularity skew, per-slot reuse; corners and their sources in
``bmoe/synth/routing.py``). For every cell (a model shape x a skew x a reuse) and budget it
replays ``lru``, the policies asked for and ``opt`` (Belady, the ceiling) through ``simulate`` and
reports, per policy, the share of the gap closed, ``(x - lru) / (opt - lru)`` in decode hits,
its worst cell, the median, and the largest drop below LRU. A cell whose gap is under one point
has no meaningful share and only counts for the drop. Deterministic; nothing asserted.

``oracle`` is a reference that knows what no run does: the generator's own popularity, each
expert's chance of being routed by a fresh draw. It keeps the entries most likely to be routed and
ignores recency. With routing drawn independently per token (a cell whose reuse is its popularity
floor: no carry-over), that is the optimal online policy (the independent reference model's A0), so
where it closes under a quarter of the gap no online policy can close more than it does; the
summary counts those cells. With carry-over, recency matters and it is no bound.
``--policies default,oracle`` to see it.

``markov`` knows the generator's whole model: the popularity and each layer's carry-over ``c``
(a slot keeps its expert with probability ``c``, else draws afresh), so each resident entry's
exact chance of being routed at its layer's next visit. It keeps the likeliest. Not a proven
bound with carry-over (the best policy for a Markov source may look further than one visit),
but what a policy that learned the source perfectly would do greedily: where it closes under a
quarter of the gap, the shortfall is the routing's, not the learning's.

``warm`` is the default policy seeded, as ``--cache-profile`` seeds it, from the profile an
earlier session of the same model saved (same popularity and carry-over, other tokens, as long):
what a user who keeps a profile beside the model gets from the second run on.

    python bench/policy_grid.py [--policies default] [--tokens 64] [--prompt 8]
                                [--shapes qwen3-30b,...] [--quick] [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import heapq
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np

from bmoe.pipeline.policies import Entry, EvictionPolicy, make_policy
from bmoe.pipeline.simulate import simulate
from bmoe.synth.routing import (
    GRID_BUDGETS_BANK,
    GRID_BUDGETS_WS,
    GRID_LOGNORMAL,
    GRID_REUSES,
    GRID_SHAPES,
    GRID_SKEWS,
    RoutingSpec,
    draw,
    measure,
    popularity,
    routing_trace,
)


class PopularityOracle:
    """Evict the resident entry a fresh draw is least likely to route (ties: least recently used),
    from the generator's own inclusion probabilities (layers x experts)."""

    name = "oracle"

    def __init__(self, incl: np.ndarray) -> None:
        self._incl = incl
        self._key: dict[Entry, tuple[float, int]] = {}  # resident entry -> its heap key
        self._heap: list[tuple[float, int, Entry]] = []
        self._held: list[Entry] = []
        self._seq = 0

    def _p(self, entry: Entry) -> float:
        """The chance a fresh draw routes ``entry``: the eviction key (lowest first)."""
        return float(self._incl[entry])

    def _push(self, entry: Entry) -> None:
        self._flush()
        self._seq += 1
        key = self._key[entry] = (self._p(entry), self._seq)
        heapq.heappush(self._heap, (*key, entry))

    def _flush(self) -> None:
        held, self._held = self._held, []
        for entry in held:
            if entry in self._key:
                heapq.heappush(self._heap, (*self._key[entry], entry))

    used = admitted = _push

    def removed(self, entry: Entry) -> None:
        del self._key[entry]

    def victims(self) -> Iterator[Entry]:
        self._flush()
        while self._heap:
            p, seq, entry = heapq.heappop(self._heap)
            if self._key.get(entry) != (p, seq):
                continue  # stale: evicted, or used since
            self._held.append(entry)
            yield entry


class MarkovOracle(PopularityOracle):
    """Evict the resident entry least likely to be routed at its layer's next visit, from the
    generator's whole model: a slot keeps its previous expert with the layer's carry-over ``c``,
    else draws fresh from the popularity, so ``P = c + (1 - c) q`` for an expert of the layer's
    last set and ``(1 - c) q`` for any other (``q`` its inclusion probability)."""

    name = "markov"

    def __init__(self, incl: np.ndarray, carry: np.ndarray) -> None:
        super().__init__(incl)
        self._carry = carry
        self._last: dict[int, frozenset[int]] = {}

    def _p(self, entry: Entry) -> float:
        layer, e = entry
        c = float(self._carry[layer])
        return (c if e in self._last.get(layer, ()) else 0.0) + (1.0 - c) * float(self._incl[entry])

    def routed(self, layer: int, experts: tuple[int, ...], ranks: tuple[int, ...] | None = None) -> None:
        old = self._last.get(layer, frozenset())
        self._last[layer] = new = frozenset(experts)
        for e in old - new:
            if (layer, e) in self._key:
                self._push((layer, e))  # out of the last set: back to its popularity


def inclusion(spec: RoutingSpec, draws: int = 512) -> tuple[np.ndarray, np.ndarray]:
    """The generator's per-layer inclusion probabilities (sampled from its popularity with a seed
    of their own, so nothing of the replayed trace leaks in) and its per-layer carry-over."""
    logp = popularity(spec, np.random.default_rng(spec.seed))  # the trace's own first draw
    rng = np.random.default_rng(spec.seed + 1_000_003)
    incl = np.zeros_like(logp)
    rows = np.arange(spec.n_layer)[:, None]
    for _ in range(draws):
        incl[rows, draw(logp, spec.top_k, rng)] += 1.0
    incl /= draws
    floor = (incl**2).sum(axis=1) / spec.top_k
    carry = np.clip((spec.reuse - floor) / np.maximum(1.0 - floor, 1e-9), 0.0, 0.999)
    return incl, carry


def learned_usage(spec: RoutingSpec) -> tuple[dict[int, np.ndarray], float]:
    """What a cache profile saved by an earlier run of the same model holds: the default policy's
    usage after another session (same popularity and carry-over, other tokens, same length), and
    the visits it rests on."""
    learner: list[EvictionPolicy] = []

    def factory(_events: object) -> EvictionPolicy:
        learner.append(make_policy("default"))
        return learner[0]

    earlier = routing_trace(replace(spec, session=1))
    simulate(earlier, factory, sum(earlier.expert_bytes.values()) * spec.n_expert)
    return learner[0].usage(), learner[0].evidence()  # type: ignore[attr-defined]


def seeded(usage: dict[int, np.ndarray], visits: float) -> EvictionPolicy:
    """The default policy seeded from a profile, as ``--cache-profile`` does at open."""
    policy = make_policy("default")
    policy.seed(usage, visits=visits)  # type: ignore[attr-defined]
    policy.name = "warm"
    return policy


@dataclass(frozen=True)
class Row:
    shape: str
    law: str
    skew: float
    reuse_wanted: float
    reuse: float  # measured
    budget: str  # e.g. "2.0ws" or "0.25bank"
    budget_bytes: int
    hits: dict[str, float]  # policy -> decode hit %
    carry: float  # the generator's mean per-slot carry-over: 0 = independent draws per token

    def share(self, policy: str) -> float | None:
        lo, hi = self.hits["lru"], self.hits["opt"]
        return (self.hits[policy] - lo) / (hi - lo) if hi - lo >= 1.0 else None


def budgets(spec: RoutingSpec) -> Iterator[tuple[str, int]]:
    ws = spec.n_layer * spec.top_k * spec.expert_bytes
    bank = spec.n_layer * spec.n_expert * spec.expert_bytes
    seen = set()
    for f in GRID_BUDGETS_WS:
        b = int(f * ws)
        if b < bank and b not in seen:
            seen.add(b)
            yield f"{f:g}ws", b
    for f in GRID_BUDGETS_BANK:
        b = int(f * bank)
        if b > 4 * ws and b not in seen:
            seen.add(b)
            yield f"{f:g}bank", b


def cells(shapes: Sequence[str], tokens: int, prompt: int) -> Iterator[tuple[str, RoutingSpec]]:
    for name in shapes:
        n_expert, k, n_layer = GRID_SHAPES[name]
        for law, skew in [*(("zipf", s) for s in GRID_SKEWS), ("lognormal", GRID_LOGNORMAL)]:
            for reuse in GRID_REUSES:
                yield name, RoutingSpec(n_expert=n_expert, top_k=k, n_layer=n_layer, skew=skew, reuse=reuse,
                                        tokens=tokens, prompt=prompt, expert_bytes=1 << 20, law=law)


def sweep(shapes: Sequence[str], policies: Sequence[str], tokens: int, prompt: int,
          skip_floor: bool = True) -> Iterator[Row]:
    """Every cell and budget; a reuse that the cell's popularity already gives (measured within 3
    points of the previous, lower one) is skipped: it would repeat the cell at its floor."""
    names = ["lru", *[p for p in policies if p not in ("lru", "opt")], "opt"]
    floors: dict[tuple[str, str, float], float] = {}
    for shape, spec in cells(shapes, tokens, prompt):
        trace = routing_trace(spec)
        stats = measure(trace)
        key = (shape, spec.law, spec.skew)
        if skip_floor and key in floors and stats.reuse < floors[key] + 0.03:
            continue  # the popularity floor already gives this reuse: the same cell again
        floors[key] = stats.reuse
        events = trace.layer_events()
        incl, carry = inclusion(spec)
        factories = {"oracle": lambda _events: PopularityOracle(incl),  # noqa: B023 - used in this iteration
                     "markov": lambda _events: MarkovOracle(incl, carry)}  # noqa: B023
        if "warm" in names:
            usage, visits = learned_usage(spec)
            factories["warm"] = lambda _events: seeded(usage, visits)  # noqa: B023
        for label, b in budgets(spec):
            hits = {p: simulate(trace, factories.get(p, p), b, events=events).decode_hit_pct for p in names}
            yield Row(shape, spec.law, spec.skew, spec.reuse, stats.reuse, label, b, hits, float(carry.mean()))


def summarise(rows: Sequence[Row], policy: str) -> str:
    shares = [(r.share(policy), r) for r in rows if r.share(policy) is not None]
    drops = [(r.hits["lru"] - r.hits[policy], r) for r in rows]
    if not shares:
        return f"{policy}: no cell with a gap of a point or more"
    worst, wr = min(shares, key=lambda x: x[0])
    drop, dr = max(drops, key=lambda x: x[0])
    med = statistics.median(s for s, _ in shares)
    return (f"{policy}: median share {100 * med:.1f} % over {len(shares)} cells; worst {100 * worst:.1f} % at "
            f"{_name(wr)} (lru {wr.hits['lru']:.1f} / {policy} {wr.hits[policy]:.1f} / opt {wr.hits['opt']:.1f}); "
            f"largest drop below lru {drop:.2f} points at {_name(dr)}; "
            f"cells under a quarter of the gap: {sum(s < 0.25 for s, _ in shares)}")


def _under_a_quarter(rows: Sequence[Row], policy: str) -> list[Row]:
    return [r for r in rows if r.share(policy) is not None and r.share(policy) < 0.25]


def _name(r: Row) -> str:
    return f"{r.shape} {r.law} skew={r.skew:g} reuse={r.reuse:.2f} budget={r.budget}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="default", help="besides lru and opt, comma separated")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prompt", type=int, default=8)
    p.add_argument("--shapes", default=",".join(GRID_SHAPES))
    p.add_argument("--quick", action="store_true", help="three shapes, 48 tokens")
    p.add_argument("--csv", default=None)
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    if args.quick:
        shapes, args.tokens = ["gpt-oss-20b", "gpt-oss-120b@k2", "qwen3-30b"], 48
    unknown = [s for s in shapes if s not in GRID_SHAPES]
    if unknown:
        p.error(f"unknown shapes {unknown}; known: {', '.join(GRID_SHAPES)}")
    policies = [x for x in args.policies.split(",") if x]
    t0 = time.perf_counter()
    rows = []
    print(f"{'shape':>16} {'law':>4} {'skew':>4} {'reuse':>5} {'budget':>8}  " + " ".join(f"{n:>7}" for n in
          ["lru", *policies, "opt"]) + "  share")
    for r in sweep(shapes, policies, args.tokens, args.prompt):
        rows.append(r)
        shares = " ".join("   n/a" if r.share(x) is None else f"{100 * r.share(x):5.1f}%" for x in policies)
        print(f"{r.shape:>16} {r.law[:4]:>4} {r.skew:4.2f} {r.reuse:5.2f} {r.budget:>8}  "
              + " ".join(f"{r.hits[n]:7.1f}" for n in ["lru", *policies, "opt"]) + f"  {shares}", flush=True)
    print(f"\n{len(rows)} cells x budgets, {args.tokens} decode + {args.prompt} prompt tokens each, "
          f"{time.perf_counter() - t0:.0f} s; decode hit %, share = (x - lru) / (opt - lru)")
    for x in policies:
        print(summarise(rows, x))
    online = [x for x in policies if x not in ("oracle", "markov")]
    if "markov" in policies:
        for x in online:
            under = _under_a_quarter(rows, x)
            bound = [r for r in under if r.share("markov") < 0.25]
            print(f"{x}: {len(under)} cells under a quarter of the gap; in {len(bound)} of them the Markov "
                  f"oracle (the generator's exact next-visit probabilities) is under a quarter too; "
                  f"median {x} - markov share over all cells "
                  f"{100 * statistics.median(r.share(x) - r.share('markov') for r in rows if r.share(x) is not None):+.1f} points")
    if "oracle" in policies:
        for x in online:
            under = _under_a_quarter(rows, x)
            iid = [r for r in under if r.carry == 0.0]
            bound = [r for r in iid if r.share("oracle") < 0.25]
            print(f"{x}: {len(under)} cells under a quarter of the gap; {len(iid)} of them draw each token "
                  f"independently (no carry-over), where the popularity oracle is the best online policy: "
                  f"in {len(bound)} of those it is under a quarter too (out of any online policy's reach), "
                  f"in {len(iid) - len(bound)} it is not")
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "law", "skew", "reuse_wanted", "reuse", "budget", "budget_bytes", *rows[0].hits])
            for r in rows:
                w.writerow([r.shape, r.law, r.skew, r.reuse_wanted, f"{r.reuse:.3f}", r.budget, r.budget_bytes,
                            *(f"{v:.2f}" for v in r.hits.values())])
    return 0


if __name__ == "__main__":
    sys.exit(main())
