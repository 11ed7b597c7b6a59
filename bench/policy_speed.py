"""Decode tok/s with two cache policies on one model at a few budgets, side by side.

Each round generates the same tokens with every (budget, policy) pair in turn (greedy: every
pair computes the same tokens, so only the reads differ) and keeps the median tok/s per pair
over rounds; ratios to the first policy are what to read on a shared machine.

    python bench/policy_speed.py MODEL [--budgets 300,600] [--policies reuse,default] [-n 64] [--rounds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session

PROMPT = "Explain how a mixture-of-experts model decides which experts handle each token."


async def _one(model: Path, mb: float, policy: str, n: int) -> tuple[float, float, list[int]]:
    config = RunConfig(n_ctx=512, cache_bytes=int(mb * MiB), cache_policy=policy)
    with Session.open(model, config) as s:
        t0 = time.perf_counter()
        gen = await s.generate(PROMPT, n, stop_at_end=False)
        wall = time.perf_counter() - t0
        st = gen.stats
        hit = st.cache_hit_pct or 0.0
        return n / wall, hit, gen.tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--budgets", default="300,600")
    p.add_argument("--policies", default="reuse,default")
    p.add_argument("-n", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    budgets = [float(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    speeds: dict[tuple[float, str], list[float]] = {}
    hits: dict[tuple[float, str], float] = {}
    tokens = None
    for _ in range(args.rounds):
        for mb in budgets:
            for pol in policies:
                tps, hit, toks = asyncio.run(_one(args.model, mb, pol, args.n))
                speeds.setdefault((mb, pol), []).append(tps)
                hits[(mb, pol)] = hit
                if tokens is None:
                    tokens = toks
                elif toks != tokens:
                    print(f"TOKENS DIFFER at {mb} MiB {pol}", file=sys.stderr)
                    return 1
    print(f"{args.model.name}: {args.n} tokens (prefill included in wall time), median of {args.rounds} rounds")
    for mb in budgets:
        base = statistics.median(speeds[(mb, policies[0])])
        cells = [f"{pol} {statistics.median(speeds[(mb, pol)]):6.2f} tok/s ({statistics.median(speeds[(mb, pol)]) / base:4.2f}x, "
                 f"hit {hits[(mb, pol)]:4.1f} %)" for pol in policies]
        print(f"{mb:6.0f} MiB  " + "  ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
