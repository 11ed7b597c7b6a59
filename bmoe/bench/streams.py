"""``bmoe bench --streams 1,2,4,8 [--draft ngram]``: many streams, one read. Batched decoding and
n-gram drafts, measured side by side in one run.

For each stream count B, B requests arrive together on a session opened with ``parallel=B`` (one
stream with no draft: today's turn-by-turn path) and decode ``--tokens`` tokens each; the counts
run interleaved, round after round (``--rounds``), so load drift on a shared machine spreads over
all of them. Each row: aggregate and per-stream decode tok/s (decode steps only: the tokens they
emitted over their wall time), MiB read per generated token, the per-step decomposition (wall, read
wait, compute = wall - wait), the mean sequences per step, and whether every sequence's tokens equal
a resident run of the same schedule, run beside it where the model fits the memory the runs have
(under ``--ram-limit`` it rarely does: then null, unmeasured). Drafts: one stream on a prompt with
text to copy and one without, with and without n-gram drafts. The JSON follows issue 35's shape:
``streams`` (rows) and ``draft`` (``copy`` / ``plain``). Time to first token with several clients
is measured through the server by ``bench/serve_load.py``: null here."""


from __future__ import annotations

import asyncio
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bmoe.bench.balloon import Balloon, plan_balloon
from bmoe.bench.options import BenchOptions
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


def run_side(model: Path, config: RunConfig, prompts: list[str], n: int) -> dict[str, Any]:
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
                "bytes": sum(read) if read else None, "wait_s": sum(wait) / 1e3 if wait else None,
                "accept_rate": None}

    async def stepped(s: Session) -> dict:
        tokens = await _together(s, prompts, n)
        f = s.scheduler.figures
        stats = s.last_stats
        drafted = stats.draft_tokens if stats is not None else None
        return {"tokens": tokens, "decode_s": f.decode_wall_s, "emitted": f.emitted_tokens,
                "decode_steps": f.decode_steps, "batches": f.batch_sizes, "bytes": f.decode_bytes_read,
                "wait_s": f.decode_wait_s,
                "accept_rate": stats.draft_accepted / drafted if drafted else None}

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
                "accept_rate": got["accept_rate"],
            }

    return asyncio.run(go())


def measure_streams(opts: BenchOptions, log: Callable[[str], None] = lambda _l: None) -> dict[str, Any]:
    """The streams study (and the drafts one when ``opts.draft``), as one JSON-ready object."""
    from bmoe.io.validate import open_layout

    counts = list(opts.streams)
    layout = open_layout(opts.model)
    cache = None  # auto: what the memory model gives each configuration
    balloon = None
    available = None
    if opts.ram_limit_bytes is not None:
        plan = plan_balloon(opts.ram_limit_bytes, layout.dense_bytes)
        log(f"RAM limit {opts.ram_limit_bytes / (1 << 30):g} GiB: {plan.how}")
        balloon = Balloon(plan.lock_bytes).start().wait_ready() if plan.lock_bytes else None
        available = opts.ram_limit_bytes
    else:
        from bmoe.pipeline.budget import read_memory

        available = read_memory().available
    resident_fits = layout.file_bytes + (512 << 20) <= available
    common = {"io_threads": opts.io_threads, "n_threads": opts.n_threads}
    try:
        rows: dict[int, list[dict]] = {b: [] for b in counts}
        res_rows: dict[int, list[dict]] = {b: [] for b in counts}
        loads: list[float] = []
        for r in range(opts.rounds):
            for b in counts:
                ctx = 256 * b
                side = run_side(opts.model, RunConfig(mode="stream", cache_bytes=cache, parallel=b, n_ctx=ctx,
                                                      **common), PROMPTS[:b], opts.tokens)
                rows[b].append(side)
                line = (f"round {r + 1} streams {b}: {side['tok_s']:.2f} tok/s aggregate, mean batch "
                        f"{side['mean_batch']:.2f}, step {side['step_ms']:.0f} ms (read wait "
                        f"{side['wait_ms'] or 0:.0f}), {side['mib_per_token'] or 0:.1f} MiB/token")
                if resident_fits:
                    res = run_side(opts.model, RunConfig(mode="resident", parallel=b, n_ctx=ctx, **common),
                                   PROMPTS[:b], opts.tokens)
                    res_rows[b].append(res)
                    line += f"; resident {res['tok_s']:.2f} tok/s, same tokens: {side['tokens'] == res['tokens']}"
                loads.append(os.getloadavg()[0])
                log(f"{line} (load {loads[-1]:.1f})")
        out: dict[str, Any] = {
            "model": str(opts.model), "tokens": opts.tokens, "rounds": opts.rounds,
            "ram_limit_gib": opts.ram_limit_bytes / (1 << 30) if opts.ram_limit_bytes else None,
            "cache": "auto", "loadavg": loads, "cores": os.cpu_count(), "streams": [],
            "how": "decode steps only: tokens emitted by decode steps over their wall time; medians over rounds",
        }
        base = statistics.median(s["tok_s"] for s in rows[counts[0]])
        base_res = statistics.median(s["tok_s"] for s in res_rows[counts[0]]) if resident_fits else None
        base_mib = statistics.median(s["mib_per_token"] or 0 for s in rows[counts[0]])
        for b in counts:
            agg = statistics.median(s["tok_s"] for s in rows[b])
            res = statistics.median(s["tok_s"] for s in res_rows[b]) if resident_fits else None
            mib = [s["mib_per_token"] for s in rows[b] if s["mib_per_token"] is not None]
            waits = [s["wait_ms"] for s in rows[b] if s["wait_ms"] is not None]
            out["streams"].append({
                "streams": b, "aggregate_tok_s": agg, "per_stream_tok_s": agg / b,
                "spread": [min(s["tok_s"] for s in rows[b]), max(s["tok_s"] for s in rows[b])],
                "gain_over_one": agg / base if base else None,
                "resident_aggregate_tok_s": res,
                "resident_gain_over_one": res / base_res if res and base_res else None,
                "mib_read_per_token": statistics.median(mib) if mib else None,
                "mib_per_token_vs_one": statistics.median(mib) / base_mib if mib and base_mib else None,
                "step_ms": statistics.median(s["step_ms"] for s in rows[b]),
                "read_wait_ms": statistics.median(waits) if waits else None,
                "mean_batch": statistics.median(s["mean_batch"] for s in rows[b]),
                "ttft_p50_s": None, "ttft_p95_s": None,
                "tokens_equal_resident": (all(a["tokens"] == r["tokens"] for a, r in zip(rows[b], res_rows[b]))
                                          if resident_fits else None),
            })
        if opts.draft != "none":
            out["draft"] = {}
            for name, prompt in (("copy", COPY), ("plain", PLAIN)):
                sides: dict[str, list[dict]] = {}
                for _ in range(opts.rounds):
                    for mode in ("draft", "plain"):
                        cfg = RunConfig(mode="stream", cache_bytes=cache, n_ctx=1024, **common,
                                        draft=opts.draft if mode == "draft" else "none")
                        sides.setdefault(mode, []).append(run_side(opts.model, cfg, [prompt], opts.tokens * 2))
                d, pl = sides["draft"], sides["plain"]
                row = {
                    "tokens_per_step": statistics.median(s["emitted"] / max(1, s["decode_steps"]) for s in d),
                    "accept_rate": statistics.median(s["accept_rate"] for s in d) if all(
                        s["accept_rate"] is not None for s in d) else None,
                    "tok_s_draft": statistics.median(s["tok_s"] for s in d),
                    "tok_s_plain": statistics.median(s["tok_s"] for s in pl),
                    "tokens_equal_plain": all(a["tokens"] == b["tokens"] for a, b in zip(d, pl)),
                    "tokens_equal_resident": None,
                }
                row["speedup"] = row["tok_s_draft"] / row["tok_s_plain"] if row["tok_s_plain"] else None
                out["draft"][name] = row
                log(f"draft, {name} prompt: {row}")
        return out
    finally:
        if balloon is not None:
            balloon.release()


def streams_markdown(result: dict[str, Any]) -> str:
    """The rows as a table."""
    head = ("| streams | aggregate tok/s | per stream | gain | resident gain | MiB/token (x one) | step ms | "
            "read wait ms | mean batch | same tokens as resident |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]

    def f(v: Any, fmt: str = ".2f") -> str:
        return "n/a" if v is None else format(v, fmt)

    for r in result["streams"]:
        lines.append(f"| {r['streams']} | {f(r['aggregate_tok_s'])} | {f(r['per_stream_tok_s'])} | "
                     f"{f(r['gain_over_one'])} | {f(r['resident_gain_over_one'])} | {f(r['mib_read_per_token'], '.1f')}"
                     f" ({f(r['mib_per_token_vs_one'])}) | {f(r['step_ms'], '.0f')} | {f(r['read_wait_ms'], '.0f')} | "
                     f"{f(r['mean_batch'])} | {r['tokens_equal_resident']} |")
    for name, d in (result.get("draft") or {}).items():
        lines.append(f"\ndraft, {name} prompt: {f(d['tok_s_draft'])} tok/s with drafts, {f(d['tok_s_plain'])} "
                     f"without ({f(d['speedup'])}x), {f(d['tokens_per_step'])} tokens per step, accepted "
                     f"{f(d['accept_rate'])}, same tokens: {d['tokens_equal_plain']}")
    return "\n".join(lines)


__all__ = ["measure_streams", "run_side", "streams_markdown"]
