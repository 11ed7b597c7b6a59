"""Many streams, one read: batched decoding and n-gram drafts, measured side by side in one run.

For each stream count B (``--streams 1,2,4,8``), B requests arrive together on a session opened
with ``parallel=B`` and decode ``--tokens`` tokens each; the configurations run interleaved, round
after round (B=1, 2, 4, 8, then again), so load drift on a shared machine spreads over all of them.
Each row: aggregate and per-stream decode tok/s (decode steps only: emitted tokens over the decode
steps' wall time), MiB read per generated token, the per-step decomposition (wall, read wait,
compute = wall - wait), the mean sequences per step, and whether every sequence's tokens equal a
resident run of the same schedule (resident run beside it where ``--resident`` says; under a RAM
limit the resident run is llama.cpp's own no-repack mmap, which pages, so it is off by default
there).

Drafts (``--draft``): one stream on a prompt with text to copy and one without, with and without
n-gram drafts: acceptance and tok/s.

Nothing is asserted; the figures say how they were measured. The JSON follows issue 35's shape:
``streams`` (rows) and ``draft`` (``copy`` / ``plain``), plus ``machine`` (cores, load average).

    python bench/streams.py MODEL [--streams 1,2,4,8] [--tokens 32] [--rounds 2] [--cache-mb auto]
                            [--ram-limit GiB] [--resident] [--draft] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session

PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a mixture of experts model chooses which experts to run for each token.",
    "List five ways to keep a vegetable garden healthy through a dry summer.",
    "Describe the water cycle to a ten year old, with one example from daily life.",
    "What are the trade-offs between reading model weights from disk and keeping them in memory?",
    "Summarize the rules of chess for someone who has only played checkers before.",
    "Give three tips for writing clear commit messages in a busy software team.",
    "Why does bread rise, and what changes when you bake it at a higher altitude?",
]
COPY = ("Rewrite this function with one change: rename total to sum.\n\n"
        "def add_all(values):\n    total = 0\n    for v in values:\n        total = total + v\n"
        "    return total\n\nHere is the function with the change:\n\ndef add_all(values):\n")
PLAIN = "Tell me something surprising about octopuses and how they see the world around them."


async def _together(session: Session, prompts: list[str], n: int) -> list[list[int]]:
    gens = await asyncio.gather(*(session.generate(p, n, stop_at_end=False) for p in prompts))
    return [g.tokens for g in gens]


def run_side(model: Path, config: RunConfig, prompts: list[str], n: int) -> dict:
    """One configuration: open, run the prompts together, the figures, close. One stream with no
    draft runs today's turn-by-turn path (no step loop): its decode figures come from the pieces'
    own per-call metrics (each piece after the first is one decode call)."""

    async def plain(s: Session) -> dict:
        pieces = [p async for p in s.stream(prompts[0], n, stop_at_end=False)]
        decode = [p.metrics for p in pieces[1:] if p.metrics is not None]
        wall = sum(m.wall_ms for m in decode) / 1e3
        read = [m.bytes_read for m in decode if m.bytes_read is not None]
        wait = [m.read_wait_ms for m in decode if m.read_wait_ms is not None]
        return {"tokens": [[p.token for p in pieces if p.token is not None]], "decode_s": wall,
                "emitted": len(decode), "decode_steps": len(decode), "batches": [1] * len(decode),
                "bytes": sum(read) if read else None, "wait_s": sum(wait) / 1e3 if wait else None}

    async def stepped(s: Session) -> dict:
        tokens = await _together(s, prompts, n)
        f = s.scheduler.figures
        return {"tokens": tokens, "decode_s": f.decode_wall_s, "emitted": f.emitted_tokens,
                "decode_steps": f.decode_steps, "batches": f.batch_sizes, "bytes": f.decode_bytes_read,
                "wait_s": f.decode_wait_s}

    async def go() -> dict:
        async with await Session.open_async(model, config) as s:
            t0 = time.perf_counter()
            got = await (stepped(s) if s.scheduler is not None else plain(s))
            wall = time.perf_counter() - t0
            steps = max(1, got["decode_steps"])
            emitted = got["emitted"]
            return {
                "tokens": got["tokens"], "wall_s": wall, "decode_s": got["decode_s"], "emitted": emitted,
                "decode_steps": got["decode_steps"],
                "mean_batch": statistics.fmean(got["batches"]) if got["batches"] else None,
                "tok_s": emitted / got["decode_s"] if got["decode_s"] else None,
                "mib_per_token": got["bytes"] / MiB / emitted if got["bytes"] is not None and emitted else None,
                "step_ms": 1e3 * got["decode_s"] / steps,
                "wait_ms": 1e3 * got["wait_s"] / steps if got["wait_s"] is not None else None,
                "budget_mib": s.budget_bytes / MiB if s.budget_bytes is not None else None,
            }

    return asyncio.run(go())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model", type=Path)
    p.add_argument("--streams", default="1,2,4,8")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--cache-mb", default="auto", help="'auto', 0 (off) or MiB")
    p.add_argument("--ram-limit", type=float, default=None, help="GiB left to the page cache and the engine")
    p.add_argument("--resident", action="store_true", help="run resident beside (equal tokens, ceiling)")
    p.add_argument("--draft", action="store_true", help="also measure n-gram drafts (one stream)")
    p.add_argument("--ctx", type=int, default=None, help="context cells (default: 256 per stream)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    counts = [int(x) for x in args.streams.split(",")]
    cache = None if args.cache_mb == "auto" else int(args.cache_mb) * MiB
    balloon = None
    if args.ram_limit is not None:
        from bmoe.bench.balloon import Balloon, plan_balloon
        from bmoe.io.validate import open_layout

        layout = open_layout(args.model)
        plan = plan_balloon(int(args.ram_limit * (1 << 30)), layout.dense_bytes)
        print(f"RAM limit {args.ram_limit} GiB: {plan.how}", flush=True)
        balloon = Balloon(plan.lock_bytes).start().wait_ready() if plan.lock_bytes else None
    try:
        rows: dict[int, list[dict]] = {b: [] for b in counts}
        res_rows: dict[int, list[dict]] = {b: [] for b in counts}
        for r in range(args.rounds):
            for b in counts:
                ctx = args.ctx or 256 * b
                cfg = RunConfig(mode="stream", cache_bytes=cache, parallel=b, n_ctx=ctx)
                side = run_side(args.model, cfg, PROMPTS[:b], args.tokens)
                rows[b].append(side)
                line = (f"round {r + 1} streams {b}: {side['tok_s']:.2f} tok/s aggregate, mean batch "
                        f"{side['mean_batch']:.2f}, step {side['step_ms']:.0f} ms (wait {side['wait_ms'] or 0:.0f}), "
                        f"{side['mib_per_token'] or 0:.1f} MiB/token, budget {side['budget_mib']}")
                if args.resident:
                    res = run_side(args.model, RunConfig(mode="resident", parallel=b, n_ctx=ctx), PROMPTS[:b], args.tokens)
                    res_rows[b].append(res)
                    line += f" | resident {res['tok_s']:.2f} tok/s, equal {side['tokens'] == res['tokens']}"
                print(line, os.getloadavg(), flush=True)
        out = {"machine": {"cores": os.cpu_count(), "loadavg_end": os.getloadavg()},
               "model": str(args.model), "tokens": args.tokens, "rounds": args.rounds,
               "ram_limit_gib": args.ram_limit, "cache": args.cache_mb, "streams": []}
        base = statistics.median(s["tok_s"] for s in rows[counts[0]])
        base_res = statistics.median(s["tok_s"] for s in res_rows[counts[0]]) if args.resident else None
        base_mib = statistics.median(s["mib_per_token"] or 0 for s in rows[counts[0]])
        for b in counts:
            agg = statistics.median(s["tok_s"] for s in rows[b])
            res = statistics.median(s["tok_s"] for s in res_rows[b]) if args.resident else None
            mib = [s["mib_per_token"] for s in rows[b] if s["mib_per_token"] is not None]
            out["streams"].append({
                "streams": b, "aggregate_tok_s": agg, "per_stream_tok_s": agg / b,
                "aggregate_spread": [min(s["tok_s"] for s in rows[b]), max(s["tok_s"] for s in rows[b])],
                "gain_over_one": agg / base if base else None,
                "resident_aggregate_tok_s": res,
                "resident_gain_over_one": res / base_res if res and base_res else None,
                "mib_read_per_token": statistics.median(mib) if mib else None,
                "mib_per_token_vs_one": statistics.median(mib) / base_mib if mib and base_mib else None,
                "step_ms": statistics.median(s["step_ms"] for s in rows[b]),
                "wait_ms": statistics.median(s["wait_ms"] for s in rows[b]) if rows[b][0]["wait_ms"] is not None else None,
                "mean_batch": statistics.median(s["mean_batch"] for s in rows[b]),
                "ttft_p50_s": None, "ttft_p95_s": None,  # measured through the server: bench/serve_load.py
                "tokens_equal_resident": (all(a["tokens"] == r["tokens"] for a, r in zip(rows[b], res_rows[b]))
                                          if args.resident else None),
            })
        if args.draft:
            out["draft"] = {}
            for name, prompt in (("copy", COPY), ("plain", PLAIN)):
                sides = {}
                for r in range(args.rounds):
                    for mode in ("draft", "plain"):
                        cfg = RunConfig(mode="stream", cache_bytes=cache, n_ctx=1024,
                                        draft="ngram" if mode == "draft" else "none")
                        sides.setdefault(mode, []).append(run_side(args.model, cfg, [prompt], args.tokens * 2))
                d, pl = sides["draft"], sides["plain"]
                accept = [s["emitted"] / max(1, s["decode_steps"]) for s in d]
                out["draft"][name] = {
                    "tokens_per_step": statistics.median(accept),
                    "tok_s_draft": statistics.median(s["tok_s"] for s in d),
                    "tok_s_plain": statistics.median(s["tok_s"] for s in pl),
                    "tokens_equal_plain": all(a["tokens"] == b["tokens"] for a, b in zip(d, pl)),
                    "tokens_equal_resident": None,
                }
                print(f"draft {name}: {out['draft'][name]}", flush=True)
        for row in out["streams"]:
            print(json.dumps(row))
        if args.json:
            args.json.write_text(json.dumps(out, indent=1))
    finally:
        if balloon is not None:
            balloon.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
