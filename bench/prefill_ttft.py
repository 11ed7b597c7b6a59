"""Time to first token per prefill strategy, cold and warm, against resident, side by side.

For each prompt length (5, 50, 200, 1000 tokens by default) and each strategy (one batch, auto,
expert-major, micro-batches, token by token, or those ``--strategies`` names; token-wise and micro
only up to ``--chunked-max`` tokens, since they are never cheaper past a few dozen tokens and the
run would take minutes):

- cold: a fresh streamed session on an evicted file, empty cache, the prompt as its first turn;
- warm: the same session after a first turn with another prompt (a follow-up turn);
- resident: plain llama.cpp with the file cached (the no-limit reference; warmed up first).

Reports the prefill wall (TTFT: the first token is the argmax of the prefill's logits), the bytes
the prefill read, its physical floor (those bytes at the device's direct-read rate for one expert
slice, from ``bmoe.io.probe``, plus the resident TTFT of the same prompt), the ratio of TTFT to
that floor, and the strategy ``auto`` chose with its reason. Checks each streamed run's tokens
against the resident run of the same batching. Nothing is asserted.

    python bench/prefill_ttft.py [--model M] [--lengths 5,50,200,1000] [--strategies batch,expert]
                                 [--cache-mb 1000] [-n 2] [-t T]

Default model: the benchmark generator's 8-layer qwen3-30b-a3b shape in q4_0 (3.3 GB, written once
into the user cache directory).
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.pagecache import evict_file_cache
from bmoe.io.probe import cache_dir, cached_probe
from bmoe.io.validate import open_layout
from bmoe.synth.big import SynthSpec, write_synth

DEFAULT = SynthSpec(like="qwen3-30b-a3b", n_layer=8, wtype="q4_0")
WORDS = ("the experts stream from disk while the router picks a few of many for every token and "
         "layer so that a model larger than memory still answers quickly").split()
FIRST_TURN = "Tell me how a mixture of experts model decides which experts run for each token."


def prompt_of(session: Session, n_tokens: int) -> str:
    """Text of about ``n_tokens`` tokens (words appended until the tokenizer says so)."""
    words: list[str] = []
    i = 0
    while len(session.tokenize(" ".join(words))) < n_tokens:
        words.append(WORDS[i % len(WORDS)])
        i += 1
    return " ".join(words)


async def turn(session: Session, prompt: str, n: int) -> dict:
    g = await session.generate(prompt, n, stop_at_end=False)
    choice, rec = session.prefill_choice, session.prefill_record
    return {
        "ttft_s": g.stats.prefill_s, "prompt_tokens": g.stats.prompt_tokens, "tokens": g.tokens,
        "prefill_bytes_read": rec.bytes_read if rec is not None else None,
        "strategy": choice.strategy if choice else None, "reason": choice.reason if choice else None,
    }


async def measure(path: Path, args: argparse.Namespace) -> dict:
    base = {"n_ctx": max(args.lengths) + 64, "n_threads": args.threads}
    out: dict = {"resident": {}, "cold": {}, "warm": {}}
    with Session.open(path, RunConfig(mode="resident", **base)) as res:
        prompts = {n: prompt_of(res, n) for n in args.lengths}
        await res.generate(FIRST_TURN, 1, stop_at_end=False)  # pages the file in
        for n in args.lengths:
            for strategy in ("batch", "micro", "token"):
                if strategy != "batch" and (n > args.chunked_max or strategy not in args.strategies):
                    continue
                object.__setattr__(res.config, "prefill", strategy)
                r = await turn(res, prompts[n], args.n)
                out["resident"][f"{n}/{strategy}"] = r
    for n in args.lengths:
        for strategy in args.strategies:
            if strategy in ("micro", "token") and n > args.chunked_max:
                continue
            config = RunConfig(mode="stream", cache_bytes=args.cache_mb * MiB, prefill=strategy, **base)
            evict_file_cache([path])
            with Session.open(path, config) as s:
                cold = await turn(s, prompts[n], args.n)
                await s.generate(FIRST_TURN, 8, stop_at_end=False)
                warm = await turn(s, prompts[n], args.n)
            out["cold"][f"{n}/{strategy}"] = cold
            out["warm"][f"{n}/{strategy}"] = warm
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None)
    ap.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[5, 50, 200, 1000])
    ap.add_argument("--strategies", type=lambda s: s.split(","), default=["batch", "auto", "expert", "micro", "token"])
    ap.add_argument("--cache-mb", type=int, default=1000)
    ap.add_argument("--chunked-max", type=int, default=50)
    ap.add_argument("-n", type=int, default=2, help="tokens per turn (the first is the TTFT one)")
    ap.add_argument("-t", "--threads", type=int, default=None)
    args = ap.parse_args()
    path = args.model or cache_dir() / "bench" / DEFAULT.file_name()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        write_synth(path, DEFAULT)
    layout = open_layout(path)
    slice_bytes = min(et.stride for et in layout.experts.values())
    probe = cached_probe(path.parent, slice_bytes, 2)
    out = asyncio.run(measure(path, args))
    device = probe.mib_s * MiB
    rows = []
    for phase in ("cold", "warm"):
        for key, r in out[phase].items():
            n, strategy = key.split("/")
            ref_strategy = "batch" if strategy in ("auto", "batch", "expert") else strategy
            ref = out["resident"].get(f"{n}/{ref_strategy}") or out["resident"].get(f"{n}/batch")
            if strategy == "auto" and r["strategy"] not in ("batch", "expert"):
                ref = out["resident"].get(f"{n}/{r['strategy']}", ref)
            floor = None
            if r["prefill_bytes_read"] is not None and ref is not None:
                floor = r["prefill_bytes_read"] / device + out["resident"][f"{n}/batch"]["ttft_s"]
            rows.append({
                "phase": phase, "prompt_tokens": r["prompt_tokens"], "strategy": strategy,
                "chose": r["strategy"], "ttft_s": r["ttft_s"],
                "resident_ttft_s": out["resident"][f"{n}/batch"]["ttft_s"],
                "prefill_mib_read": None if r["prefill_bytes_read"] is None else r["prefill_bytes_read"] / MiB,
                "floor_s": floor, "ttft_over_floor": None if floor is None else r["ttft_s"] / floor,
                "tokens_match_resident": None if ref is None else r["tokens"] == ref["tokens"],
                "reason": r["reason"],
            })
    print(f"device direct-read rate: {probe.mib_s:.0f} MiB/s ({probe.mode}, {slice_bytes} B slices, 2 lanes)")
    print(f"{'phase':5} {'tok':>5} {'strategy':8} {'chose':6} {'ttft s':>8} {'resid s':>8} {'MiB':>8} "
          f"{'floor s':>8} {'x floor':>7} match")
    for r in rows:
        def f(x, fmt):  # noqa: ANN001, ANN202
            return "null" if x is None else format(x, fmt)
        print(f"{r['phase']:5} {r['prompt_tokens']:>5} {r['strategy']:8} {r['chose'] or '-':6} "
              f"{f(r['ttft_s'], '8.3f')} {f(r['resident_ttft_s'], '8.3f')} {f(r['prefill_mib_read'], '8.1f')} "
              f"{f(r['floor_s'], '8.3f')} {f(r['ttft_over_floor'], '7.2f')} {r['tokens_match_resident']}")
    print(json.dumps({"model": str(path), "device_mib_s": probe.mib_s, "rows": rows}))


if __name__ == "__main__":
    main()
