"""Is synthetic routing as cache-friendly as real routing, and no more? LRU curves side by side.

For each route trace given (a real model's, and one recorded from a ``bmoe synth --like`` model
with ``bmoe run --route-trace``), and for the routing generator of ``bmoe.synth.routing`` at the
real trace's shape (its lognormal law, fitted to the real LRU curve, and the real per-slot reuse): the decode hit rate of LRU and of the default policy with a cache of 5, 10, 20,
30 and 50 % of the expert bank (``bmoe.pipeline.simulate``: exact hits, no timing), and the reuse
distances of the decode accesses (how many decode steps since the same layer last routed the same
expert; "first" is a first use). Two traces whose LRU curves and distance shares agree route
alike as far as any cache can tell. Nothing is asserted.

    python bench/lru_curve.py REAL.route.csv SYNTH.route.csv [--tokens 128] [--seed 1]

A synth trace for the comparison, at the real trace's top-k (the shared Qwen3 trace is top-6):

    bmoe synth q3.gguf --like qwen3-30b-a3b --type q4_0 --layers 8
    bmoe run -m q3.gguf -f prompt.txt -n 128 --n-expert-used 6 --route-trace q3.route.csv
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bmoe.pipeline.events import PHASE_DECODE
from bmoe.pipeline.simulate import simulate
from bmoe.pipeline.trace import RouteTrace, read_trace
from bmoe.synth.routing import GRID_LOGNORMAL, RoutingSpec, routing_trace

FRACTIONS = (0.05, 0.10, 0.20, 0.30, 0.50)
DISTANCE_BINS = ((1, 1), (2, 4), (5, 16), (17, 64), (65, None))


def decode_steps(trace: RouteTrace) -> int:
    return len(np.unique(trace.step[trace.phase == PHASE_DECODE]))


def top_k(trace: RouteTrace) -> int:
    """Routed experts per layer and decode step, the most seen (a decode step routes one token)."""
    decode = trace.phase == PHASE_DECODE
    per_step = np.bincount(trace.step[decode].astype(np.int64))
    return int(per_step.max() // len(trace.expert_bytes))


def distances(trace: RouteTrace) -> str:
    decode = trace.phase == PHASE_DECODE
    gaps: list[int] = []
    for layer in np.unique(trace.layer[decode]):
        rows = decode & (trace.layer == layer)
        last: dict[int, int] = {}
        for step, expert in zip(trace.step[rows].tolist(), trace.expert[rows].tolist()):
            gaps.append(step - last[expert] if expert in last else -1)
            last[expert] = step
    a = np.asarray(gaps)
    parts = [f"first {100 * np.mean(a < 0):.1f}"]
    for lo, hi in DISTANCE_BINS:
        inside = (a >= lo) & (a <= hi) if hi is not None else a >= lo
        parts.append(f"{lo}-{hi if hi is not None else ''} {100 * np.mean(inside):.1f}")
    return " | ".join(parts)


def curve(name: str, trace: RouteTrace) -> None:
    bank = trace.n_expert * sum(trace.expert_bytes.values())
    events = trace.layer_events()
    cells = []
    for fraction in FRACTIONS:
        hits = [simulate(trace, policy, int(fraction * bank), events=events).decode_hit_pct
                for policy in ("lru", "default")]
        cells.append("/".join("n/a" if h is None else f"{h:.1f}" for h in hits))
    print(f"{name}: {len(trace.expert_bytes)} MoE layers, {trace.n_expert} experts, top-{top_k(trace)}, "
          f"{decode_steps(trace)} decode steps")
    print("  decode hit % lru/default at " + ", ".join(f"{f:.0%}" for f in FRACTIONS) + " of the bank: "
          + "  ".join(cells))
    print(f"  reuse distance, % of decode accesses (steps): {distances(trace)}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("traces", nargs="+", type=Path, help="route traces; the first is the real one")
    ap.add_argument("--tokens", type=int, default=128, help="decode tokens of the generator's trace")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    traces = [(str(p), read_trace(p)) for p in args.traces]
    for name, trace in traces:
        curve(name, trace)
    real = traces[0][1]
    spec = RoutingSpec(n_expert=real.n_expert, top_k=top_k(real), n_layer=len(real.expert_bytes),
                       law="lognormal", skew=GRID_LOGNORMAL, reuse=0.38, tokens=args.tokens, prompt=8,
                       seed=args.seed)
    curve(f"bmoe.synth.routing at the first trace's shape ({spec})", routing_trace(spec))


if __name__ == "__main__":
    main()
