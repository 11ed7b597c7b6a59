"""Cache policies over a grid of synthetic routing: each policy's share of the LRU -> Belady gap.

A policy designed on one real trace is judged here on the space real models occupy (expert count,
top-k, depth, popularity skew, per-slot reuse; corners and their sources in
``bmoe/synth/routing.py``). For every cell (a model shape x a skew x a reuse) and budget it
replays ``lru``, the policies asked for and ``opt`` (Belady, the ceiling) through ``simulate`` and
reports, per policy, the share of the gap closed, ``(x - lru) / (opt - lru)`` in decode hits,
its worst cell, the median, and the largest drop below LRU. A cell whose gap is under one point
has no meaningful share and only counts for the drop. Deterministic; nothing asserted.

    python bench/policy_grid.py [--policies default] [--tokens 96] [--prompt 16]
                                [--shapes qwen3-30b,...] [--quick] [--csv FILE]
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from bmoe.pipeline.simulate import simulate
from bmoe.synth.routing import (
    GRID_BUDGETS_BANK,
    GRID_BUDGETS_WS,
    GRID_REUSES,
    GRID_SHAPES,
    GRID_SKEWS,
    RoutingSpec,
    measure,
    routing_trace,
)


@dataclass(frozen=True)
class Row:
    shape: str
    skew: float
    reuse_wanted: float
    reuse: float  # measured
    budget: str  # e.g. "2.0ws" or "0.25bank"
    budget_bytes: int
    hits: dict[str, float]  # policy -> decode hit %

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
        for skew in GRID_SKEWS:
            for reuse in GRID_REUSES:
                yield name, RoutingSpec(n_expert=n_expert, top_k=k, n_layer=n_layer, skew=skew, reuse=reuse,
                                        tokens=tokens, prompt=prompt, expert_bytes=1 << 20)


def sweep(shapes: Sequence[str], policies: Sequence[str], tokens: int, prompt: int,
          skip_floor: bool = True) -> Iterator[Row]:
    """Every cell and budget; a reuse asked below what the cell's popularity already gives is
    skipped (it would repeat the cell at its floor), except the lowest."""
    names = ["lru", *[p for p in policies if p not in ("lru", "opt")], "opt"]
    for shape, spec in cells(shapes, tokens, prompt):
        trace = routing_trace(spec)
        stats = measure(trace)
        if skip_floor and spec.reuse != min(GRID_REUSES) and stats.reuse < spec.reuse - 0.04:
            continue
        events = trace.layer_events()
        for label, b in budgets(spec):
            hits = {p: simulate(trace, p, b, events=events).decode_hit_pct for p in names}
            yield Row(shape, spec.skew, spec.reuse, stats.reuse, label, b, hits)


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


def _name(r: Row) -> str:
    return f"{r.shape} skew={r.skew:g} reuse={r.reuse:.2f} budget={r.budget}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policies", default="default", help="besides lru and opt, comma separated")
    p.add_argument("--tokens", type=int, default=96)
    p.add_argument("--prompt", type=int, default=16)
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
    print(f"{'shape':>16} {'skew':>4} {'reuse':>5} {'budget':>8}  " + " ".join(f"{n:>7}" for n in
          ["lru", *policies, "opt"]) + "  share")
    for r in sweep(shapes, policies, args.tokens, args.prompt):
        rows.append(r)
        shares = " ".join("   n/a" if r.share(x) is None else f"{100 * r.share(x):5.1f}%" for x in policies)
        print(f"{r.shape:>16} {r.skew:4.2f} {r.reuse:5.2f} {r.budget:>8}  "
              + " ".join(f"{r.hits[n]:7.1f}" for n in ["lru", *policies, "opt"]) + f"  {shares}", flush=True)
    print(f"\n{len(rows)} cells x budgets, {args.tokens} decode + {args.prompt} prompt tokens each, "
          f"{time.perf_counter() - t0:.0f} s; decode hit %, share = (x - lru) / (opt - lru)")
    for x in policies:
        print(summarise(rows, x))
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["shape", "skew", "reuse_wanted", "reuse", "budget", "budget_bytes", *rows[0].hits])
            for r in rows:
                w.writerow([r.shape, r.skew, r.reuse_wanted, f"{r.reuse:.3f}", r.budget, r.budget_bytes,
                            *(f"{v:.2f}" for v in r.hits.values())])
    return 0


if __name__ == "__main__":
    sys.exit(main())
