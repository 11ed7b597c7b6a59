"""Memory mappings over a long-running session, as a server's would grow. Nothing is asserted.

Page moves between expert slots (``bmoe.io.regions.move_pages``) split the regions' mappings; an
evicted slot mapped afresh merges back (``renew_pages``). This runs one session through many
generations, each on a different prompt so that routing moves around the bank, and reports the
process's mappings (lines of ``/proc/self/maps``) after every few, with the tok/s, the cache's
hit rate and the bytes recycled. Past 3/5 of ``vm.max_map_count`` recycling turns itself off and
misses fault their pages in, so a count that keeps growing is a server that slows down one day.

    python bench/map_growth.py MODEL [--cache-mb 600] [--generations 40] [-n 32] [--every 5] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from bmoe.engine.aio import run as run_async
from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.regions import map_count, map_count_limit

TOPICS = ["rivers", "compilers", "bread", "glaciers", "chess", "violins", "tides", "bees", "volcanoes",
          "lighthouses", "printing", "orbits", "moss", "bridges", "ink", "owls", "clocks", "salt", "kites", "caves"]


def prompt(i: int) -> str:
    a, b = TOPICS[i % len(TOPICS)], TOPICS[(i * 7 + 3) % len(TOPICS)]
    return f"Request {i}: write a short note on {a}, then compare {a} with {b}."


async def soak(model: Path, cache_mb: int, generations: int, n: int, every: int) -> dict:
    config = RunConfig(n_ctx=512, cache_bytes=cache_mb * MiB)
    rows = []
    with Session.open(model, config) as s:
        opened = map_count()
        tokens = hits = routed = recycled = 0
        t0 = time.perf_counter()
        for i in range(generations):
            g = await s.generate(prompt(i), n, stop_at_end=False)
            st = g.stats
            tokens += len(g.tokens)
            hits += st.cache_hits or 0
            routed += st.experts_routed or 0
            recycled += st.recycled_bytes or 0
            if (i + 1) % every == 0 or i + 1 == generations:
                wall = time.perf_counter() - t0
                row = {"generations": i + 1, "maps": map_count(), "maps_over_open": map_count() - opened,
                       "tok_s": round(tokens / wall, 2), "hit_pct": round(100 * hits / max(routed, 1), 1),
                       "recycled_mib": recycled >> 20, "recycling": s._streaming.residency.recycle}
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
                tokens = hits = routed = recycled = 0
                t0 = time.perf_counter()
    return {"model": model.name, "cache_mb": cache_mb, "tokens_per_generation": n,
            "map_count_limit": map_count_limit(), "maps_at_open": opened, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", type=Path)
    p.add_argument("--cache-mb", type=int, default=600)
    p.add_argument("--generations", type=int, default=40)
    p.add_argument("-n", type=int, default=32, help="tokens per generation")
    p.add_argument("--every", type=int, default=5, help="generations between two reports")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    result = run_async(soak(a.model, a.cache_mb, a.generations, a.n, a.every))
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        first, last = result["rows"][0], result["rows"][-1]
        print(f"{result['model']}, cache {a.cache_mb} MiB: mappings {result['maps_at_open']} at open, "
              f"{first['maps']} after {first['generations']} generations, {last['maps']} after {last['generations']} "
              f"(limit {result['map_count_limit']}); tok/s {first['tok_s']} -> {last['tok_s']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
