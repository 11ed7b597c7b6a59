"""Planning cost per layer of each cache policy: microseconds per ``ExpertCache.plan`` call (the
policy's bookkeeping and its evictions) replayed over a route trace, the trims included.

    python bench/policy_cost.py [TRACE] [--budgets 1000,4000] [--policies lru,reuse,default] [--rounds 3]

Wall time of pure Python on a shared machine: compare the policies side by side in one run (they
are interleaved per round and the best round is kept); nothing asserted.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from bmoe.pipeline.cache import ExpertCache
from bmoe.pipeline.policies import make_policy
from bmoe.pipeline.trace import default_trace_path, read_trace

MiB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace", nargs="?", type=Path, default=default_trace_path())
    p.add_argument("--budgets", default="1000,4000")
    p.add_argument("--policies", default="lru,reuse,default")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args(argv)
    trace = read_trace(args.trace)
    events = trace.layer_events()
    policies = [x for x in args.policies.split(",") if x]
    print(f"{trace.path}: {len(events)} plan calls per replay; best of {args.rounds} interleaved rounds")
    for mb in (float(b) for b in args.budgets.split(",")):
        best = {name: float("inf") for name in policies}
        for _ in range(args.rounds):
            for name in policies:
                cache = ExpertCache(int(mb * MiB), trace.expert_bytes, make_policy(name))
                t0 = time.perf_counter()
                for ev in events:
                    cache.plan(ev.layer, ev.experts, ev.ranks)
                    if ev.ends_call:
                        cache.trim()
                best[name] = min(best[name], (time.perf_counter() - t0) / len(events))
        base = best[policies[0]]
        print(f"{mb:7.0f} MiB  " + "  ".join(f"{n} {1e6 * t:6.1f} us ({t / base:4.1f}x)" for n, t in best.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
