"""What streaming costs per decode step when nothing is read, measured inside one process.

``bench/all_cached.py`` compares an all-cached streamed run with a resident one in separate
processes, and on a shared 2-core machine runs of one configuration spread by 20-40 %, far more
than the overhead looked for. This script holds one streamed session whose cache holds every
expert the prompt routes to, and alternates blocks of decode steps in two modes on the same
context, the same memory, the same moment:

- ``bare``: the eval callback answers nothing (the C filter passes no node: no graph split, no
  Python, no routing): llama.cpp computes on the very same expert bytes as a resident run would;
- ``python``: streamed, but every routing handed to the Python gate (the C filter's routing fast
  path off), as before that fast path existed;
- ``streamed``: the normal path (routing served in C or Python, the cache told every routing,
  the step-end bookkeeping).

A step is the time between two tokens reaching the caller: the decode call, sampling and the
step-end bookkeeping. It reports each mode's median step and its ratio to bare (1.0 = free;
the spread of the per-round ratios is the noise). What it does not
see is where the bytes live (bmoe's regions here; llama.cpp's file mapping in a resident run):
``all_cached.py`` covers that, noisily. Needs the C node filter.

    python bench/streaming_overhead.py MODEL [--rounds 8] [--steps 16] [--cache-mb 16000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session

PROMPT = "The experts of this layer stream from the disk while the next token waits for them."


async def measure(model: Path, args: argparse.Namespace) -> dict:
    config = RunConfig(mode="stream", n_ctx=1024, cache_bytes=int(args.cache_mb * MiB), force_cache=True)
    modes = ("bare", "python", "streamed")
    steps: dict[str, list[float]] = {m: [] for m in modes}
    rounds: list[dict[str, float]] = []
    with Session.open(model, config) as s:
        cb = s._callback  # noqa: SLF001 - the bench switches its filter between blocks
        nf = cb.node_filter
        if nf is None:
            raise SystemExit("needs the C node filter (a C compiler)")
        plain_narrow = cb._narrow  # noqa: SLF001
        warm = await s.generate(PROMPT, args.steps * 2, stop_at_end=False)  # fills the cache
        for r in range(args.rounds):
            this: dict[str, float] = {}
            for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
                if mode == "bare":
                    cb._narrow = lambda: (nf.narrow(b"\xff\xfe"), nf.set_fast(False))  # noqa: SLF001
                elif mode == "python":
                    cb._narrow = lambda: (plain_narrow(), nf.set_fast(False))  # noqa: SLF001
                else:
                    cb.__dict__.pop("_narrow", None)
                times = []
                async for piece in s.stream(PROMPT, args.steps, stop_at_end=False):
                    if piece.token is not None:
                        times.append(time.perf_counter())
                gaps = [1000 * (b - a) for a, b in zip(times[1:], times[2:])]  # after the first decode step
                steps[mode] += gaps
                this[mode] = statistics.median(gaps)
            rounds.append(this)
        cb.__dict__.pop("_narrow", None)
        stats = s.last_stats
    med = {m: statistics.median(v) for m, v in steps.items()}
    return {"median_step_ms": med, "over_bare": {m: med["bare"] / med[m] for m in modes},
            "per_round_over_bare": {m: [round(x["bare"] / x[m], 3) for x in rounds] for m in modes},
            "steps": {m: len(v) for m, v in steps.items()}, "warm_tokens": len(warm.tokens),
            "node_filter": stats.node_filter if stats else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=16, help="decode steps per block (one generation)")
    ap.add_argument("--cache-mb", type=float, default=16000.0, help="at least the expert bank")
    args = ap.parse_args()
    out = asyncio.run(measure(args.model, args))
    print(json.dumps(out))
    for m, ms in out["median_step_ms"].items():
        rounds = " / ".join(f"{x:.2f}" for x in out["per_round_over_bare"][m])
        print(f"{m:9} median step {ms:7.2f} ms = {out['over_bare'][m]:.3f}x the bare speed; per round {rounds}")


if __name__ == "__main__":
    main()
