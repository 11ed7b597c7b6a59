"""All-cached decode against resident, side by side: what the streaming machinery costs when nothing
has to be read (issue 13's P1 at full depth, where ``bmoe bench --ram-limit`` cannot hold the bank).

Rounds alternate which runs first. Each run is a fresh session: a warm-up generation (which fills
a cache of ``--cache-mb`` with every expert the prompt and its tokens route to), then the same
generation again, measured: decode tok/s after the first token, the median decode step's wall
time (a run's median step is not moved by a few steps slowed by other work, as its mean is), hit
%, and the cache's planning time per token (``cache_s``). Prints one JSON line per run, the median
ratios and each round's ratios to its own resident run (their spread is the noise); nothing
asserted.

``--open-modes user,mmap-drop`` runs each policy under each open: the ``user`` open (what ``auto``
picks for a model that fits its allocation) builds llama.cpp's graph with every optional tensor
the architecture knows (no-op ``.scale`` multiplies and biases, ``bmoe.llama.loader``), the plain
load behind ``mmap-drop`` the same graph as the resident run. Side by side they separate what the
streaming machinery costs from what the user open's graph costs.

    python bench/all_cached.py MODEL [-n 48] [--rounds 4] [--cache-mb 16000] [--policies default,lru]
                                     [--open-modes user,mmap-drop]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session

PROMPT = "The experts of this layer stream from the disk while the next token waits for them."


async def measure(model: Path, config: RunConfig, n: int) -> dict:
    with Session.open(model, config) as s:
        warm = await s.generate(PROMPT, n, stop_at_end=False)
        steps = [p.metrics.wall_ms async for p in s.stream(PROMPT, n, stop_at_end=False)
                 if p.metrics is not None and p.metrics.phase == "decode"]
        st = s.last_stats
    assert st is not None
    return {"tok_per_s": st.tok_per_s, "median_step_ms": statistics.median(steps) if steps else None,
            "hit_pct": st.cache_hit_pct, "bytes_read": st.bytes_read,
            "cache_ms_per_token": None if st.cache_s is None else 1000 * st.cache_s / max(1, st.generated_tokens),
            "tokens": st.generated_tokens, "warm_tokens": len(warm.tokens), "open_mode": st.open_mode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("-n", "--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--cache-mb", type=float, default=16000.0, help="at least the expert bank")
    ap.add_argument("--policies", default="default", help="cache policies to run all cached, comma separated")
    ap.add_argument("--open-modes", default="auto", help="streamed runs' open modes, comma separated (auto, user, "
                    "mmap-drop, reserved)")
    args = ap.parse_args()
    configs = {"resident": RunConfig(mode="resident", n_ctx=512)}
    modes = [m for m in args.open_modes.split(",") if m]
    for p in args.policies.split(","):
        for m in modes:
            name = f"all_cached_{p}" if modes == ["auto"] else f"all_cached_{p}_{m}"
            configs[name] = RunConfig(mode="stream", n_ctx=512, cache_bytes=int(args.cache_mb * MiB),
                                      force_cache=True, cache_policy=p, open_mode=m)
    tok: dict[str, list[float | None]] = {name: [] for name in configs}
    step: dict[str, list[float | None]] = {name: [] for name in configs}
    for r in range(args.rounds):
        names = list(configs) if r % 2 == 0 else list(reversed(configs))
        for name in names:
            d = asyncio.run(measure(args.model, configs[name], args.tokens))
            print(json.dumps({"run": name, "round": r, **d}), flush=True)
            tok[name].append(d["tok_per_s"] or None)
            step[name].append(d["median_step_ms"] or None)
    base = statistics.median(v for v in tok["resident"] if v) if any(tok["resident"]) else None
    for name, values in tok.items():
        measured = [v for v in values if v]
        if name == "resident" or not measured or base is None:
            continue
        # Each round's ratio to that round's resident run: the spread says how far to trust the median.
        pairs = [f"{v / b:.2f}" if v and b else "null" for v, b in zip(values, tok["resident"])]
        print(f"{name}: median {statistics.median(measured):.2f} tok/s = "
              f"{statistics.median(measured) / base:.2f}x resident ({base:.2f}); per round {' / '.join(pairs)}")
        # The same by each run's median step (resident step / this step: above 1 is faster).
        steps = [(b / v if v and b else None) for v, b in zip(step[name], step["resident"])]
        shown = [f"{r:.2f}" if r else "null" for r in steps]
        known = [r for r in steps if r]
        if known:
            print(f"{name}: by median step, median of rounds {statistics.median(known):.3f}x resident; "
                  f"per round {' / '.join(shown)}")


if __name__ == "__main__":
    main()
