"""Cold time to first token with and without prefill read-ahead (``--prefill-ahead``), side by side.

Each run is a fresh streamed session on an evicted file with an empty cache, the prompt as its
first turn (one batch): the case where a prompt's reads and its compute run in sequence. Rounds
alternate which configuration runs first. Prints one JSON line per run (TTFT = the prefill's wall,
bytes read by the prefill, the generated tokens equal to the other configuration's) and the median
TTFT ratio per length; nothing asserted.

    python bench/prefill_ahead.py MODEL [--lengths 50,200] [--cache-mb 4096] [--rounds 2] [-n 4]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from pathlib import Path

from prefill_ttft import prompt_of  # bench/prefill_ttft.py, beside this script

from bmoe.engine.config import MiB, RunConfig
from bmoe.engine.session import Session
from bmoe.io.pagecache import evict_file_cache


async def cold(model: Path, config: RunConfig, n_tokens: int, n: int) -> dict:
    evict_file_cache([model])
    with Session.open(model, config) as s:
        g = await s.generate(prompt_of(s, n_tokens), n, stop_at_end=False)
    st = g.stats
    return {"ttft_s": st.prefill_s, "prompt_tokens": st.prompt_tokens, "bytes_read": st.bytes_read,
            "tokens": g.tokens}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--lengths", default="50,200")
    ap.add_argument("--cache-mb", type=float, default=4096.0)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("-n", "--tokens", type=int, default=4)
    args = ap.parse_args()
    if not args.model.is_file():
        print(f"prefill_ahead: {args.model}: no such model file", file=sys.stderr)
        return 2
    base = RunConfig(mode="stream", n_ctx=2048, cache_bytes=int(args.cache_mb * MiB), prefill="batch")
    configs = {"plain": base, "prefill_ahead": RunConfig(**{**vars(base), "prefill_ahead": True})}
    for length in (int(x) for x in args.lengths.split(",")):
        ttft: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(args.rounds):
            names = list(configs) if r % 2 == 0 else list(reversed(configs))
            runs = {name: asyncio.run(cold(args.model, configs[name], length, args.tokens)) for name in names}
            same = runs["plain"]["tokens"] == runs["prefill_ahead"]["tokens"]
            for name, d in runs.items():
                ttft[name].append(d["ttft_s"])
                print(json.dumps({"length": length, "round": r, "run": name, **{k: v for k, v in d.items() if k != "tokens"},
                                  "same_tokens": same}), flush=True)
        a, b = statistics.median(ttft["plain"]), statistics.median(ttft["prefill_ahead"])
        print(f"{length} tokens, cold: plain {a:.2f} s, prefill-ahead {b:.2f} s ({b / a:.2f}x)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
