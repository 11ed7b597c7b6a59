"""What batching saves in reads, on real routing: a route trace's decode replayed as B concurrent
streams (``RouteTrace.batched``), through the cache simulator at a few budgets.

Per stream count B: the distinct experts a step must hold over B x k (the union's share: what a
step reads with the cache off, per generated token, against one stream), and at each budget the
decode bytes read per generated token and the decode hit rate, against B = 1 at the same budget.
The streams are cut from one recorded request (see ``RouteTrace.batched``). Modelled, not timed:
nothing here runs a model.

    python bench/batch_reads.py [TRACE] [--streams 1,2,4,8] [--budgets 500,1000,2000,4000] [--policy default]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bmoe.pipeline.simulate import simulate
from bmoe.pipeline.trace import read_trace

MiB = 1 << 20
DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "traces" / "qwen3-30b-a3b.route.csv"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", type=Path, default=DEFAULT)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--budgets", default="500,1000,2000,4000", help="MiB")
    p.add_argument("--policy", default="default")
    args = p.parse_args(argv)
    trace = read_trace(args.trace)
    counts = [int(x) for x in args.streams.split(",")]
    budgets = [int(x) for x in args.budgets.split(",")]
    base: dict[int, float] = {}
    print(f"{trace.model}: {trace.tokens(1)} decoded tokens, top-{trace.n_expert_used} of {trace.n_expert}")
    print("streams  union/(B*k)  " + "  ".join(f"{b:>5} MiB: MiB/token (x B=1) hit%" for b in budgets))
    for n in counts:
        bt = trace.batched(n)
        evs = [e for e in bt.layer_events() if e.phase == 1]
        share = sum(len(e.experts) for e in evs) / (len(evs) * n * trace.n_expert_used)
        cells = []
        for budget in budgets:
            r = simulate(bt, args.policy, budget * MiB)
            per_token = r.bytes_read / MiB / (bt.tokens(1) * n)
            base.setdefault(budget, per_token)
            cells.append(f"{per_token:10.1f} ({per_token / base[budget]:.2f}) {r.decode_hit_pct:5.1f}")
        print(f"{n:7d}  {share:11.2f}  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
