"""Cache policies replayed on a real route trace: decode hit %, all-phase hit %, bytes read.

For each budget it drives ``ExpertCache`` exactly as the engine does (one plan per layer event, a
prefill ubatch as one event per layer, a trim after every llama_decode call) with ``lru``, the
default policy and ``opt`` (Belady, the offline ceiling), and prints how much of the LRU -> opt gap
the default closes. Deterministic: no timing, nothing asserted.

    python bench/policies.py [TRACE] [--budgets 250,500,1000,2000,4000,6000] [--policies lru,default,opt]
                             [--prefill batch|tokens] [--order engine|recorded]

TRACE defaults to ``shared/traces/qwen3-30b-a3b.route.csv`` beside the repository.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from bmoe.pipeline.simulate import SimResult, simulate
from bmoe.pipeline.trace import default_trace_path, read_trace

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", type=Path, default=default_trace_path())
    p.add_argument("--budgets", default="250,500,1000,2000,4000,6000", help="MiB, comma separated")
    p.add_argument("--policies", default="lru,default,opt")
    p.add_argument("--prefill", choices=("batch", "tokens"), default="batch")
    p.add_argument("--order", choices=("engine", "recorded"), default="engine")
    args = p.parse_args(argv)

    trace = read_trace(args.trace)
    events = trace.layer_events(prefill=args.prefill, order=args.order)
    budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    decode = trace.phase == 1
    sizes = sorted(set(trace.expert_bytes.values()))
    print(f"trace    {args.trace}")
    print(f"model    {trace.model} ({trace.arch}): {len(trace.expert_bytes)} MoE layers, "
          f"{trace.n_expert} experts, top-{trace.n_expert_used}, "
          f"entry {' / '.join(f'{s / MiB:.2f}' for s in sizes)} MiB")
    print(f"tokens   {trace.tokens(0)} prefill + {trace.tokens(1)} decode; one token's working set "
          f"{trace.working_set_bytes() / MiB:.0f} MiB")
    if decode.any():
        print(f"recorded decode hit {100 * trace.residency[decode].mean():.1f} % "
              f"(the residency column: the recording run's own cache)")
    print(f"replay   prefill={args.prefill} order={args.order}, MiB = 2^20 bytes, "
          "hit % = hits / (hits + misses) over unique experts per layer event\n")

    results: dict[tuple[float, str], SimResult] = {}
    t0 = time.perf_counter()
    for b in budgets:
        for name in policies:
            results[(b, name)] = simulate(trace, name, int(b * MiB), events=events)
    elapsed = time.perf_counter() - t0

    head = f"{'MiB':>6} " + " ".join(f"{name:>24}" for name in policies)
    sub = f"{'':>6} " + " ".join(f"{'dec%  all%  read MiB':>24}" for _ in policies)
    gap = "lru" in policies and "opt" in policies and len(policies) > 2
    if gap:
        head += "   gap closed"
        sub += "   (x-lru)/(opt-lru)"
    print(head)
    print(sub)
    for b in budgets:
        cells = []
        for name in policies:
            r = results[(b, name)]
            cells.append(f"{r.decode_hit_pct:6.1f} {r.hit_pct:5.1f} {r.bytes_read / MiB:9.0f}")
        line = f"{b:6.0f} " + " ".join(f"{c:>24}" for c in cells)
        if gap:
            lo, hi = results[(b, "lru")].decode_hit_pct, results[(b, "opt")].decode_hit_pct
            fracs = []
            for name in policies:
                if name in ("lru", "opt"):
                    continue
                x = results[(b, name)].decode_hit_pct
                fracs.append(f"{name} {100 * (x - lo) / (hi - lo):5.1f} %" if hi > lo else f"{name}   n/a")
            line += "   " + ", ".join(fracs)
        print(line)
        worst = max(results[(b, n)].max_resident_bytes for n in policies)
        if worst > b * MiB:
            print(f"       BUDGET BROKEN: {worst / MiB:.1f} MiB resident after a step", file=sys.stderr)
    print(f"\n{len(results)} replays in {elapsed:.1f} s "
          f"({np.mean([len(events)]):.0f} layer events each)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
